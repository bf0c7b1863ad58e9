"""A preemption notice that arrives while `python -m trainer run` starts up.

The trainer's own handlers (``trainer.loop.preemption``) exist only once torch is loaded and the run
is set up, seconds after the process started; until then a SIGTERM would kill it silently (exit
143). ``install`` runs first thing in ``trainer/__main__``, before any heavy import: its handlers
only remember the first notice, which start-up then acts on (exit 75 with a line saying it was
stopped during start-up) or which ``Preemption`` adopts. Nothing is trained before the loop, so
nothing is lost.

``SPOTTRAIN_HOLD_STARTUP_AT=POINT`` (tests only) makes start-up log ``event=startup_hold
point=POINT`` at that named moment and wait there until a notice has arrived, so that a test can
deliver one at an exact moment of start-up without guessing at timing.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from typing import Callable

HOLD_ENV = "SPOTTRAIN_HOLD_STARTUP_AT"
#: The named moments of start-up, in order (where ``hold`` is called).
POINTS = ("main", "imports", "run", "session", "lease", "restore")

_notice: tuple[str, float] | None = None  # (signal name, time.monotonic() it arrived)


def install() -> None:
    """Remember SIGTERM and SIGINT from now on, instead of dying of them."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _remember)


def _remember(signum: int, frame: object) -> None:
    global _notice
    if _notice is None:  # the first notice counts; its time starts the shutdown window
        _notice = (signal.Signals(signum).name, time.monotonic())


def pending() -> tuple[str, float] | None:
    """The notice that arrived before the trainer's own handlers: (signal name, monotonic time)."""
    return _notice


def hold(point: str, noticed: Callable[[], bool] | None = None) -> None:
    """Tests only: at ``point`` (when ``$SPOTTRAIN_HOLD_STARTUP_AT`` names it), say so and wait
    until ``noticed()`` (default: a notice was remembered here)."""
    if os.environ.get(HOLD_ENV) != point:
        return
    noticed = noticed or (lambda: _notice is not None)
    print(f"event=startup_hold point={point} (waiting for a notice: {HOLD_ENV} is set)", file=sys.stderr,
          flush=True)
    while not noticed():
        time.sleep(0.01)  # the signal handler runs between these; no lock a handler could contend for
