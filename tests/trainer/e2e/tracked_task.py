"""The bundled GPT task with a custom ``Stateful`` of its own declared in ``Task.states``: a
running mean of the loss, updated in ``loss_fn``, which a resume must continue, not restart."""
from __future__ import annotations

from typing import Any

import torch

from trainer.task import Task, TaskContext
from trainer.tasks import gpt


class LossTracker:
    def __init__(self) -> None:
        self.mean = torch.zeros((), dtype=torch.float64)
        self.count = 0

    def update(self, loss: torch.Tensor) -> None:
        self.mean.mul_(0.9).add_(0.1 * float(loss.detach()))
        self.count += 1

    def state_dict(self) -> dict[str, Any]:
        return {"mean": self.mean, "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.mean.copy_(state["mean"])
        self.count = int(state["count"])


def build(ctx: TaskContext, **task_args: Any) -> Task:
    task = gpt.build(ctx, **task_args)
    tracker = LossTracker()
    inner = task.loss_fn or (lambda m, batch: m(*batch))

    def loss_fn(model: torch.nn.Module, batch: tuple) -> Any:
        out = inner(model, batch)
        tracker.update(out[0] if isinstance(out, tuple) else out)
        return out

    task.loss_fn, task.states = loss_fn, {"tracker": tracker}
    return task
