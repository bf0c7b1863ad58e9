"""The trained weights out of the trainer's format: a plain state dict in safetensors.

``python -m trainer export --run-dir DIR | --gcs-uri URI [--local-dir D] [--step N] --out FILE.safetensors``
reads the newest valid checkpoint (or step N) through the verified read-only path
(``trainer.checkpoint.reader``), gathers a sharded one into full tensors, and writes:

* ``FILE.safetensors``: the model's ``state_dict()`` with the names the model class itself uses
  (no ``module.``/``_orig_mod.``/FSDP wrapper parts), every tensor in its own storage, so that
  ``model.load_state_dict(safetensors.torch.load_file(FILE), strict=True)`` loads it into a freshly
  built model of the user's class. Tied weights (GPT's embedding and output head) are written
  under both names, each a copy: safetensors refuses tensors that share memory, and
  ``strict=True`` wants every key; loading copies both into the one shared parameter.
* ``FILE.json`` next to it, the sidecar: ``step``, ``task``, ``task_args``, ``digest``
  (``trainer.checkpoint.format.tensor_digest`` of the exported tensors, equal to ``status``'s
  ``model_digest``), ``source`` (the checkpoint folder or gs:// prefix), ``torch_version``, the
  layout it came from, and where the run itself started from (``init_from``), if anywhere.

Both files are written to temporary names and renamed (the sidecar last). The safetensors bytes
depend only on the weights (no time stamp), so exporting the same checkpoint twice gives the same
file. Exit status: 0 written, 2 bad input (no checkpoint, no such step, --out not writable), 1
the source could not be read (a tier unreachable).

A finished run exports itself once (``auto_export``): after the final checkpoint is durable, to
``<gcs_uri>/export/step-N/model.safetensors`` and ``model.json`` (create-only, the sidecar last,
skipped when the sidecar is already there: re-running a finished run never exports again), or,
without GCS, to ``RUN_DIR/export/step-N/``. A failed export is logged and leaves the run finished
(``python -m trainer export`` does the same by hand).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any

import torch

from trainer import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_FINISHED
from trainer.checkpoint.stores import TMP_PREFIX, fsync_dir

FORMAT = "spottrain-export"
VERSION = 1
DIR = "export"
MODEL = "model.safetensors"
SIDECAR = "model.json"
#: Name parts that wrappers add to a model's parameter names (torch.compile, FSDP1, activation
#: checkpointing); the user's own model class has none of them.
_WRAPPER_PARTS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


class ExportError(Exception):
    """Bad input for an export (exit 2); the message says what and where."""


def plain_state_dict(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The model state dict as the user's model class names it, every tensor a contiguous CPU
    copy in its own storage (see the module docstring)."""
    names = list(state)
    if "n_averaged" in state and len(names) > 1 and all(n.startswith("module.") for n in names if n != "n_averaged"):
        names.remove("n_averaged")  # torch's AveragedModel (an EMA): the averaged model's own weights
        state = {n: state[n] for n in names}
    strip_module = bool(names) and all(n.startswith("module.") for n in names)
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if not torch.is_tensor(t):
            continue  # an extra state object (get_extra_state): not a weight
        key = name.removeprefix("module.") if strip_module else name
        key = ".".join(p for p in key.split(".") if p not in _WRAPPER_PARTS)
        if key in out:
            raise ExportError(f"two tensors of the model map to the name {key!r} ({name!r} and another)")
        out[key] = t.detach().to("cpu").contiguous().clone()
    return out


def sidecar_path(out: Path) -> Path:
    return out.with_suffix(".json")


def named_models(found: Any) -> dict[str, dict[str, torch.Tensor]]:
    """The job's other models by name (``Task.states``: a GAN's discriminator, an EMA), each as
    its class names its weights."""
    state = found.state or {}
    return {name: plain_state_dict(state["states"][name]) for name in state.get("state_models", [])
            if name in state.get("states", {})}


def model_file(out: Path, name: str) -> Path:
    """Where the model named ``name`` is written beside ``out``: ``model-ema.safetensors``."""
    return out.with_name(f"{out.stem}-{name}{out.suffix}")


def write(out: Path, found: Any) -> dict[str, Any]:
    """Write ``found`` (a ``reader.RunCheckpoint``) to ``out``, each named model beside it
    (``model_file``), and the sidecar last; the sidecar."""
    from safetensors.torch import save_file

    from trainer.checkpoint.format import tensor_digest

    tensors = plain_state_dict(found.model)
    others = named_models(found)
    fp = found.fingerprint
    sidecar = {
        "format": FORMAT, "version": VERSION,
        "step": found.step, "task": fp.get("task"), "task_args": fp.get("task_args"),
        "digest": tensor_digest(tensors), "digest_function": "trainer.checkpoint.format.tensor_digest",
        "source": found.location, "tier": found.tier,
        "layout": "sharded" if found.sharded else "whole-model", "parallelism": fp.get("parallelism"),
        "seed": fp.get("seed"), "steps": fp.get("steps"), "init_from": fp.get("init_from"),
        "tensors": len(tensors), "parameters": sum(t.numel() for t in tensors.values()),
        "torch_version": torch.__version__, "safetensors_version": _safetensors_version(),
        "file": out.name,
        "models": {name: {"file": model_file(out, name).name, "digest": tensor_digest(t), "tensors": len(t)}
                   for name, t in others.items()},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f"{TMP_PREFIX}{out.name}-{uuid.uuid4().hex[:8]}"
    try:
        for path, t in [(out, tensors), *((model_file(out, n), t) for n, t in others.items())]:
            save_file(t, str(tmp), metadata={"format": "pt"})
            _fsync(tmp)
            os.replace(tmp, path)
        _write_atomic(sidecar_path(out), (json.dumps(sidecar, indent=1, sort_keys=True) + "\n").encode())
        fsync_dir(out.parent)
    finally:
        tmp.unlink(missing_ok=True)
    return sidecar


def _safetensors_version() -> str:
    import safetensors

    return getattr(safetensors, "__version__", "?")


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.parent / f"{TMP_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _check_out(out: Path) -> None:
    """Bad --out before anything is read (exit 2)."""
    if out.suffix != ".safetensors":
        raise ExportError(f"command line: out: {out} must end in .safetensors (the sidecar is {out.stem}.json)")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise ExportError(f"command line: out: cannot write {out}: directory {parent} does not exist")
    if out.is_dir():
        raise ExportError(f"command line: out: {out} is a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ExportError(f"command line: out: cannot write {out}: directory {parent} is not writable")


def main(cfg: Any) -> int:
    """``python -m trainer export`` (``cfg``: ``config.ExportConfig``)."""
    from trainer.checkpoint import reader

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s %(message)s")
    try:
        _check_out(cfg.out)
        if cfg.run_dir is not None and cfg.gcs_uri is None and not cfg.run_dir.is_dir():
            raise ExportError(f"command line: run_dir: {cfg.run_dir} is not a directory")
        from trainer.checkpoint.key import KeyProblem, resolve

        try:
            key = resolve(cfg.checkpoint_key_file, create_default=False)
        except KeyProblem as e:
            raise ExportError(f"command line: {e}") from None
        found = reader.read(run_dir=cfg.run_dir, gcs_uri=cfg.gcs_uri, local_dir=cfg.local_dir, step=cfg.step,
                            key=key)
        try:
            sidecar = write(cfg.out, found)
        except OSError as e:  # a full or read-only disk, permissions
            raise ExportError(f"command line: out: cannot write {cfg.out}: {e.strerror or e}") from None
    except ExportError as e:
        print(e, file=sys.stderr)
        return EXIT_BAD_INPUT
    except reader.NotFound as e:
        print(f"export: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except reader.Unreachable as e:
        print(f"export: {e}", file=sys.stderr)
        return EXIT_FAILED
    print(f"exported step {sidecar['step']} ({sidecar['tensors']} tensors, {sidecar['parameters']} parameters) "
          f"from {sidecar['source']} to {cfg.out}; sidecar {sidecar_path(cfg.out)}; digest {sidecar['digest']}")
    return EXIT_FINISHED


# --------------------------------------------------------------------------------------------
# A finished run's own export
# --------------------------------------------------------------------------------------------


def auto_export(cfg: Any, step: int, log: logging.Logger, *, abort: Any = None) -> str | None:
    """Export step ``step`` of this run once (see the module docstring); where it is, or None
    when it failed (logged). ``cfg``: the run's ``RunConfig``; ``abort``: a ``threading.Event``
    that gives up the uploads when set (a notice)."""
    import contextlib

    from trainer.checkpoint import reader
    from trainer.checkpoint.stores import GcsStore

    key = f"{DIR}/step-{step:08d}"
    store = GcsStore(cfg.gcs_uri) if cfg.gcs_uri else None
    try:
        if store is not None:
            where = store.location(key)
            if store.list(f"{key}/{SIDECAR}"):
                log.info("event=export step=%d already=1 at=%s", step, where)
                return where
        else:
            where = str(cfg.run_dir / key)
            if (cfg.run_dir / key / SIDECAR).is_file():
                log.info("event=export step=%d already=1 at=%s", step, where)
                return where
        found = reader.read(run_dir=cfg.run_dir, gcs_uri=cfg.gcs_uri, local_dir=cfg.local_dir, step=step, log=log,
                            key=cfg.checkpoint_key())
        if store is None:
            sidecar = write(cfg.run_dir / key / MODEL, found)
        else:
            stage = cfg.run_dir / f"{TMP_PREFIX}export-{uuid.uuid4().hex[:8]}"
            try:
                sidecar = write(stage / MODEL, found)
                if abort is not None and abort.is_set():
                    raise InterruptedError("a notice came")
                with store.aborting(abort) if abort is not None else contextlib.nullcontext():
                    store.put_file(stage / MODEL, f"{key}/{MODEL}")
                    for other in sidecar["models"].values():
                        store.put_file(stage / other["file"], f"{key}/{other['file']}")
                    try:
                        store.put_file(stage / SIDECAR, f"{key}/{SIDECAR}")  # last: the export's commit record
                    except FileExistsError:
                        pass  # another attempt's sidecar (its answer was lost): that export stands
            finally:
                shutil.rmtree(stage, ignore_errors=True)
        log.info("event=export step=%d at=%s digest=%s", step, where, sidecar["digest"])
        return where
    except Exception as e:  # noqa: BLE001 - the run has finished; the export can be redone by hand
        log.warning("event=export ok=0 step=%d error=%s: %s (the run is finished; `python -m trainer export` "
                    "writes it by hand)", step, type(e).__name__, str(e)[:500])
        return None
