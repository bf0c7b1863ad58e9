"""The chaos matrix's task: the bundled GPT task whose data loader can park the trainer at chosen
steps, so that the harness injects a fault at an exact, known point of the run instead of racing it.

``CHAOS_PARK_DIR`` names a folder, ``CHAOS_PARK_STEPS`` the steps to park at (comma-separated,
counted from this process's first step: a run that resumed step N parks at ``k`` before step
N + k; a resumed run loads only the samples after its position) and ``CHAOS_PARK_BATCH`` the
run's samples per step per rank (``batch_size``; no accumulation). Under torchrun every rank
parks (each counts the samples it loads) and the same hold file holds them all.
Before loading the first sample of step ``k`` (steps ``1..k-1`` are done, and any periodic save
they triggered has been handed to the checkpointer), the loader creates ``DIR/parked-k`` and waits
while ``DIR/hold-k`` exists; the harness creates the hold files before it starts the trainer and
deletes one to let the run go on. Without the variables it is the GPT task unchanged; the task
string is part of the resume fingerprint, so the reference run uses this task too.

``CHAOS_LOG_TEXT``: text the task prints to stdout and logs with its own logger when it is built
(the "forged log text" cell: a task's own output that looks like the trainer's log lines).
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from trainer.task import Task, TaskContext
from trainer.tasks import gpt

PARK_DIR, PARK_STEPS, PARK_BATCH = "CHAOS_PARK_DIR", "CHAOS_PARK_STEPS", "CHAOS_PARK_BATCH"
LOG_TEXT = "CHAOS_LOG_TEXT"


class ParkingDataset:
    def __init__(self, inner: object, folder: Path, steps: list[int], batch_size: int):
        self.inner, self.folder = inner, folder
        self.at = {(k - 1) * batch_size: k for k in steps}  # samples served before step k
        self.served = 0

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> object:
        step = self.at.get(self.served)
        if step is not None:
            (self.folder / f"parked-{step}").touch()
            while (self.folder / f"hold-{step}").exists():  # the harness deletes it to go on
                time.sleep(0.005)
        self.served += 1
        return self.inner[i]  # type: ignore[index]


def build(ctx: TaskContext, **kw: object) -> Task:
    text = os.environ.get(LOG_TEXT)
    if text:
        print(text, flush=True)
        logging.getLogger("chaos_task").warning("a sample: %s", text)
    task = gpt.build(ctx, **kw)  # type: ignore[arg-type]
    folder, steps = os.environ.get(PARK_DIR), os.environ.get(PARK_STEPS)
    if folder and steps:
        task.dataset = ParkingDataset(task.dataset, Path(folder), [int(s) for s in steps.split(",")],
                                      int(os.environ.get(PARK_BATCH, "1")))
    return task
