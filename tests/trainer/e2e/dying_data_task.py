"""The gpt task whose data workers are killed while ``DIE_FILE`` exists: in a worker
(``torch.utils.data.get_worker_info()`` is set), each sample SIGKILLs the worker that loads it, as
the kernel's OOM killer does to a worker under memory pressure. The training process itself
loads the same samples unharmed."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import torch

from trainer.task import Task, TaskContext
from trainer.tasks import gpt


class DyingDataset:
    def __init__(self, inner: object, die: Path):
        self.inner, self.die = inner, die

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> object:
        if torch.utils.data.get_worker_info() is not None and self.die.exists():
            os.kill(os.getpid(), signal.SIGKILL)
        return self.inner[i]  # type: ignore[index]


def build(ctx: TaskContext, **kw: object) -> Task:
    task = gpt.build(ctx, **kw)  # type: ignore[arg-type]
    task.dataset = DyingDataset(task.dataset, Path(os.environ["DIE_FILE"]))
    return task
