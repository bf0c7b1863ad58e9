"""docs/trainer.md's example task with an evaluation that draws random numbers from every generator a
user's evaluation might: an eval set that augments (``mode = "dataset"``) or an eval callable
that samples (``mode = "callable"``). Training itself uses dropout, so an evaluation that left a
trace on the RNGs would change the weights."""
from __future__ import annotations

import random

import numpy as np
import torch

from trainer.task import Task, TaskContext
from tests.trainer import example_task


class NoisySquares(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        jitter = float(torch.rand(())) + random.random() + float(np.random.rand())
        x = torch.tensor([(i + jitter / 30) / 64.0])
        return x, x * x


def _sampled_loss(model: torch.nn.Module) -> dict[str, float]:
    x = torch.rand(32, 1) + random.random() * 0 + float(np.random.rand()) * 0
    return {"loss": float(torch.nn.functional.mse_loss(model.f(x), x * x)), "mean_x": float(x.mean())}


def build(ctx: TaskContext, mode: str = "dataset") -> Task:
    task = example_task.build(ctx)
    if mode == "dataset":
        task.eval_dataset = NoisySquares()
    else:
        task.evaluate = _sampled_loss
    return task
