"""A periodic save's disk write at the lowest CPU priority, and the bound on how long it may yield.

A periodic save's hashing and disk write run beside the training loop. At normal priority, on a
machine whose cores the loop keeps busy (training on CPU, data workers), they take a share of the
loop's cores and its step slows by far more than their own CPU time, since a step runs as fast as
its slowest thread. At nice 19 they take the cores the loop leaves idle.

Yielding has a price: when the cores are busy the write finishes later, and a write still running
when the next save comes due defers that save, i.e. checkpoints come less often than configured,
which is work at risk. So a yielding write is lifted back to the caller's priority (``lift``):

* when a quarter of the time between the last two saves has passed since it started (on an idle
  core a write takes a small part of that; one that has not finished by then is being starved);
* when the next save comes due while it still runs;
* when anything waits for it: a save, an emergency save, ``wait``/``durable``, ``close``.

Raising a thread's priority back needs the privilege (root, as the trainer runs on a VM, or
``RLIMIT_NICE``). Where the process lacks it, or off Linux, nothing yields: the write runs at
normal priority, since a write that could be starved without bound is worse than a slower step.
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading
from typing import Any, Callable

#: The nice value a yielding write runs at (the lowest priority).
LOWEST = 19
#: The share of the time between two saves after which a write still running is lifted.
LIFT_AFTER_SHARE_OF_GAP = 0.25


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@functools.cache
def possible() -> bool:
    """Whether a thread of this process can drop to the lowest priority and be lifted back:
    tried once on a scratch thread (Linux, with the privilege to raise a priority)."""
    if not hasattr(os, "setpriority") or not os.path.isdir("/proc/self/task"):
        return False
    base = _nice()
    ok: list[bool] = []

    def probe() -> None:
        tid = threading.get_native_id()
        try:
            os.setpriority(os.PRIO_PROCESS, tid, LOWEST)
            os.setpriority(os.PRIO_PROCESS, tid, base)
            ok.append(True)
        except OSError:
            ok.append(False)

    t = threading.Thread(target=probe, name="checkpoint-priority-probe")
    t.start()
    t.join()
    return base < LOWEST and ok == [True]


def lift() -> None:
    """Every thread of this process at the lowest priority (a yielding write and the hashing
    threads it started, which inherited it) back to the caller's priority."""
    if not possible():
        return
    mine = _nice()
    # Twice: a thread the write started between the first listing and its own lift inherited
    # the lowest priority; the second listing finds it (after its parent's lift, none is born so).
    for _ in range(2):
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError, ValueError):
                if os.getpriority(os.PRIO_PROCESS, int(tid)) == LOWEST:
                    os.setpriority(os.PRIO_PROCESS, int(tid), mine)


class YieldingWrites:
    """One checkpointer's periodic writes: ``run`` one at the lowest priority; ``started`` when a
    save begins and ``check`` every step decide when it has yielded long enough."""

    def __init__(self, now: float) -> None:
        self._last_start = now  # a first save's gap counts from the start of training
        self._gap: float | None = None
        self._started: float | None = None  # the write in flight (None: none, or lifted already)
        self.lifted = 0  # writes lifted before they finished (stats)

    def started(self, now: float, yielding: bool) -> None:
        """A save began at ``now``; ``yielding``: its write runs at the lowest priority."""
        self._gap, self._last_start = now - self._last_start, now
        self._started = now if yielding and possible() else None

    def finished(self) -> None:
        self._started = None

    def check(self, now: float, next_due: bool) -> None:
        """Called while the write runs: lift it once it has yielded long enough."""
        if self._started is None:
            return
        if next_due or (self._gap is not None and now - self._started >= LIFT_AFTER_SHARE_OF_GAP * self._gap):
            self.release()

    def release(self) -> None:
        """Something waits for the write: lift it now."""
        # No lock: a notice's handler may interrupt the loop's thread anywhere, and then waits
        # for the emergency save that calls this. ``run`` drops its priority before it reads
        # ``_started`` and this clears it before it lifts, so whichever comes second lifts.
        if self._started is not None:
            self._started = None
            self.lifted += 1
            lift()

    def run(self, work: Callable[[], Any]) -> Any:
        """``work()`` (the newest save's write) on a thread of its own at the lowest priority
        (the threads it starts inherit it), unless it was lifted already or could not be: then
        here at normal priority. Its result or its exception. A thread of its own, since whatever
        the caller starts afterwards (the uploader) must not inherit the priority."""
        if self._started is None:
            return work()
        out: list[tuple[bool, Any]] = []

        def run() -> None:
            try:
                tid, base = threading.get_native_id(), _nice()
                os.setpriority(os.PRIO_PROCESS, tid, LOWEST)
                if self._started is None:  # lifted before it dropped
                    os.setpriority(os.PRIO_PROCESS, tid, base)
                out.append((True, work()))
            except BaseException as e:  # noqa: BLE001 - raised in the caller
                out.append((False, e))

        th = threading.Thread(target=run, name=f"{threading.current_thread().name}-yielding", daemon=True)
        th.start()
        th.join()
        ok, value = out[0]
        if not ok:
            raise value
        return value
