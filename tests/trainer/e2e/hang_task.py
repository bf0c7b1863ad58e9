"""A user task whose data loader hangs while a flag file exists (for the health `stalled` test)."""
from __future__ import annotations

import os
import time
from pathlib import Path

from trainer.task import Task, TaskContext
from trainer.tasks import gpt


class HangingDataset:
    def __init__(self, inner: object, flag: Path):
        self.inner, self.flag = inner, flag

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> object:
        while self.flag.exists():  # a hung data loader, released by the test deleting the file
            time.sleep(0.01)
        return self.inner[i]  # type: ignore[index]


def build(ctx: TaskContext, **kw: object) -> Task:
    task = gpt.build(ctx, **kw)  # type: ignore[arg-type]
    task.dataset = HangingDataset(task.dataset, Path(os.environ["HANG_FLAG"]))
    return task
