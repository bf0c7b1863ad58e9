"""What the loop trains (``Job``: the task, its model under the run's parallelism, the data order,
the batches) and one optimizer step of it (``StepFn``).

``StepFn`` runs ``grad_accum_steps`` micro-batches with gradient sync on the last one only,
autocast and the grad scaler of the run's precision, clipping, the optimizer (after the last save's
copy of the weights, which runs beside the forwards and backwards, is done) and the scheduler, and
returns the step's loss and the task's own metrics (``trainer.task.loss_and_metrics``), averaged
over the micro-batches. The metrics are detached numbers: nothing of them reaches the weights, the
RNG or the data position, so exact resume holds with them.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import torch

from trainer.distributed import World
from trainer.loop import state
from trainer.loop.named_state import NamedStates
from trainer.task import Task, TaskError, loss_and_metrics


@dataclasses.dataclass
class Job:
    """The task as the loop trains it."""

    task: Task
    model: torch.nn.Module       # under DDP or FSDP2 when the run has several ranks
    data: Any                    # the data position: ``DataOrder``, a ``Stream`` (per rank), or None
    batches: Any                 # ``Batches`` or ``Stream``: this rank's micro-batches; None in an own loop
    scaler: Any                  # the grad scaler (fp16), or None
    fingerprint: dict            # the settings a resume must not change (``RunConfig.fingerprint``)
    accum: int                   # micro-batches per optimizer step on this rank
    world: World
    in_place: bool               # the checkpoint layout saves and loads the weights itself (FSDP)
    #: Called before the optimizer writes the weights and its state: a save's copy of them may
    #: still run beside the step (``Checkpointer.before_update``).
    before_update: Callable[[], Any] = lambda: True
    #: The job's named states (``Task.states``, or what an own loop tracks).
    states: NamedStates = dataclasses.field(default_factory=NamedStates)
    #: The trained models by name, as the step gets them (under DDP on several ranks): the main
    #: one as "model", and every declared module with parameters in a declared optimizer.
    models: dict[str, torch.nn.Module] = dataclasses.field(default_factory=dict)

    @property
    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        """Every declared optimizer by name, the main one as "optimizer"."""
        return {"optimizer": self.task.optimizer, **self.states.optimizers()}

    def declared(self) -> list[Any]:
        """Every object a checkpoint of this job holds (``trainer.loop.undeclared``)."""
        return [self.task.model, self.model, *self.models.values(), *self.optimizers.values(),
                self.task.scheduler, self.scaler, self.data, self.batches, getattr(self.batches, "loader", None),
                *self.states.objects.values()]

    @property
    def lr(self) -> float:
        return self.task.optimizer.param_groups[0]["lr"]

    def snapshot(self, step: int) -> dict | None:
        """What exact resume needs after ``step`` (rank 0; a collective under DDP): with a layout
        that saves the weights in place, only the replicated rest."""
        whole = not self.in_place
        return state.build(step=step, model=self.model if whole else None,
                           optimizer=self.task.optimizer if whole else None, scheduler=self.task.scheduler,
                           scaler=self.scaler, data=self.data, fingerprint=self.fingerprint, world=self.world,
                           states=self.states)

    def meta(self) -> dict:
        """The manifest's ``meta`` of this run's checkpoints."""
        return {"world_size": self.world.size, "fingerprint": self.fingerprint}


class StepFn:
    """One optimizer step: ``grad_accum_steps`` micro-batches, clipping, mixed precision."""

    def __init__(self, cfg: Any, job: Job, mixed: Any, device: torch.device):
        self.cfg, self.accum, self.model, self.task, self.batches = cfg, job.accum, job.model, job.task, job.batches
        self.scaler, self.device, self.world = mixed.scaler, device, job.world
        self.before_update = job.before_update
        self.loss_fn = job.task.loss_fn or (lambda m, batch: m(*batch))
        self.autocast: Callable[[], Any] = mixed.autocast
        self.job = job

    def _sync(self, last: bool) -> Any:
        """Gradients reduced on the last micro-batch only, for every trained model."""
        stack = contextlib.ExitStack()
        if not self.world.distributed:
            return stack
        for model in (self.job.models.values() or [self.model]):
            switch = getattr(model, "set_requires_gradient_sync", None)  # FSDP2: a switch, not a context
            no_sync = getattr(model, "no_sync", None)  # DDP
            if callable(switch):
                switch(last)
            elif not last and callable(no_sync):
                stack.enter_context(no_sync())
        return stack

    def __call__(self) -> tuple[float, dict[str, float]]:
        if getattr(self.task, "step", None) is not None:
            return self._own()
        accum, model, opt = self.accum, self.model, self.task.optimizer
        model.train()
        total = torch.zeros((), device=self.device)
        sums: dict[str, Any] = {}
        for micro in range(accum):
            batch = self.batches.next()
            last = micro == accum - 1
            # Under DDP/FSDP, reduce gradients only on the last micro-batch.
            with self._sync(last):
                with self.autocast():
                    loss, metrics = loss_and_metrics(self.loss_fn(model, batch))
                    loss = loss / accum
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            total += loss.detach()
            for name, value in metrics.items():
                value = value.detach().float().reshape(()) if torch.is_tensor(value) else float(value)
                sums[name] = sums.get(name, 0.0) + value / accum
        if self.cfg.grad_clip is not None:
            if self.scaler:
                self.scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), self.cfg.grad_clip)
        self.before_update()  # the last save's copy of the weights, if still running, ends first
        if self.scaler:
            self.scaler.step(opt)
            self.scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        if self.task.scheduler is not None:
            self.task.scheduler.step()
        return float(total), {name: float(v) for name, v in sums.items()}

    def _own(self) -> tuple[float, dict[str, float]]:
        """The task's own step, once per micro-batch (``OwnStep``)."""
        own = OwnStep(self)
        for model in self.job.models.values():
            model.train()
        total, sums = 0.0, dict[str, float]()
        for micro in range(self.accum):
            own.micro, own.last = micro, micro == self.accum - 1
            batch = self.batches.next()
            with self._sync(own.last):
                out = self.task.step(own, batch)  # type: ignore[misc]
            if out is None:
                raise TaskError("task: step returned nothing; return the loss to log, or (loss, {name: value})")
            loss, metrics = loss_and_metrics(out)
            total += float(loss.detach() if torch.is_tensor(loss) else loss) / self.accum
            for name, value in metrics.items():
                value = float(value.detach()) if torch.is_tensor(value) else float(value)
                sums[name] = sums.get(name, 0.0) + value / self.accum
        if not own.stepped:
            raise TaskError("task: step never called s.step(optimizer) on the last micro-batch: nothing was trained")
        if self.scaler and own.stepped:
            self.scaler.update()  # once per step, after every optimizer's (torch's multi-optimizer recipe)
        if self.task.scheduler is not None:
            self.task.scheduler.step()
        return total, sums


class OwnStep:
    """What a task's own ``step(s, batch)`` receives: the trained models as the step must call them
    (under DDP on several ranks: calling the wrapper is what all-reduces their gradients; never
    unwrap them), the optimizers by name, and the trainer's precision, accumulation and clipping.

    The step runs once per micro-batch (``micro`` of ``accum``; ``last`` on the last one): it
    computes its losses inside ``autocast()``, calls ``backward(loss)`` for each, and
    ``step(optimizer)`` for each optimizer it updates. ``backward`` divides by ``accum`` and scales
    for fp16; ``step`` acts on the last micro-batch only: unscale, clip to ``grad_clip`` (each
    optimizer its own parameters), wait for a save's copy of the weights, step, zero that
    optimizer's gradients. A GAN's alternation is two of each, in the order the step calls them.
    """

    def __init__(self, fn: StepFn):
        self._fn = fn
        self.models: dict[str, torch.nn.Module] = dict(fn.job.models) or {"model": fn.model}
        self.model = self.models.get("model", fn.model)
        self.optimizers = fn.job.optimizers
        self.accum, self.micro, self.last = fn.accum, 0, True
        self.stepped: list[str] = []

    def autocast(self) -> Any:
        return self._fn.autocast()

    def backward(self, loss: torch.Tensor) -> None:
        loss = loss / self.accum
        (self._fn.scaler.scale(loss) if self._fn.scaler else loss).backward()

    def _named(self, optimizer: str | torch.optim.Optimizer) -> tuple[str, torch.optim.Optimizer]:
        if isinstance(optimizer, str):
            if optimizer not in self.optimizers:
                raise TaskError(f"task: step: no optimizer named {optimizer!r} (declared: {', '.join(self.optimizers)})")
            return optimizer, self.optimizers[optimizer]
        for name, opt in self.optimizers.items():
            if opt is optimizer:
                return name, opt
        raise TaskError(f"task: step: an optimizer {type(optimizer).__name__} that the task never declared "
                        "(add it to Task.states)")

    def step(self, optimizer: str | torch.optim.Optimizer = "optimizer") -> None:
        """Update with ``optimizer`` (its name, or the object) on the last micro-batch."""
        name, opt = self._named(optimizer)
        if not self.last:
            return
        scaler, clip = self._fn.scaler, self._fn.cfg.grad_clip
        if clip is not None:
            if scaler:
                scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], clip)
        self._fn.before_update()  # the last save's copy of the weights, if still running, ends first
        if scaler:
            scaler.step(opt)
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        self.stepped.append(name)
