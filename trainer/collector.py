"""The cyclic garbage collector while `python -m trainer run` loads torch and the trainer.

Those imports make about 480,000 objects that live as long as the process, and every collection
their allocations trigger walks all of them again: a third of the start's CPU (2.7 CPU-seconds with
the collector on, 1.85 paused, on the 2-core development machine), paid again by every rank of a VM
restarting after a preemption. So `__main__` pauses the collector before anything is imported and
the command resumes it once the heavy imports are done, freezing what they made (`gc.freeze`):
later full collections skip it, and a DataLoader worker forked from the trainer does not copy its
pages by walking it. The few thousand cyclic leftovers of the imports stay (a collection to free
them costs a quarter second). A process that did not pause it (the trainer called in-process, as
tests do) is left as it was.
"""
from __future__ import annotations

import gc

_paused = False


def pause() -> None:
    """Before the heavy imports: collect nothing until `resume`."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def resume() -> None:
    """After the heavy imports: freeze what exists and collect again, if `pause` stopped it."""
    global _paused
    if _paused:
        _paused = False
        gc.freeze()
        gc.enable()
