"""The example user task of docs/trainer.md (kept here so the documentation is tested).

``SIGTERM_AT_FETCH`` (tests only) makes the dataset send this process a real SIGTERM at the
N-th sample fetch: a preemption notice in the middle of a gradient-accumulation cycle.
"""
from __future__ import annotations

import os
import signal

import torch

from trainer.task import Task, TaskContext

FETCHES = [0]


class Squares(torch.utils.data.Dataset):  # map-style, a pure function of the index
    def __len__(self) -> int:
        return 4096

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        FETCHES[0] += 1
        if FETCHES[0] == int(os.environ.get("SIGTERM_AT_FETCH", "0")):
            os.kill(os.getpid(), signal.SIGTERM)
        x = torch.tensor([i / 4096.0])
        return x, x * x


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = torch.nn.Sequential(torch.nn.Linear(1, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                     torch.nn.Linear(64, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # returns the scalar loss
        return torch.nn.functional.mse_loss(self.f(x), y)


def build(ctx: TaskContext, lr: float = 1e-3) -> Task:
    model = Net().to(ctx.device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=ctx.steps)
    return Task(model=model, optimizer=opt, scheduler=sched, dataset=Squares())
