"""``python -m trainer``, held after a given step while a file exists: the way a test signals any
job (a task, a task with its own step, an own loop; one process or torchrun's ranks) at a step it
knows, however fast the job's steps are and however late the test reads the log.

``HOLD_FLAG``: the file; ``HOLD_AT_STEP``: the step. Rank 0, right after it logs that step's
``event=step`` line, waits in Python (where its signal handlers run) until the file is gone; the
other ranks wait for it in their next collective. Without ``HOLD_FLAG`` this is the trainer
unchanged. Test support only: the trainer itself has no such hook.
"""
from __future__ import annotations

import os
import runpy
import time
from pathlib import Path
from typing import Any


def install() -> None:
    """Hold the bus after it emits the ``HOLD_AT_STEP`` step, while ``HOLD_FLAG`` exists."""
    flag = os.environ.get("HOLD_FLAG")
    if not flag:
        return
    at = int(os.environ["HOLD_AT_STEP"])
    from trainer.observe.bus import Bus
    from trainer.observe.events import Step

    emit = Bus.emit

    def emit_then_hold(self: Bus, event: Any) -> None:
        emit(self, event)
        if isinstance(event, Step) and event.step == at:
            while Path(flag).exists():
                time.sleep(0.01)

    Bus.emit = emit_then_hold  # type: ignore[method-assign]


if __name__ == "__main__":
    install()
    runpy.run_module("trainer", run_name="__main__", alter_sys=True)
