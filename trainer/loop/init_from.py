"""``--init-from SOURCE``: a new run that starts from another run's checkpoint.

SOURCE is the other run's run dir or its ``gs://`` prefix; its newest valid checkpoint is used,
or the one of ``init_from_step``. Or SOURCE is a weights file, ``FILE.safetensors`` (a path or a
``gs://`` object): what ``python -m trainer export`` writes, or any plain state dict, e.g. a run of
another experiment (whose checkpoints are signed with that experiment's key, which this run does
not hold) or pretrained weights from elsewhere. Nothing in it is code (safetensors is tensors and
a JSON header), so it needs no key; its sha256 goes into the provenance, so what was loaded is on
record. Only the weights by default; with ``init_from_optimizer`` also
the optimizer state. Everything else starts fresh: step 0, the data order from the start, the LR
schedule and the RNG from this run's seed. The loop calls ``apply`` only while this run has no
checkpoint of its own; after its first save it resumes from its own checkpoints like any run.

The source is read through the verified read-only path (``trainer.checkpoint.reader``: every file checked
against its manifest, nothing on the source changed). Its model must have this model's parameter
names and shapes (``load_state_dict(strict=True)``); anything else is bad input (exit 2), as is a
source without a valid checkpoint. Layouts: weights go from either layout into either (a
whole-model checkpoint into an FSDP run, a sharded one into a DDP run, resharded to any world
size); the optimizer state only between runs of the same parallelism. The optimizer state is the
per-parameter state (Adam's moments and step counts); the optimizer's settings (lr, betas,
weight decay) stay those this task built it with.

``apply`` returns the provenance (source, step, location, layout, optimizer, digest of the
weights), which the loop records in the ledger (``init_from``) and in the fingerprint of every
checkpoint of this run, so its manifests say where it came from. It is provenance, not a
setting: a resume never compares it.
"""
from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

import torch

from trainer.checkpoint import broadcast
from trainer.distributed import World


class InitFromError(Exception):
    """Bad input for ``--init-from`` (exit 2)."""


def _source(cfg: Any) -> tuple[Path | None, str | None]:
    src: str = cfg.init_from
    if src.startswith("gs://"):
        if cfg.gcs_uri is not None and src.rstrip("/") == cfg.gcs_uri.rstrip("/"):
            raise InitFromError(f"init_from: {src} is this run's own gcs_uri; name another run")
        return None, src
    path = Path(src)
    if not path.is_dir():
        raise InitFromError(f"init_from: {src} is not a directory (a run dir) nor a gs:// prefix")
    if path.resolve() == Path(cfg.run_dir).resolve():
        raise InitFromError(f"init_from: {src} is this run's own run_dir; name another run")
    return path.resolve(), None


WEIGHTS_SUFFIX = ".safetensors"


def is_weights_file(source: str) -> bool:
    return source.endswith(WEIGHTS_SUFFIX)


def _read_weights_file(cfg: Any, log: logging.Logger) -> Any:
    """A weights file as a whole-model source at step 0 of its own (weights only)."""
    import hashlib

    from safetensors.torch import load

    from trainer.checkpoint import reader

    src: str = cfg.init_from
    if cfg.init_from_optimizer:
        raise InitFromError(f"init_from_optimizer: {src} holds weights only (a .safetensors file); "
                            "name a run dir or gs:// prefix for its optimizer state")
    if cfg.init_from_step is not None:
        raise InitFromError(f"init_from_step: {src} is one set of weights, it has no steps")
    try:
        if src.startswith("gs://"):
            from trainer.checkpoint.stores import GcsStore, parse_gcs_uri

            bucket, key = parse_gcs_uri(src)
            parent, _, name = key.rpartition("/")
            data = GcsStore(f"gs://{bucket}/{parent}" if parent else f"gs://{bucket}").get_bytes(name)
        else:
            data = Path(src).read_bytes()
    except (FileNotFoundError, KeyError):  # a store's missing object is a KeyError (trainer.checkpoint.stores)
        raise InitFromError(f"init_from: {src}: no such file") from None
    try:
        weights = load(data)
    except Exception as e:  # noqa: BLE001 - whatever the parser says, it is not a weights file
        raise InitFromError(f"init_from: {src} is not a safetensors file: {_first_lines(e)}") from None
    sha256 = hashlib.sha256(data).hexdigest()
    log.info("init_from: read %d tensors (%d bytes, sha256 %s) from %s", len(weights), len(data), sha256, src)
    return reader.RunCheckpoint(step=0, sharded=False, model=weights, state={"file_sha256": sha256},
                                tier="file", location=src)


def _read(cfg: Any, log: logging.Logger) -> Any:
    """The source's checkpoint (this process only); InitFromError for bad input."""
    from trainer.checkpoint import reader

    if is_weights_file(cfg.init_from):
        return _read_weights_file(cfg, log)
    run_dir, gcs_uri = _source(cfg)
    try:
        # The source must be signed with this run's checkpoint key (runs of one experiment, or local
        # runs under one per-user key); one under another key is refused as unauthenticated.
        return reader.read(run_dir=run_dir, gcs_uri=gcs_uri, step=cfg.init_from_step, log=log,
                           key=cfg.checkpoint_key())
    except reader.NotFound as e:
        raise InitFromError(f"init_from: {e}") from None


def _on_main(world: World, fn: Any, *, state: bool = False) -> Any:
    """``fn()`` on rank 0, its result on every rank; an error there is raised on every rank (as
    InitFromError when it was bad input) instead of leaving the others waiting. With ``state``,
    ``fn`` returns (weights and optimizer state, small rest): the small rest goes through pickle, the
    state as tensors (``trainer.checkpoint.broadcast``: a pickled view would carry its whole
    buffer once per tensor)."""
    out: Any = None
    big: Any = None
    if world.is_main:
        try:
            got = fn()
            big, got = got if state else (None, got)
            out = ("ok", got)
        except InitFromError as e:
            out = ("bad", str(e))
        except Exception as e:  # noqa: BLE001 - travels to every rank
            out = ("error", f"init_from: {type(e).__name__}: {e}")
    out = world.broadcast(out)
    if out[0] == "bad":
        raise InitFromError(out[1])
    if out[0] == "error":
        raise RuntimeError(out[1])
    if not state:
        return out[1]
    big, _ = broadcast.broadcast_state(world, big)
    return big, out[1]


def provenance(cfg: Any, found: Any, digest: str) -> dict[str, Any]:
    prov = {"source": cfg.init_from, "step": found.step, "location": found.location,
            "layout": "sharded" if found.sharded else "whole-model",
            "optimizer": bool(cfg.init_from_optimizer), "digest": digest}
    if found.tier == "file":
        prov.update(layout="weights-file", file_sha256=found.state["file_sha256"])
    return prov


def apply(cfg: Any, world: World, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
          sharded_run: Any = None, log: logging.Logger) -> dict[str, Any]:
    """Load the source's weights (and optimizer state) into ``model`` (``optimizer``) on every
    rank; the provenance. ``sharded_run``: this run's checkpointer when it is an FSDP run (its
    model is sharded: the sharded layout loads it), else None. A collective."""
    from trainer.checkpoint.format import tensor_digest

    if sharded_run is not None:
        return _apply_sharded(cfg, world, model, optimizer, sharded_run, log)

    def read() -> tuple[dict, dict]:
        found = _read(cfg, log)
        if cfg.init_from_optimizer and found.sharded:
            raise InitFromError(_layouts("fsdp", "ddp"))
        opt = found.state.get("optimizer") if cfg.init_from_optimizer else None
        return {"model": found.model, "optimizer": opt}, provenance(cfg, found, tensor_digest(found.model))

    loaded, prov = _on_main(world, read, state=True)
    weights, opt_state = loaded["model"], loaded["optimizer"]
    _load_model(getattr(model, "module", model), weights, prov)
    if opt_state is not None:
        _load_optimizer(optimizer, opt_state, prov)
    return prov


def _layouts(source: str, run: str) -> str:
    return (f'init_from_optimizer: the source was trained with parallelism = "{source}" and this run has '
            f'"{run}"; optimizer state moves only between runs of the same parallelism (weights alone move '
            "between either: leave out --init-from-optimizer)")


def _load_model(model: torch.nn.Module, weights: dict, prov: dict) -> None:
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as e:
        raise InitFromError(f"init_from: the model of {prov['location']} does not fit this task's model "
                            f"(same parameter names and shapes needed): {_first_lines(e)}") from None


@contextlib.contextmanager
def _keeping_settings(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Load an optimizer's state but keep this task's settings: ``load_state_dict`` would also
    bring back the source's lr, betas and weight decay, and a run seeded to be fine-tuned with its
    own settings would silently train with the old ones."""
    settings = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    yield
    for group, mine in zip(optimizer.param_groups, settings):
        group.update(mine)


def _load_optimizer(optimizer: torch.optim.Optimizer, state: dict, prov: dict) -> None:
    try:
        with _keeping_settings(optimizer):
            optimizer.load_state_dict(state)
    except (ValueError, KeyError, RuntimeError) as e:
        raise InitFromError(f"init_from_optimizer: the optimizer state of {prov['location']} does not fit "
                            f"this task's optimizer: {_first_lines(e)}") from None
    for group in optimizer.param_groups:
        for p in group["params"]:
            for name, v in optimizer.state.get(p, {}).items():
                if torch.is_tensor(v) and v.dim() > 0 and v.shape != p.shape:
                    raise InitFromError(
                        f"init_from_optimizer: the optimizer state of {prov['location']} does not fit this "
                        f"task's optimizer: {name} has shape {tuple(v.shape)} for a parameter of shape "
                        f"{tuple(p.shape)}")


def _first_lines(e: BaseException) -> str:
    return " ".join(str(e).split())[:800]


# --------------------------------------------------------------------------------------------
# An FSDP run: every rank holds a shard
# --------------------------------------------------------------------------------------------


def _apply_sharded(cfg: Any, world: World, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   ckpt: Any, log: logging.Logger) -> dict[str, Any]:
    """A sharded source is loaded by DCP straight into the shards (resharded to this world
    size): each node leader verifies the source folder in place, or downloads it into a
    temporary folder on this run's disk; a whole-model source's weights are read by rank 0 and
    scattered into the shards. Every rank first checks the names and shapes, so that a mismatch
    is refused on every rank alike (and DCP, which loads what the model asks for, never loads a
    part of a larger model silently)."""
    from trainer.checkpoint.format import tensor_digest

    kept: dict[str, dict] = {}  # rank 0: the whole-model source's weights

    def survey() -> tuple[dict, dict]:
        found = _read(cfg, log)
        if not found.sharded and cfg.init_from_optimizer:
            raise InitFromError(_layouts("ddp", "fsdp"))
        if not found.sharded:
            kept["weights"] = found.model
        return {k: tuple(v.shape) for k, v in found.model.items()}, provenance(cfg, found, tensor_digest(found.model))

    shapes, prov = _on_main(world, survey)
    _check_shapes(model, shapes, prov)
    if prov["layout"] in ("whole-model", "weights-file"):
        _scatter_weights(model, kept.get("weights", {}))
        return prov
    group = ckpt.layout.group
    folder, tmp = _sharded_folder(cfg, prov) if group.is_leader else (None, None)
    try:
        folders = group.all(folder)
        mine = folders[group.leader_of[group.rank]]
        if any(f is None or f.startswith("error: ") for r, f in enumerate(folders) if group.leader_of[r] == r):
            why = "; ".join(f for f in folders if f and f.startswith("error: "))
            raise RuntimeError(f"init_from: no verified copy of {prov['location']} on every node: {why}")
        errs = group.all(_try_load(ckpt.layout, Path(mine), model, optimizer if cfg.init_from_optimizer else None))
        bad = [f"rank {r}: {e}" for r, e in enumerate(errs) if e]
        if bad:
            raise InitFromError(f"init_from: the checkpoint {prov['location']} does not fit this task's model"
                                f"{' and optimizer' if cfg.init_from_optimizer else ''}: " + "; ".join(bad)[:1500])
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return prov


def _check_shapes(model: torch.nn.Module, shapes: dict, prov: dict) -> None:
    mine = {k: tuple(v.shape) for k, v in model.state_dict().items()}  # DTensors: the global shape
    missing, unexpected = sorted(set(mine) - set(shapes)), sorted(set(shapes) - set(mine))
    wrong = [f"{k}: {shapes[k]} vs {mine[k]}" for k in sorted(set(mine) & set(shapes)) if shapes[k] != mine[k]]
    if missing or unexpected or wrong:
        raise InitFromError(
            f"init_from: the model of {prov['location']} does not fit this task's model (same parameter names "
            "and shapes needed): " + "; ".join(
                ([f"missing {', '.join(missing[:10])}"] if missing else [])
                + ([f"unexpected {', '.join(unexpected[:10])}"] if unexpected else [])
                + ([f"size mismatch {', '.join(wrong[:10])}"] if wrong else [])))


def _sharded_folder(cfg: Any, prov: dict) -> tuple[str, Path | None]:
    """Leader: a folder of the source's step on this node that verifies under this run's key
    (what DCP then reads, so it is verified here again, not trusted from the reader's look),
    (path or "error: ...", temp dir to remove)."""
    from trainer.checkpoint.manifest import step_name
    from trainer.checkpoint.sharded import download_sharded, verify_sharded_dir
    from trainer.checkpoint.stores import GcsStore

    run_dir, gcs_uri = _source(cfg)
    step = int(prov["step"])
    key = cfg.checkpoint_key()
    try:
        if run_dir is not None and (run_dir / step_name(step)).is_dir():
            verify_sharded_dir(run_dir / step_name(step), key=key)
            return str(run_dir / step_name(step)), None
        if run_dir is not None and gcs_uri is None:
            return f"error: {run_dir / step_name(step)} is not on this node", None
        assert gcs_uri is not None  # _source gives a run dir or a gs:// prefix
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-init-from-", dir=cfg.run_dir))
        return str(download_sharded(GcsStore(gcs_uri), step, tmp, key=key)), tmp
    except Exception as e:  # noqa: BLE001 - travels to every rank
        return f"error: {type(e).__name__}: {e}", None


def _try_load(layout: Any, folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> str | None:
    try:
        with _keeping_settings(optimizer) if optimizer is not None else contextlib.nullcontext():
            layout.load_into(folder, model, optimizer)
        return None
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        lines = [x.strip() for x in str(e).splitlines() if x.strip()]
        return (lines[-1] if lines else type(e).__name__)[:500]


def _scatter_weights(model: torch.nn.Module, weights: dict) -> None:
    """Rank 0's full state dict into every rank's shards (the others pass {})."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    distributed = dist.is_available() and dist.is_initialized()
    set_model_state_dict(model, weights, options=StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=distributed, strict=True))
