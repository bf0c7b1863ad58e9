"""A user task whose data loader stops at a known sample while a flag file exists.

Each process serves ``GATE_AFTER`` samples, then waits for the test to delete ``GATE_FLAG``: every
rank is then parked at the same step, so a node can be killed at an exact, known point. Without
the flag (the reference runs) it is the gpt task unchanged; the task string is part of the resume
fingerprint, so reference runs use this task too.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from trainer.task import Task, TaskContext
from trainer.tasks import gpt


class GatedDataset:
    def __init__(self, inner: object, flag: Path | None, after: int):
        self.inner, self.flag, self.after = inner, flag, after
        self.served = 0

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> object:
        if self.flag is not None and self.served >= self.after:
            while self.flag.exists():  # parked; the test deletes the file to let it go on
                time.sleep(0.01)
        self.served += 1
        return self.inner[i]  # type: ignore[index]


def build(ctx: TaskContext, **kw: object) -> Task:
    task = gpt.build(ctx, **kw)  # type: ignore[arg-type]
    flag = os.environ.get("GATE_FLAG")
    task.dataset = GatedDataset(task.dataset, Path(flag) if flag else None, int(os.environ.get("GATE_AFTER", "0")))
    return task
