"""Read-only, verified access to a run's checkpoint: any tier, either layout, a chosen step.

``export`` and ``--init-from`` read another run (or a finished one) through here. It goes through
the checkpointer's own restore (``Checkpointer.restore(download=False)``, a read-only look) with
the layout the run's checkpoints have: every file is checked against its manifest before anything
is loaded, a remote copy is downloaded into a temporary folder that is removed afterwards, and
nothing on any tier is created, repaired or deleted.

Checkpoints count only when they authenticate under ``key`` (the run's checkpoint key,
``trainer.checkpoint.key``); a sharded checkpoint is never read without one (DCP unpickles).

Errors: ``NotFound`` (bad input: no valid checkpoint, or not the asked-for step, while every
tier could be listed; or a sharded source and no key) and ``Unreachable`` (a tier could not be
listed and nothing usable was found on the others: try again later).
"""
from __future__ import annotations

import dataclasses
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint.format import list_checkpoints
from trainer.checkpoint.manifest import OTHER_LAYOUT, other_layout, quarantined
from trainer.checkpoint.tiers import Tiers, tier_table

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


def survey(tiers: Tiers, key: Any = None,
           refused: list[str] | None = None) -> tuple[dict[str, list[int]], dict[str, list[int]], list[str]]:
    """Valid steps per tier of each layout ({tier: steps} whole-model, sharded) and the tiers
    that could not be listed ("tier: error"). Checkpoints that are quarantined but never read
    (unauthenticated, another format) are appended to ``refused`` ("tier step N: reason")."""
    from trainer.checkpoint.sharded import parse_sharded_manifest
    from trainer.checkpoint.whole_model import parse_manifest

    whole: dict[str, list[int]] = {}
    shards: dict[str, list[int]] = {}
    errors: list[str] = []
    for t in tiers:
        try:
            # An unreachable bucket is reported after a minute, not after the upload retry budget.
            with t.store.deadline(time.monotonic() + LIST_TIMEOUT_S):
                infos = list_checkpoints(t.store, parse_manifest, key=key)
                whole[t.name] = [i.step for i in infos if i.valid]
                if any(i.reason.startswith(OTHER_LAYOUT + "a sharded") for i in infos):
                    infos = list_checkpoints(t.store, parse_sharded_manifest, key=key)
                    shards[t.name] = [i.step for i in infos if i.valid]
                if refused is not None:
                    refused += [f"{t.name} step {i.step}: {i.reason}" for i in infos
                                if quarantined(i.reason) and not other_layout(i.reason)]
        except Exception as e:  # noqa: BLE001 - reported with the result
            errors.append(f"{t.name}: {type(e).__name__}: {e}")
    return whole, shards, errors


def read(*, run_dir: Path | None, gcs_uri: str | None, local_dir: Path | None = None, step: int | None = None,
         log: logging.Logger | None = None, key: Any = None) -> RunCheckpoint:
    """The newest valid checkpoint of the run (or the one of ``step``); see the module docstring.
    ``key``: the run's ``CheckpointKey`` (None: whole-model checkpoints unauthenticated, sharded
    ones refused)."""
    from trainer.checkpoint.checkpointer import Checkpointer
    from trainer.checkpoint.sharded import NEEDS_KEY, Sharded
    from trainer.checkpoint.whole_model import WholeModel

    log = log or logging.getLogger("trainer.reader")
    source = describe_source(run_dir, gcs_uri)
    with tempfile.TemporaryDirectory(prefix="spottrain-read-") as tmp:
        # A run known only by its bucket: an empty stand-in for its disk (never written).
        tiers = tier_table(run_dir if run_dir is not None else Path(tmp) / "no-run-dir", local_dir=local_dir,
                           gcs_uri=gcs_uri)
        refused: list[str] = []
        whole, shards, errors = survey(tiers, key, refused)
        in_whole = sorted({s for v in whole.values() for s in v}, reverse=True)
        in_shards = sorted({s for v in shards.values() for s in v}, reverse=True)
        use_whole = bool(in_whole) and (step is None or step in in_whole)
        use_shards = not use_whole and bool(in_shards) and (step is None or step in in_shards)
        if use_shards and key is None:
            raise NotFound(f"{source}: {NEEDS_KEY}")
        if use_whole or use_shards:
            ckpt = Checkpointer(tiers, WholeModel() if use_whole else Sharded(), key=key, log=log)
            try:
                restored = ckpt.restore(download=False, step=step)
            finally:
                ckpt.close()
            if restored is not None:
                state = restored.state if isinstance(restored.state, dict) else {}
                return RunCheckpoint(restored.step, use_shards, restored.model or {}, state, restored.tier,
                                     restored.path)
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
