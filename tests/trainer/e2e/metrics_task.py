"""The bundled GPT task whose ``loss_fn`` also returns per-step metrics of its own: the same loss
(so the same weights as the plain task), plus ``ppl`` (the loss's exponential) and ``tokens`` (the
micro-batch's target tokens). Its loader is the gate task's, which a test can hold."""
from __future__ import annotations

from typing import Any

import torch

from trainer.task import Task, TaskContext
from tests.trainer.e2e import gate_task


def loss_with_metrics(model: torch.nn.Module, batch: tuple) -> tuple[torch.Tensor, dict[str, Any]]:
    loss = model(*batch)
    return loss, {"ppl": loss.detach().float().exp(), "tokens": batch[-1].numel()}


def build(ctx: TaskContext, **task_args: Any) -> Task:
    task = gate_task.build(ctx, **task_args)
    task.loss_fn = loss_with_metrics
    return task
