"""A job's named state: every object beyond the main model and optimizer that a checkpoint holds.

A job declares them by name (``Task.states``, or ``Run.track`` in an own loop): anything with
``state_dict()``/``load_state_dict()``, the protocol of ``torch.distributed.checkpoint.stateful.
Stateful``: a second model and its optimizer (a GAN's discriminator), an EMA or ``AveragedModel``,
schedulers, a ``GradScaler``, a ``StatefulDataLoader``, a custom object. This module sorts them
and moves their state in and out of a checkpoint:

* **trained models**: modules with a parameter in a declared optimizer; the loop puts them under
  DDP like the main model (their gradients are all-reduced) and the step receives them wrapped;
* **per-rank state**: data loaders, whose position differs on every rank; gathered from every
  rank like the RNG streams, and put back on each rank (so a resume keeps the world size);
* everything else is replicated: rank 0's ``state_dict()`` is saved, every rank loads it.

Under ``parallelism = "fsdp"`` (``sharded``) every model among the states with parameters is
sharded like the main model, trained ones (a discriminator) with their optimizer, the others (an
EMA, a frozen copy) alone, and the sharded layout saves and loads their shards through DCP beside
the main model's (``shard_plan``); they leave the replicated rest.

A state must be plain data (``trainer.checkpoint.state_codec``): ``check`` walks every declared
state once at start-up, so an object whose state a checkpoint cannot hold is refused (exit 2)
before a step is trained, never at the first save. Their names and types are part of the resume
fingerprint: a resume with a state added, removed or of another type is refused.
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

#: A state's name: what a checkpoint key, an export file name and a log field can carry.
NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")
#: Names the main objects use in a checkpoint.
RESERVED = ("model", "optimizer", "scheduler", "scaler", "data", "rng", "step", "fingerprint")


class StateError(TypeError):
    """A declared state that cannot be checkpointed, or a name that cannot be used (exit 2)."""


def is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def per_rank(obj: Any) -> bool:
    """State that differs on every rank: a data loader's position (torchdata's StatefulDataLoader,
    or any object saying so with ``per_rank = True``)."""
    if getattr(obj, "per_rank", False) is True:
        return True
    return isinstance(obj, torch.utils.data.DataLoader) or type(obj).__name__ == "StatefulDataLoader"


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside a DDP wrapper; any other module as it is (an ``AveragedModel`` also has
    a ``.module``, and its own state, ``n_averaged``, belongs to the checkpoint)."""
    if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        return model.module
    return model


@dataclass
class NamedStates:
    """The declared states beyond the main model, optimizer, scheduler and scaler."""

    objects: dict[str, Any] = field(default_factory=dict)
    #: Names whose state the sharded layout holds in its shards (``shard_plan``), not the extras.
    sharded: set[str] = field(default_factory=set)

    @classmethod
    def declare(cls, states: dict[str, Any] | None, *, where: str, optimizers: list[torch.optim.Optimizer]) -> "NamedStates":
        """Check ``states`` (from ``where``, e.g. ``task trainer.tasks.gan:build``): names, the
        protocol, and no object declared twice; ``optimizers`` are the main one(s) already held."""
        out = cls()
        seen = {id(o) for o in optimizers}
        for name, obj in (states or {}).items():
            if not isinstance(name, str) or not NAME.match(name) or name in RESERVED:
                raise StateError(f"{where}: states: name {name!r} is not allowed: letters, digits, _ . - (64 at "
                                 f"most, not starting with a digit), and none of {', '.join(RESERVED)}")
            if isinstance(obj, torch.utils.data.DataLoader) and type(obj).__name__ != "StatefulDataLoader":
                raise StateError(f"{where}: states[{name!r}]: a torch DataLoader cannot save its position; use "
                                 "torchdata.stateful_dataloader.StatefulDataLoader (a drop-in replacement)")
            if not is_stateful(obj):
                raise StateError(f"{where}: states[{name!r}]: a {type(obj).__name__} has no state_dict()/"
                                 "load_state_dict(), so a checkpoint cannot hold it (declare an object that has them, "
                                 "e.g. torchdata's StatefulDataLoader instead of a DataLoader)")
            if id(obj) in seen:
                raise StateError(f"{where}: states[{name!r}]: this object is declared twice")
            seen.add(id(obj))
            out.objects[name] = obj
        return out

    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        return {n: o for n, o in self.objects.items() if isinstance(o, torch.optim.Optimizer)}

    def trained_models(self, optimized: set[int]) -> dict[str, torch.nn.Module]:
        """The modules with a parameter among ``optimized`` (ids of every declared optimizer's
        parameters): they train, so they go under DDP."""
        return {n: o for n, o in self.objects.items() if isinstance(o, torch.nn.Module)
                and any(id(p) in optimized for p in o.parameters())}

    def models(self) -> dict[str, torch.nn.Module]:
        """Every module among the states (trained or an EMA): what ``export`` writes by name."""
        return {n: o for n, o in self.objects.items() if isinstance(o, torch.nn.Module)}

    def fingerprint(self) -> dict[str, str]:
        """Names and types: a resume with another set is refused (``state.check_fingerprint``)."""
        return {n: _type_name(o) for n, o in self.objects.items()}

    def shard_plan(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   where: str) -> dict[str, tuple[torch.nn.Module, str | None, torch.optim.Optimizer | None]]:
        """The states the sharded layout shards (``parallelism = "fsdp"``): every model among them
        with parameters, by name, with the name and object of the optimizer that trains it (None
        for an EMA or a frozen copy); those names, and their optimizers', go to ``sharded``.

        A model's optimizer state is sharded with that model (``get_state_dict(model,
        optimizer)``), so each optimizer must hold the parameters of one model only, each model be
        trained by one optimizer at most, and no two models share a parameter; anything else is a
        ``StateError`` naming it (exit 2). An optimizer over parameters of no model stays
        replicated."""
        fsdp = "under parallelism = 'fsdp' "
        modules = {"model": model, **{n: o for n, o in self.models().items() if any(True for _ in o.parameters())}}
        owner: dict[int, str] = {}
        for name, m in modules.items():
            for p in m.parameters():
                if owner.setdefault(id(p), name) != name:
                    raise StateError(f"{where}: states[{name!r}]: its parameters are also {owner[id(p)]}'s; {fsdp}"
                                     "each model is sharded on its own: declare a model once, not a part of another (or use "
                                     "parallelism = 'ddp')")
        trains: dict[str, list[str]] = {}
        optimizers = {"optimizer": optimizer, **self.optimizers()}
        for oname, opt in optimizers.items():
            held = {owner.get(id(p)) for g in opt.param_groups for p in g["params"]}
            if len(held) > 1:
                spans = " and ".join(sorted("parameters of no model" if h is None else h for h in held))
                raise StateError(f"{where}: {_label(oname)}: it holds {spans}; {fsdp}an optimizer's state is sharded "
                                 "with its model, so each optimizer holds one model's parameters (one optimizer per "
                                 "model, or parallelism = 'ddp')")
            one = next(iter(held), None)
            if oname == "optimizer" and one != "model":
                raise StateError(f"{where}: Task.optimizer: it does not hold the parameters of Task.model; {fsdp}the "
                                 "main optimizer is sharded with the main model, so it trains that model (or use "
                                 "parallelism = 'ddp')")
            if one is not None:
                trains.setdefault(one, []).append(oname)
        if trains.get("model", ["optimizer"]) != ["optimizer"]:
            raise StateError(f"{where}: {_label(trains['model'][-1])}: it trains the main model, which "
                             f"Task.optimizer trains; {fsdp}each model has one optimizer (its state is sharded with "
                             "the model): merge their parameter groups into one, or use parallelism = 'ddp'")
        for name, opts in trains.items():
            if len(opts) > 1:
                raise StateError(f"{where}: states[{name!r}]: trained by {' and '.join(map(_label, opts))}; {fsdp}each "
                                 "model has one optimizer (its state is sharded with the model): merge their parameter "
                                 "groups into one, or use parallelism = 'ddp'")
        plan: dict[str, tuple[torch.nn.Module, str | None, torch.optim.Optimizer | None]] = {}
        for name, m in modules.items():
            if name != "model":
                opts = trains.get(name, [])
                plan[name] = (m, opts[0], optimizers[opts[0]]) if opts else (m, None, None)
        self.sharded = set(plan) | {o for _, o, _ in plan.values() if o is not None}
        return plan

    def replicated(self) -> dict[str, Any]:
        return {n: _state_dict(o) for n, o in self.objects.items() if not per_rank(o) and n not in self.sharded}

    def rank_local(self) -> dict[str, Any]:
        return {n: _state_dict(o) for n, o in self.objects.items() if per_rank(o) and n not in self.sharded}

    def has_rank_local(self) -> bool:
        return any(per_rank(o) for o in self.objects.values())

    def load(self, replicated: dict[str, Any] | None, rank_local: dict[str, Any] | None) -> None:
        """Put a checkpoint's states back; a state missing from it is a ``KeyError`` (the caller
        turns it into a refusal naming the checkpoint)."""
        for name, obj in self.objects.items():
            saved = (rank_local if per_rank(obj) else replicated) or {}
            if name in self.sharded:
                if name in saved:  # written before it was sharded (a frozen model): each rank takes its shard
                    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

                    set_model_state_dict(obj, saved[name], options=StateDictOptions(full_state_dict=True))
                continue  # else loaded with the shards (``trainer.checkpoint.sharded``)
            if name not in saved:
                raise KeyError(f"the checkpoint has no state {name!r}")
            if isinstance(obj, torch.nn.Module):
                unwrap(obj).load_state_dict(saved[name])
            else:
                obj.load_state_dict(saved[name])

    def check(self, where: str) -> None:
        """Every state is plain data now (``state_codec``), before any step: exit 2 naming it."""
        from trainer.checkpoint import state_codec

        for name, obj in self.objects.items():
            try:
                state_codec.encode(_state_dict(obj), lambda t, path: None, (("key", "states"), ("key", name)))
            except state_codec.NotPlainData as e:
                raise StateError(f"{where}: states[{name!r}]: its state_dict() holds what a checkpoint cannot hold "
                                 f"without pickle: {e}") from None


def _type_name(obj: Any) -> str:
    """The class the job made: FSDP2's ``fully_shard`` swaps a module's class for a subclass of
    its own (``FSDPNet``), which is there on several ranks and not in one process."""
    cls = type(obj)
    fsdp = sys.modules.get("torch.distributed.fsdp")  # never imported: nothing was sharded
    FSDPModule = getattr(fsdp, "FSDPModule", None)  # noqa: N806 - the class's own name
    if FSDPModule is not None and issubclass(cls, FSDPModule):
        cls = next(c for c in cls.__mro__ if not issubclass(c, FSDPModule))
    return cls.__name__


def _label(optimizer: str) -> str:
    return "Task.optimizer" if optimizer == "optimizer" else f"states[{optimizer!r}]"


def _state_dict(obj: Any) -> Any:
    return unwrap(obj).state_dict() if isinstance(obj, torch.nn.Module) else obj.state_dict()
