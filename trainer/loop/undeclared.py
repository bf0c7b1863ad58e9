"""Nothing silent: state a job changes but never declared is refused (exit 2), never lost at a resume.

A checkpoint holds what the job declared (the model, the optimizer, ``Task.states``, what an own
loop tracks). A port that keeps the user's code can change more: a second optimizer stepped inside
``loss_fn``, an EMA updated by a hook beside the model, a scheduler, a plain ``DataLoader`` whose
iterator is half-way through an epoch. Such a run would resume with other weights and still exit 0.
``Guard`` finds them the first time they move:

* an optimizer that steps without having been declared: torch's global optimizer pre-hook
  (``torch.optim.optimizer.register_optimizer_step_pre_hook``) raises before it changes anything;
  the same hook lets a declared optimizer's step wait for a save's copy of the weights that may
  still run beside it (``before_update``), whoever calls ``step()``;
* anything else, after the first step: every live module, optimizer, LR scheduler and object with
  ``state_dict()``/``load_state_dict()`` outside the declared ones is looked at before the first step
  and after it (a tensor's in-place version counter, a scheduler's position, a stateful object's
  state); what moved is refused, naming its type and where it lives; so is a torch ``DataLoader``
  iterator left open by the step (a position a restart would lose).

The first step is trained in memory but nothing is saved: the refusal comes before any checkpoint.
"""
from __future__ import annotations

import gc
from typing import Any, Callable, Iterable

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from trainer.loop.named_state import is_stateful


class Undeclared(Exception):
    """State the job changes but did not declare (bad input: exit 2)."""


_HOW = ("declare it (Task.states, or run.track(NAME=obj) in your own loop) so a checkpoint holds it; "
        "docs/bring-your-own-model.md")


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Tensors an object holds directly (a module's own parameters and buffers, not its
    children's: every submodule is visited on its own)."""
    if isinstance(obj, torch.nn.Module):
        return [*obj.parameters(recurse=False), *obj.buffers(recurse=False)]
    if isinstance(obj, torch.optim.Optimizer):
        return [p for g in obj.param_groups for p in g["params"]] + [
            t for s in obj.state.values() for t in s.values() if torch.is_tensor(t)]
    out: list[torch.Tensor] = []
    for v in getattr(obj, "__dict__", {}).values():
        if torch.is_tensor(v):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(x for x in v if torch.is_tensor(x))
        elif isinstance(v, dict):
            out.extend(x for x in v.values() if torch.is_tensor(x))
    return out


def _declared_tensors(objects: Iterable[Any]) -> set[int]:
    ids: set[int] = set()
    for o in objects:
        if isinstance(o, torch.nn.Module):
            ids.update(id(t) for t in [*o.parameters(), *o.buffers()])
        else:
            ids.update(id(t) for t in _tensors(o))
    return ids


def _position(obj: Any) -> Any:
    """What moves in an object without tensors of its own (an LR scheduler's position, a
    stateful object's state), or None when it cannot be read cheaply."""
    if isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
        return (obj.last_epoch, getattr(obj, "_step_count", None))
    try:
        from trainer.checkpoint import state_codec

        return repr(state_codec.encode(obj.state_dict(), lambda t, path: (id(t), t._version)))
    except Exception:  # noqa: BLE001 - an object whose state cannot be read is judged by its tensors alone
        return None


def _describe(obj: Any) -> str:
    if isinstance(obj, torch.optim.Optimizer):
        n = sum(len(g["params"]) for g in obj.param_groups)
        return f"an optimizer {type(obj).__name__} over {n} parameter tensors"
    if isinstance(obj, torch.nn.Module):
        return f"a module {type(obj).__name__} ({sum(t.numel() for t in _tensors(obj))} values of its own)"
    return f"a {type(obj).__module__}.{type(obj).__qualname__}"


class Guard:
    """Watches for undeclared state from its creation until ``close``."""

    def __init__(self, declared: Iterable[Any], *, before_update: Callable[[], Any] = lambda: True):
        self.declared = [o for o in declared if o is not None]
        self.before_update = before_update
        self._ids = {id(o) for o in self.declared}
        self._optimizers = {id(o) for o in self.declared if isinstance(o, torch.optim.Optimizer)}
        self._hook = register_optimizer_step_pre_hook(self._pre_step)
        self._before: dict[int, tuple[Any, list[tuple[torch.Tensor, int]], Any]] | None = None

    def _pre_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if id(optimizer) not in self._optimizers:
            raise Undeclared(f"{_describe(optimizer)} stepped, but the job never declared it: its state would be "
                             f"in no checkpoint and a resumed run would differ; {_HOW}")
        self.before_update()

    def _candidates(self) -> list[Any]:
        skip = _declared_tensors(self.declared)
        kinds: dict[type, bool] = {}  # per class: a few hundred classes among ~10^5 objects
        out = []
        for o in gc.get_objects():
            cls = type(o)
            kind = kinds.get(cls)
            if kind is None:
                # Asked of the type, never the object: an object's own ``__getattr__`` (a proxy, a
                # lazy module, pytest's ``mark``) may do anything when asked for what it lacks.
                kind = kinds[cls] = (
                    issubclass(cls, (torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler))
                    or (not issubclass(cls, type) and is_stateful(cls)))
            if not kind or id(o) in self._ids or o is self:
                continue
            own = _tensors(o)
            if isinstance(o, torch.nn.Module):  # a module is its own tensors; its children are visited apart
                if any(id(t) not in skip for t in own):
                    out.append(o)
            elif not (own and all(id(t) in skip for t in own)):
                out.append(o)
        return out

    def before_first_step(self) -> None:
        """Look at everything undeclared, once, before the first step."""
        self._before = {}
        for o in self._candidates():
            if isinstance(o, torch.optim.Optimizer):
                continue  # the pre-hook refuses it if it steps
            self._before[id(o)] = (o, [(t, t._version) for t in _tensors(o)],
                                   None if isinstance(o, torch.nn.Module) else _position(o))

    def after_first_step(self) -> None:
        """Refuse (``Undeclared``) what moved during the first step."""
        before, self._before = self._before, None
        if before is None:
            return
        moved = []
        for o, versions, position in before.values():
            if any(t._version != v for t, v in versions) or (position is not None and _position(o) != position):
                moved.append(_describe(o))
        if moved:
            raise Undeclared(f"the first step changed state the job never declared ({'; '.join(sorted(set(moved))[:5])}"
                             f"): a resumed run would start it afresh and differ; {_HOW}")
        iters = torch.utils.data.dataloader._BaseDataLoaderIter
        open_iters = [o for o in gc.get_objects() if issubclass(type(o), iters)
                      and not getattr(o, "_spottrain", False) and not type(o).__module__.startswith("torchdata")]
        if open_iters:
            raise Undeclared("the first step left a torch DataLoader iterating that the job never declared: its position "
                             "is lost at a restart; use torchdata's StatefulDataLoader and declare it, or run.batches("
                             "dataset); docs/bring-your-own-model.md")

    def close(self) -> None:
        self._hook.remove()
