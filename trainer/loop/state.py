"""The exact-resume state: what goes into a checkpoint, and putting it back.

A checkpoint at step N holds everything that decides steps N+1.. of the run: the model, optimizer,
LR scheduler and grad scaler state, the RNG state of Python, torch CPU and every CUDA device *on
every rank*, the data position, the step, and the fingerprint of the settings that must not change
across a resume. Restoring all of it makes the continued run bit-for-bit the uninterrupted one.

At another world size (an elastic job lost or gained a node) the per-rank RNG streams cannot be
carried over: every rank then reseeds from (seed, step, rank), so that a run taking the same
world-size path reaches the same result whether or not it was interrupted on the way.
"""
from __future__ import annotations

import random
from typing import Any

import torch

# ResumeMismatch: a checkpoint written with other settings is the same refusal as one of another
# layout, which the checkpointer raises; both are the manifest's.
from trainer.checkpoint.manifest import ResumeMismatch
from trainer.distributed import World
from trainer.loop.named_state import NamedStates, unwrap

FORMAT = 1


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np  # only if the task uses it; numpy is not a dependency

        state["numpy"] = _numpy_state(np.random.get_state(legacy=False))
    except ImportError:
        pass
    return state


def _numpy_state(s: dict[str, Any]) -> dict[str, Any]:
    """numpy's global RNG state as plain values (a checkpoint holds no pickled numpy objects):
    the MT19937 key as a list of ints, the position, and the cached Gaussian."""
    return {"bit_generator": str(s["bit_generator"]),
            "state": {"key": [int(x) for x in s["state"]["key"]], "pos": int(s["state"]["pos"])},
            "has_gauss": int(s["has_gauss"]), "gauss": float(s["gauss"])}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    # A restored tensor may be a view into a shared load buffer; the RNG setters need a
    # standalone contiguous ByteTensor (torch segfaults on some views), so copy first.
    torch.set_rng_state(_own(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_own(t) for t in state["cuda"]])
    if "numpy" in state:
        import numpy as np

        s = state["numpy"]
        np.random.set_state({**s, "state": {"key": np.array(s["state"]["key"], dtype=np.uint32),
                                            "pos": s["state"]["pos"]}})


def _own(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", torch.uint8).contiguous().clone()


def build(
    *,
    step: int,
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any | None,
    scaler: Any | None,
    data: Any | None,
    fingerprint: dict[str, Any],
    world: World,
    states: NamedStates | None = None,
) -> dict[str, Any] | None:
    """The state to save after ``step`` optimizer steps (on rank 0; None on the other ranks).

    A collective under DDP: every rank must call it at the same step. With ``model`` and
    ``optimizer`` None (sharded training) it is the small replicated rest, the "extras" saved
    next to the shards. ``data``: the trainer's data position (``DataOrder``, or a streaming
    loader's, which is per rank), None when the job keeps no data of the trainer's. ``states``:
    the job's named states (``trainer.loop.named_state``), replicated ones from rank 0, per-rank
    ones from every rank.
    """
    rngs = world.gather(rng_state())
    streamed = data is not None and getattr(data, "per_rank", False)
    local = states.rank_local() if states is not None else {}
    if data is not None and streamed:
        local["$data"] = data.state_dict()
    rank_states = world.gather(local) if local else None
    if not world.is_main:
        return None
    out = {
        "format": FORMAT,
        "step": step,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "scaler": scaler.state_dict() if scaler is not None and scaler.is_enabled() else None,
        "rng": rngs,  # one per rank, indexed by rank
        "data": None if data is None or streamed else data.state_dict(),
        "fingerprint": fingerprint,
        "torch": torch.__version__,  # compared at resume: a change is reported (check_versions)
    }
    if states is not None and states.objects:
        out["states"] = states.replicated()
        out["state_models"] = sorted(states.models())  # what ``export`` writes beside the model
    if rank_states is not None:
        out["rank_states"] = rank_states  # one per rank, indexed by rank, like "rng"
    if model is not None and optimizer is not None:
        out["model"] = unwrap(model).state_dict()
        out["optimizer"] = optimizer.state_dict()
    return out


#: Fingerprint keys that record where a run came from rather than a setting: never compared.
PROVENANCE = ("world_size", "init_from")
#: Fingerprint keys added after checkpoints existed. A checkpoint without one predates the key, so
#: what its run used is unknown: the resume is accepted with a warning naming the key (refusing
#: would strand every running job at its next restart; see ``unrecorded``), and its next
#: checkpoint records the key.
LATER_KEYS = ("threads", "deterministic", "device", "data_url")


def check_fingerprint(saved: dict[str, Any], current: dict[str, Any], *, step: int | None = None,
                      extend_steps: bool = False) -> tuple[int, int] | None:
    """Refuse a resume whose settings differ from the checkpoint's (``ResumeMismatch``).

    ``steps`` may differ only with ``extend_steps`` and never below ``step`` (the step the
    checkpoint reached); returns (old total, new total) when it does, else None.
    """
    if not isinstance(saved, dict):
        raise ResumeMismatch(f"cannot resume: the checkpoint's settings fingerprint is {saved!r}, not a "
                             "table of settings (a checkpoint of another program?)")
    # Checkpoints written before elastic training recorded the world size; it may now change.
    saved = {k: v for k, v in saved.items() if k not in PROVENANCE}
    # A key the checkpoint predates is unknown, not different (LATER_KEYS).
    current = {k: v for k, v in current.items() if k not in PROVENANCE and (k in saved or k not in LATER_KEYS)}
    change = None
    old, new = saved.get("steps"), current.get("steps")
    if old != new and isinstance(old, int) and isinstance(new, int):
        if not extend_steps:
            raise ResumeMismatch(
                f"cannot resume: steps: checkpoint has {old}, this run has {new}; to continue this run to "
                f"{new} steps, say so with --extend-steps (extend_steps = true), or use a new "
                "--run-dir/--gcs-uri for a new run")
        if step is not None and new < step:
            raise ResumeMismatch(
                f"cannot resume: steps: {new} is below step {step}, which the checkpoint has already "
                f"reached (extend_steps changes the total to no less than the step reached)")
        change = (old, new)
        saved, current = dict(saved, steps=new), current
    diffs = [
        f"{k}: checkpoint has {saved.get(k)!r}, this run has {current.get(k)!r}"
        for k in sorted(set(saved) | set(current))
        if saved.get(k) != current.get(k)
    ]
    if diffs:
        raise ResumeMismatch(
            "cannot resume: these settings differ from the run that wrote the checkpoint "
            "(use the original settings, or a new --run-dir/--gcs-uri for a new run): " + "; ".join(diffs)
        )
    return change


def unrecorded(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Warnings naming the fingerprint keys the checkpoint predates (``LATER_KEYS``)."""
    return [f"event=fingerprint_unrecorded key={k} value={current[k]!r} (the checkpoint predates this "
            "setting in the fingerprint: resuming with this run's value; if the run used another one, "
            "the results differ from an uninterrupted run)" for k in LATER_KEYS if k in current and k not in saved]


def check_versions(saved: dict[str, Any]) -> list[str]:
    """Warnings when the checkpoint was written by another PyTorch. Not refused: the VM image
    brings its own PyTorch and a recreated VM boots the image family's newest, so refusing
    would strand a job at an ordinary image update; another version only stops the run from
    being bit-identical to an uninterrupted one (other kernels, other rounding)."""
    then = saved.get("torch")
    if not isinstance(then, str) or then == torch.__version__:
        return []
    return [f"event=torch_version_change from={then} to={torch.__version__} (resuming; results are no "
            "longer bit-identical to an uninterrupted run)"]


def apply(
    state: dict[str, Any],
    *,
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any | None,
    scaler: Any | None,
    data: Any | None,
    world: World,
    steps_changed: bool = False,
    source: str = "the checkpoint",
    states: NamedStates | None = None,
) -> int:
    """Load ``state`` into the live objects; returns the step to continue from.

    The caller has already broadcast the state to every rank and checked the fingerprint.
    ``steps_changed``: the run's total was changed (``extend_steps``); see ``load_scheduler``.
    A state that verified but does not load into these objects (a changed shape, a missing key:
    the code changed since it was written) is a ``ResumeMismatch`` naming ``source`` (e.g. "step
    1200 on gcs (gs://...)") and the reason: never a reason to start afresh over it.
    """
    local = state.get("rank_states")
    if local is not None and saved_world_size(state) != world.size:
        raise ResumeMismatch(
            f"cannot resume at world size {world.size}: {source} was written by {saved_world_size(state)} ranks and "
            f"holds a position per rank ({', '.join(sorted(local[0]))}: a streaming dataset or data loader), which "
            "cannot be split over another number of ranks; resume with the original world size")
    try:
        return _apply(state, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, data=data,
                      world=world, steps_changed=steps_changed, states=states)
    except (RuntimeError, KeyError, ValueError, TypeError, IndexError, AttributeError) as e:
        reason = " ".join(str(e).split())[:1500]
        raise ResumeMismatch(
            f"cannot resume from {source}: the checkpoint verified but does not load into this model, "
            f"optimizer or task ({type(e).__name__}: {reason}); use the code and settings that wrote it, or a "
            "new --run-dir/--gcs-uri for a new run (nothing was deleted)") from None


def _apply(state: dict[str, Any], *, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None,
           scheduler: Any | None, scaler: Any | None, data: Any | None, world: World, steps_changed: bool,
           states: NamedStates | None) -> int:
    local = state.get("rank_states")
    if model is not None:  # None: sharded state, already loaded by the sharded checkpointer
        unwrap(model).load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and state["scheduler"] is not None:
        load_scheduler(scheduler, state["scheduler"], steps_changed=steps_changed)
    if scaler is not None and state["scaler"] is not None:
        scaler.load_state_dict(state["scaler"])
    mine = local[world.rank] if local is not None else {}
    if data is not None:
        data.load_state_dict(mine["$data"] if getattr(data, "per_rank", False) else state["data"])
    if states is not None:
        states.load(state.get("states"), mine)
    step = int(state["step"])
    if saved_world_size(state) == world.size:
        set_rng_state(state["rng"][world.rank])
    else:
        reseed(int(state["fingerprint"]["seed"]), step, world.rank)
    return step


#: A torch LR scheduler's position; the rest of its state (T_max, total_steps, phases) is how
#: it was built.
_SCHEDULE_POSITION = ("last_epoch", "_step_count", "_last_lr", "_get_lr_called_within_step", "_is_initial")


def load_scheduler(scheduler: Any, saved: Any, *, steps_changed: bool = False) -> None:
    """Restore ``scheduler``. After a change of the run's total, a plain torch LR scheduler keeps
    how the task built it now (with the new ``ctx.steps``: ``T_max``, ``total_steps``, phases)
    and takes only its position from the checkpoint, so it runs on over the new total instead
    of the old one (OneCycleLR would otherwise refuse to step past its old end). Schedulers that
    hold other schedulers or metrics (SequentialLR, ChainedScheduler, ReduceLROnPlateau) and
    the task's own objects are restored whole."""
    from torch.optim import lr_scheduler as lrs

    plain = isinstance(scheduler, lrs.LRScheduler) and not isinstance(
        scheduler, (lrs.SequentialLR, lrs.ChainedScheduler, lrs.ReduceLROnPlateau))
    if steps_changed and plain and isinstance(saved, dict):
        saved = {**scheduler.state_dict(), **{k: saved[k] for k in _SCHEDULE_POSITION if k in saved}}
    scheduler.load_state_dict(saved)


def saved_world_size(state: dict[str, Any]) -> int:
    """The world size that wrote ``state`` (one RNG state per rank)."""
    return len(state["rng"])


def reseed(seed: int, step: int, rank: int) -> None:
    """Fresh, reproducible RNG streams for ``rank`` from ``step`` on (after a world-size change)."""
    mixed = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + (rank + 1) * 0x94D049BB133111EB) % 2**63
    random.seed(mixed)
    torch.manual_seed(mixed)


def model_digest(model_state: dict[str, torch.Tensor]) -> str:
    """The model's content digest (``trainer.checkpoint.format.tensor_digest``)."""
    from trainer.checkpoint.format import tensor_digest

    return tensor_digest(model_state)
