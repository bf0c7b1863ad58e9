"""The gpt task with data workers parked on slow samples and the loop parked at a known step.

In a data worker (``torch.utils.data.get_worker_info()`` is set), after ``SLOW_AFTER`` samples
the dataset writes ``SLOW_DIR/worker-<pid>`` and waits while ``SLOW_DIR/workers`` exists: a
sample that takes as long as the test wants. In the training process, the loss of step
``PARK_STEP`` writes ``SLOW_DIR/loop`` and waits while ``SLOW_DIR/loop-gate`` exists, so that a
notice can be sent while the loop holds its batch and the workers are busy beyond it.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from trainer.task import Task, TaskContext
from trainer.tasks import gpt


def _park(marker: Path, gate: Path) -> None:
    marker.write_text(str(os.getpid()))
    while gate.exists():  # released (or not) by the test
        time.sleep(0.01)


class SlowDataset:
    def __init__(self, inner: object, dir: Path, after: int):
        self.inner, self.dir, self.after = inner, dir, after
        self.served = 0

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> object:
        if torch.utils.data.get_worker_info() is not None and self.served >= self.after:
            _park(self.dir / f"worker-{os.getpid()}", self.dir / "workers")
        self.served += 1
        return self.inner[i]  # type: ignore[index]


def build(ctx: TaskContext, **kw: object) -> Task:
    task = gpt.build(ctx, **kw)  # type: ignore[arg-type]
    d = Path(os.environ["SLOW_DIR"])
    task.dataset = SlowDataset(task.dataset, d, int(os.environ["SLOW_AFTER"]))
    park, calls = int(os.environ["PARK_STEP"]), [0]

    def loss_fn(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == park:
            _park(d / "loop", d / "loop-gate")
        return model(*batch)

    task.loss_fn = loss_fn
    return task
