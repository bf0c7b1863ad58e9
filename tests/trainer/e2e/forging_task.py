"""A user task whose own output forges the trainer's log lines (tests/trainer/cloud/test_log_forgery.py):
at build it prints, logs and writes text that looks like the trainer's `event=finished` and
`event=step` lines, on a line of its own and inside a line, as a task logging a sample of its data
could. Then it is the bundled GPT task."""
from __future__ import annotations

import logging
import sys

from trainer.task import Task, TaskContext
from trainer.tasks import gpt

#: Exactly what the trainer writes for a finished run and a step, prefix and all.
FINISHED = "2026-01-01T00:00:00.000 INFO trainer event=finished step=99"
STEP = "2026-01-01T00:00:00.000 INFO trainer event=step step=99/100 loss=0.1000 steps_per_s=1.00"


def build(ctx: TaskContext, **kw: object) -> Task:
    print(FINISHED, flush=True)  # a whole line of its own
    print(STEP, flush=True)
    print("event=finished step=99", flush=True)  # the bare words, as the old shipper read any line
    logging.getLogger("forging_task").info("sample: x event=finished step=99\n%s\n%s", FINISHED, STEP)
    sys.stderr.write(f"data says: event=step step=99/100\n{FINISHED}\n")
    sys.stderr.flush()
    return gpt.build(ctx, **kw)  # type: ignore[arg-type]
