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

from trainer.data.batches import Batches
from trainer.data.sampler import DataOrder
from trainer.distributed import World
from trainer.loop import state
from trainer.task import Task, loss_and_metrics


@dataclasses.dataclass
class Job:
    """The task as the loop trains it."""

    task: Task
    model: torch.nn.Module       # under DDP or FSDP2 when the run has several ranks
    data: DataOrder
    batches: Batches
    scaler: Any                  # the grad scaler (fp16), or None
    fingerprint: dict            # the settings a resume must not change (``RunConfig.fingerprint``)
    accum: int                   # micro-batches per optimizer step on this rank
    world: World
    in_place: bool               # the checkpoint layout saves and loads the weights itself (FSDP)
    #: Called before the optimizer writes the weights and its state: a save's copy of them may
    #: still run beside the step (``Checkpointer.before_update``).
    before_update: Callable[[], Any] = lambda: True

    @property
    def lr(self) -> float:
        return self.task.optimizer.param_groups[0]["lr"]

    def snapshot(self, step: int) -> dict | None:
        """What exact resume needs after ``step`` (rank 0; a collective under DDP): with a layout
        that saves the weights in place, only the replicated rest."""
        whole = not self.in_place
        return state.build(step=step, model=self.model if whole else None,
                           optimizer=self.task.optimizer if whole else None, scheduler=self.task.scheduler,
                           scaler=self.scaler, data=self.data, fingerprint=self.fingerprint, world=self.world)

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

    def _sync(self, last: bool) -> Any:
        model = self.model
        if not self.world.distributed:
            return contextlib.nullcontext()
        if hasattr(model, "set_requires_gradient_sync"):  # FSDP2: a switch, not a context
            model.set_requires_gradient_sync(last)
            return contextlib.nullcontext()
        return contextlib.nullcontext() if last else model.no_sync()

    def __call__(self) -> tuple[float, dict[str, float]]:
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
