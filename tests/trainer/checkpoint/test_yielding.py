"""A periodic write at the lowest priority: when it yields, and each rule that lifts it back (real
threads, their real nice values; a clock the test sets)."""
from __future__ import annotations

import os
import threading

import pytest

from trainer.checkpoint import yielding
from trainer.checkpoint.yielding import LOWEST, YieldingWrites

GUARD = 60.0  # failure guard for waits; never reached when the code is right

pytestmark = pytest.mark.skipif(not yielding.possible(),
                                reason="needs Linux and the privilege to raise a thread's priority (root, as on a VM)")


def nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class HeldWrite:
    """A write that reports its nice value, then waits to be let go, then reports it again."""

    def __init__(self, writes: YieldingWrites) -> None:
        self.seen: list[int] = []
        self.running, self.go = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=writes.run, args=(self.work,))

    def work(self) -> str:
        self.seen.append(nice())
        self.running.set()
        assert self.go.wait(GUARD)
        self.seen.append(nice())
        return "written"

    def start(self) -> HeldWrite:
        self.thread.start()
        assert self.running.wait(GUARD)
        return self

    def finish(self) -> list[int]:
        self.go.set()
        self.thread.join(GUARD)
        return self.seen


def after_a_first_save(write_s: float = 1.0) -> tuple[YieldingWrites, Clock]:
    """Writes whose first save (t=0) took ``write_s`` seconds to write."""
    clock = Clock()
    w = YieldingWrites(clock)
    w.started(yielding=True)

    def write() -> None:
        clock.t += write_s

    w.run(write)
    return w, clock


def test_the_first_save_of_a_process_never_yields() -> None:
    w = YieldingWrites(Clock())
    w.started(yielding=True)  # nothing measured yet: no time between saves, no write's duration
    assert HeldWrite(w).start().finish() == [nice(), nice()]


def test_a_save_almost_as_frequent_as_its_writes_does_not_yield() -> None:
    w, clock = after_a_first_save(write_s=1.0)
    clock.t = 3.9  # less than 4 x the last write since the last save: a starved write would defer the next
    w.started(yielding=True)
    assert HeldWrite(w).start().finish() == [nice(), nice()]


def test_a_periodic_write_yields_until_the_next_save_comes_due() -> None:
    w, clock = after_a_first_save(write_s=1.0)
    clock.t = 100.0
    w.started(yielding=True)
    held = HeldWrite(w).start()
    clock.t = 101.0
    w.check(next_due=False)  # a step later: it may go on yielding
    assert held.seen == [LOWEST]
    w.check(next_due=True)
    assert held.finish() == [LOWEST, nice()] and w.lifted == 1


def test_a_write_that_yielded_a_quarter_of_the_gap_between_saves_is_lifted() -> None:
    w, clock = after_a_first_save(write_s=1.0)
    clock.t = 100.0
    w.started(yielding=True)  # 100 s since the last save: a quarter is 25 s
    held = HeldWrite(w).start()
    clock.t = 124.0
    w.check(next_due=False)
    assert w.lifted == 0
    clock.t = 125.0
    w.check(next_due=False)
    assert held.finish() == [LOWEST, nice()] and w.lifted == 1


def test_a_final_save_never_yields() -> None:
    w, clock = after_a_first_save()
    clock.t = 100.0
    w.started(yielding=False)
    assert HeldWrite(w).start().finish() == [nice(), nice()]


def test_a_lift_before_the_write_dropped_its_priority_keeps_it_at_normal() -> None:
    # A notice right after the save: the emergency save lifts before the writer thread ran.
    w, clock = after_a_first_save()
    clock.t = 100.0
    w.started(yielding=True)
    w.release()
    assert HeldWrite(w).start().finish() == [nice(), nice()]


def test_a_lift_reaches_the_threads_the_write_started() -> None:
    # The hashing threads a write starts inherit its priority.
    w, clock = after_a_first_save()
    clock.t = 100.0
    w.started(yielding=True)
    child_seen: list[int] = []
    child_running, go = threading.Event(), threading.Event()

    def child() -> None:
        child_seen.append(nice())
        child_running.set()
        assert go.wait(GUARD)
        child_seen.append(nice())

    def work() -> None:
        t = threading.Thread(target=child)
        t.start()
        t.join(GUARD)

    writer = threading.Thread(target=w.run, args=(work,))
    writer.start()
    assert child_running.wait(GUARD)
    w.release()
    go.set()
    writer.join(GUARD)
    assert child_seen == [LOWEST, nice()]


def test_the_writes_result_and_exception_reach_the_caller() -> None:
    w, clock = after_a_first_save()
    clock.t = 100.0
    w.started(yielding=True)
    assert w.run(lambda: 42) == 42
    clock.t = 200.0
    w.started(yielding=True)

    def fails() -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        w.run(fails)
