"""Read-only, verified access to a run's checkpoint: any tier, either layout, a chosen step.

``export`` and ``--init-from`` read another run (or a finished one) through here. It goes through
the same verified load paths as a restore (``Checkpointer.restore(download=False)`` for the
whole-model layout, ``sharded.inspect`` for the sharded one): every file is checked against its
manifest before anything is loaded, a GCS copy is downloaded into a temporary folder that is
removed afterwards, and nothing on any tier is created, repaired or deleted.

Checkpoints count only when they authenticate under ``key`` (the run's checkpoint key,
``trainer.checkpoint.key``); a sharded checkpoint is never read without one (DCP unpickles).

Errors: ``NotFound`` (bad input: no valid checkpoint, or not the asked-for step, while every
tier could be listed; or a sharded source and no key) and ``Unreachable`` (a tier could not be listed and nothing usable was
found on the others: try again later).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint.format import OTHER_LAYOUT, kept, list_checkpoints, other_layout, parse_manifest
from trainer.checkpoint.stores import GcsStore, Store

#: Seconds a listing of a bucket may take before it counts as unreachable.
LIST_TIMEOUT_S = 60.0


class NotFound(Exception):
    """No usable checkpoint at the source (bad input)."""


class Unreachable(Exception):
    """A tier of the source could not be read (a fault, not bad input)."""


@dataclasses.dataclass
class RunCheckpoint:
    step: int
    sharded: bool
    model: dict[str, torch.Tensor]  # the full (unsharded) model state dict, on CPU
    state: dict  # whole-model layout: the saved state; sharded: the replicated extras
    tier: str
    location: str  # the checkpoint folder or gs:// prefix it was read from

    @property
    def fingerprint(self) -> dict:
        fp = self.state.get("fingerprint") if isinstance(self.state, dict) else None
        return fp if isinstance(fp, dict) else {}


def describe_source(run_dir: Path | None, gcs_uri: str | None) -> str:
    return " and ".join(str(x) for x in (run_dir, gcs_uri) if x is not None)


def survey(stores: dict[str, Store], key: Any = None,
           refused: list[str] | None = None) -> tuple[dict[str, list[int]], dict[str, list[int]], list[str]]:
    """Valid steps per tier of each layout ({tier: steps} whole-model, sharded) and the tiers
    that could not be listed ("tier: error"). Checkpoints that are kept but never read
    (unauthenticated, another format) are appended to ``refused`` ("tier step N: reason")."""
    from trainer.checkpoint.sharded import list_sharded

    whole: dict[str, list[int]] = {}
    shards: dict[str, list[int]] = {}
    errors: list[str] = []
    for name, store in stores.items():
        try:
            # An unreachable bucket is reported after a minute, not after the upload retry budget.
            scope = store.deadline(time.monotonic() + LIST_TIMEOUT_S) if isinstance(store, GcsStore) \
                else contextlib.nullcontext()
            with scope:
                infos = list_checkpoints(store, parse_manifest, key=key)
                whole[name] = [i.step for i in infos if i.valid]
                if any(i.reason.startswith(OTHER_LAYOUT + "a sharded") for i in infos):
                    infos = list_sharded(store, key=key)
                    shards[name] = [i.step for i in infos if i.valid]
                if refused is not None:
                    refused += [f"{name} step {i.step}: {i.reason}" for i in infos
                                if kept(i.reason) and not other_layout(i.reason)]
        except Exception as e:  # noqa: BLE001 - reported with the result
            errors.append(f"{name}: {type(e).__name__}: {e}")
    return whole, shards, errors


def read(*, run_dir: Path | None, gcs_uri: str | None, local_dir: Path | None = None, step: int | None = None,
         log: logging.Logger | None = None, key: Any = None) -> RunCheckpoint:
    """The newest valid checkpoint of the run (or the one of ``step``); see the module docstring.
    ``key``: the run's ``CheckpointKey`` (None: whole-model checkpoints unauthenticated, sharded
    ones refused)."""
    from trainer.checkpoint import sharded
    from trainer.checkpoint.key import KeyProblem
    from trainer.checkpoint.checkpointer import Checkpointer

    log = log or logging.getLogger("trainer.reader")
    source = describe_source(run_dir, gcs_uri)
    with tempfile.TemporaryDirectory(prefix="spottrain-read-") as tmp:
        # A run known only by its bucket: an empty stand-in for its disk (never written).
        ckpt = Checkpointer(run_dir=run_dir if run_dir is not None else Path(tmp) / "no-run-dir",
                            local_dir=local_dir, gcs_uri=gcs_uri, log=log, key=key)
        try:
            stores = {n: t.store for n, t in ckpt._tiers.items()}
            if run_dir is None:
                stores.pop("persistent")
            refused: list[str] = []
            whole, shards, errors = survey(stores, key, refused)
            in_whole = sorted({s for v in whole.values() for s in v}, reverse=True)
            in_shards = sorted({s for v in shards.values() for s in v}, reverse=True)
            use_whole = bool(in_whole) and (step is None or step in in_whole)
            use_shards = not use_whole and bool(in_shards) and (step is None or step in in_shards)
            if use_whole:
                restored = ckpt.restore(download=False, step=step)
                if restored is not None:
                    return RunCheckpoint(restored.step, False, restored.state["model"], restored.state,
                                         restored.tier, restored.path)
            elif use_shards:
                try:
                    found = sharded.inspect(stores, step, key=key)
                except KeyProblem as e:
                    raise NotFound(f"{source}: {e}") from None
                if found is not None:
                    got, tier, location, model, extras = found
                    return RunCheckpoint(got, True, model, extras if isinstance(extras, dict) else {}, tier,
                                         location)
        finally:
            ckpt.close()
    valid = sorted(set(in_whole) | set(in_shards), reverse=True)
    if errors:
        raise Unreachable(f"cannot read {source}: " + "; ".join(errors)
                          + (f" (valid elsewhere: steps {_steps(valid)})" if valid else ""))
    if not valid:
        raise NotFound(f"no valid checkpoint at {source}" + (
            f"; never read: {'; '.join(refused[:3])}" if refused else ""))
    if step is not None and step not in valid:
        raise NotFound(f"no valid checkpoint of step {step} at {source} (valid: steps {_steps(valid)})")
    raise NotFound(f"no checkpoint at {source} passed verification (steps {_steps(valid)} looked valid; "
                   "see the warnings above)")


def _steps(steps: list[int]) -> str:
    return ", ".join(map(str, steps[:10])) + (", ..." if len(steps) > 10 else "")


__all__ = ["NotFound", "RunCheckpoint", "Unreachable", "read", "survey"]
