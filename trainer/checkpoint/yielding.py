"""A periodic save's disk write at the lowest CPU priority, and the bound on how long it may yield.

A periodic save's hashing and disk write run beside the training loop. At normal priority, on a
machine whose cores the loop keeps busy (training on CPU, data workers), they take a share of the
loop's cores and its step slows by far more than their own CPU time, since a step runs as fast as
its slowest thread. At nice 19 they take the cores the loop leaves idle.

Yielding has a price: when the cores are busy the write finishes later, and a write still running
when the next save comes due defers that save, i.e. checkpoints come less often than configured,
which is work at risk. So a write yields only where there is room for it, and for a bounded time:

* it yields only when the time since the previous save of this process is at least four times
  the previous write's duration (the first save of a process, and saves almost as frequent as
  their writes are long, run at normal priority: there a starved write would defer the next save);
* it is lifted back to the caller's priority (``lift``) when a quarter of that time has passed
  since it started (as long as a whole write at normal priority: one that has not finished by
  then is being starved, and lifted it still ends by half the time between saves), when the next
  save comes due while it still runs, and when anything waits for it: a save, an emergency save,
  ``wait``/``durable``, ``close``.

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
#: A write yields only when the time between saves is at least this many times the last write's.
YIELD_WHEN_GAP_OVER_WRITE = 4.0


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
    """One checkpointer's periodic writes: ``started`` when a save begins decides whether its
    write yields, ``run`` runs it, ``check`` (every step) and ``release`` (a waiter) lift it."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._last_start: float | None = None
        self._last_write_s: float | None = None
        self._gap = 0.0
        self._started: float | None = None  # the write in flight yields (None: no, or lifted already)
        self.yielded = 0  # writes that began at the lowest priority (stats)
        self.lifted = 0  # of them, lifted before they finished (stats)

    def started(self, yielding: bool) -> None:
        """A save begins; ``yielding``: its write may run at the lowest priority (a periodic save
        of one process), which it does where there is room for it (the module docstring)."""
        now = self._clock()
        gap = None if self._last_start is None else now - self._last_start
        self._last_start = now
        room = (gap is not None and self._last_write_s is not None
                and gap >= YIELD_WHEN_GAP_OVER_WRITE * self._last_write_s)
        self._gap = gap or 0.0
        self._started = now if yielding and room and possible() else None
        self.yielded += self._started is not None

    def finished(self) -> None:
        self._started = None

    def check(self, next_due: bool) -> None:
        """Called while the write runs (every step): lift it once it has yielded long enough."""
        started = self._started
        if started is not None and (next_due or self._clock() - started >= LIFT_AFTER_SHARE_OF_GAP * self._gap):
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
        t0 = self._clock()
        try:
            return self._run(work)
        finally:
            self._last_write_s = self._clock() - t0

    def _run(self, work: Callable[[], Any]) -> Any:
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
