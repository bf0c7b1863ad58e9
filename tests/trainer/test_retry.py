"""trainer.retry: the waits, the bounds, the abort, the 403 grace and the RNG it leaves alone.

Time is a fake clock that moves only when the retry sleeps: no test sleeps or measures time.
"""
from __future__ import annotations

import dataclasses
import http.client
import random
import threading
import urllib.error

import pytest
import torch

from tests.trainer.support import SleepClock

from trainer import retry
from trainer.retry import Backoff, Policy, Retry

GUARD_S = 60.0  # a failure guard for a join, never a timing assertion


class Clock(SleepClock):
    """Monotonic time that advances by exactly what the retry sleeps."""

    def __init__(self) -> None:
        super().__init__(start=1000.0)


class Status(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(f"HTTP {code}")
        self.code = code


def failing(*errors: BaseException, then: object = "ok"):
    """A call that raises ``errors`` in turn, then answers ``then`` (None: raises the last error
    forever)."""
    calls: list[int] = []

    def fn() -> object:
        calls.append(1)
        if len(calls) <= len(errors):
            raise errors[len(calls) - 1]
        if then is None:
            raise errors[-1]
        return then

    fn.calls = calls  # type: ignore[attr-defined]
    return fn


def retrier(policy: Policy, clock: Clock, **kw: object) -> Retry:
    return Retry(policy, clock=clock, sleep=clock.sleep, rng=random.Random(7), **kw)  # type: ignore[arg-type]


# --- the waits --------------------------------------------------------------------------------
def test_waits_double_to_the_cap_each_drawn_from_its_jitter_band() -> None:
    p = Policy(first_s=0.5, factor=2.0, cap_s=8.0, jitter=0.5)
    b = Backoff(p, rng=random.Random(1))
    waits = [b.next() for _ in range(8)]
    nominal = [0.5, 1, 2, 4, 8, 8, 8, 8]
    for w, n in zip(waits, nominal):
        assert n * 0.5 <= w <= n
    assert len(set(waits)) == len(waits)  # drawn, not fixed


def test_no_jitter_gives_the_nominal_waits_and_reset_starts_over() -> None:
    b = Backoff(Policy(first_s=1.0, cap_s=30.0, jitter=0.0))
    assert [b.next() for _ in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    b.reset()
    assert b.next() == 1


def test_a_policy_that_cannot_work_is_refused() -> None:
    for bad in ({"factor": 0.5}, {"jitter": 1.5}, {"first_s": -1}, {"attempts": 0}):
        with pytest.raises(ValueError):
            Policy(**bad)  # type: ignore[arg-type]


# --- what is retried --------------------------------------------------------------------------
def test_the_classifier_retries_throttling_server_trouble_and_no_answer_only() -> None:
    for code in (0, 408, 429, 500, 502, 503, 504):
        assert retry.transient(Status(code)), code
    for code in (400, 401, 403, 404, 409, 412, 501, 505):
        assert not retry.transient(Status(code)), code
    assert retry.transient(ConnectionResetError())
    assert retry.transient(TimeoutError())
    assert retry.transient(http.client.IncompleteRead(b""))
    assert retry.transient(urllib.error.URLError("refused"))
    assert retry.transient(urllib.error.HTTPError("u", 503, "x", None, None))  # type: ignore[arg-type]
    assert not retry.transient(urllib.error.HTTPError("u", 404, "x", None, None))  # type: ignore[arg-type]
    assert not retry.transient(FileNotFoundError("x"))  # an OSError, not a transport error
    assert not retry.transient(retry.Aborted())
    try:  # wrapped by another library's error: its cause decides
        try:
            raise ConnectionResetError()
        except ConnectionResetError as e:
            raise ValueError("upload failed") from e
    except ValueError as wrapped:
        assert retry.transient(wrapped)

    class Odd(Exception):
        pass

    assert not retry.transient(Odd()) and retry.transient(Odd(), extra=(Odd,))


# --- bounds -----------------------------------------------------------------------------------
def test_transient_errors_are_retried_then_the_call_answers() -> None:
    clock = Clock()
    fn = failing(Status(503), Status(429), ConnectionResetError())
    assert retrier(retry.STORAGE, clock).call(fn) == "ok"
    assert len(fn.calls) == 4 and len(clock.sleeps) == 3


def test_a_final_error_is_raised_at_once_without_a_wait() -> None:
    clock = Clock()
    seen: list[retry.Try] = []
    with pytest.raises(Status, match="404"):
        retrier(retry.STORAGE, clock, on_give_up=seen.append).call(failing(Status(404)))
    assert clock.sleeps == [] and seen[0].why == "final"


def test_the_deadline_is_never_overslept_and_the_last_error_is_raised() -> None:
    clock = Clock()
    p = Policy(first_s=1.0, cap_s=30.0, jitter=0.0, deadline_s=100.0)
    seen: list[retry.Try] = []
    with pytest.raises(Status, match="503"):
        retrier(p, clock, on_give_up=seen.append).call(failing(Status(503), then=None))
    assert clock.sleeps == [1, 2, 4, 8, 16, 30, 30]  # the next 30 would end at 121 s, past 100
    assert seen[0].why == "deadline" and seen[0].attempt == 8


def test_a_callers_absolute_deadline_bounds_every_wait() -> None:
    clock = Clock()
    p = Policy(first_s=1.0, cap_s=30.0, jitter=0.0, deadline_s=300.0)
    with pytest.raises(Status):
        retrier(p, clock, deadline=clock.now + 10).call(failing(Status(503), then=None))
    assert clock.sleeps == [1, 2, 4]


def test_attempts_bound_the_tries() -> None:
    clock = Clock()
    fn = failing(Status(500), then=None)
    seen: list[retry.Try] = []
    with pytest.raises(Status):
        retrier(dataclasses.replace(retry.REST, attempts=3), clock, on_give_up=seen.append).call(fn)
    assert len(fn.calls) == 3 and len(clock.sleeps) == 2 and seen[0].why == "attempts"


# --- abort ------------------------------------------------------------------------------------
def test_an_abort_before_a_try_stops_the_call_without_trying() -> None:
    stop = threading.Event()
    stop.set()
    fn = failing(then="ok")
    with pytest.raises(retry.Aborted):
        Retry(retry.STORAGE, abort=stop).call(fn)
    assert fn.calls == []


def test_an_abort_ends_a_wait_at_once_with_the_callers_error() -> None:
    class Stopped(retry.Aborted):
        pass

    stop, waiting, out = threading.Event(), threading.Event(), []
    # An hour's wait: only the abort can end it before the guard.
    p = Policy(first_s=3600.0, cap_s=3600.0, jitter=0.0, deadline_s=7200.0)
    r = Retry(p, abort=stop, aborted=Stopped, on_retry=lambda t: waiting.set())

    def run() -> None:
        try:
            r.call(failing(Status(503), then=None))
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert waiting.wait(GUARD_S)
    stop.set()
    t.join(GUARD_S)
    assert not t.is_alive() and isinstance(out[0], Stopped)


def test_an_abort_callable_is_asked_between_tries() -> None:
    clock, asked = Clock(), []

    def sleep(s: float) -> bool:
        clock.sleep(s)
        return len(clock.sleeps) == 2  # the second wait is interrupted

    with pytest.raises(retry.Aborted):
        Retry(retry.STORAGE, clock=clock, sleep=sleep, abort=lambda: asked.append(1) and False).call(
            failing(Status(503), then=None))
    assert len(clock.sleeps) == 2 and len(asked) == 2


# --- the 403 grace ----------------------------------------------------------------------------
def test_a_403_inside_the_grace_is_retried_with_the_grants_waits() -> None:
    clock = Clock()
    fn = failing(Status(403), Status(403), Status(403))
    assert retrier(retry.IAM_GRANT, clock, transient=retry.never).call(fn) == "ok"
    assert clock.sleeps == [5, 10, 20]  # no jitter: a grant is not load


def test_a_403_after_the_grace_is_final_and_the_last_wait_ends_at_the_grace() -> None:
    clock = Clock()
    seen: list[retry.Try] = []
    with pytest.raises(Status, match="403"):
        retrier(retry.IAM_GRANT, clock, on_give_up=seen.append).call(failing(Status(403), then=None))
    assert clock.sleeps == [5, 10, 20, 40] + [60] * 8 + [45]  # 600 s in all, not one more
    assert sum(clock.sleeps) == retry.IAM_GRANT.grace_s
    assert seen[0].why == "forbidden" and seen[0].forbidden


def test_without_a_grace_a_403_is_final_at_once() -> None:
    clock = Clock()
    with pytest.raises(Status):
        retrier(retry.STORAGE, clock).call(failing(Status(403), then="ok"))
    assert clock.sleeps == []


def test_the_grace_runs_from_the_first_try_of_the_operation() -> None:
    """A fetch that reads, creates, then reads again has one grace, not three."""
    clock = Clock()
    r = retrier(dataclasses.replace(retry.IAM_GRANT, grace_s=100.0), clock, transient=retry.never)
    assert r.call(failing(Status(403), Status(403), Status(403))) == "ok"  # 5 + 10 + 20 s
    clock.now += 60  # the work between the calls
    with pytest.raises(Status):
        r.call(failing(Status(403), then=None))
    assert clock.sleeps == [5, 10, 20, 5]  # 95 s after the first try: 5 s were left


def test_transient_errors_keep_their_own_waits_beside_a_403() -> None:
    clock = Clock()
    p = dataclasses.replace(retry.STORAGE, jitter=0.0, grace_s=600.0)
    assert retrier(p, clock).call(failing(Status(503), Status(403), Status(503), Status(403))) == "ok"
    assert clock.sleeps == [0.5, 5, 1, 10]


# --- exact resume -----------------------------------------------------------------------------
def test_retrying_leaves_the_global_and_torch_rngs_untouched() -> None:
    random.seed(1234)
    torch.manual_seed(1234)
    py, th = random.getstate(), torch.get_rng_state()
    clock = Clock()
    with pytest.raises(Status):
        Retry(retry.STORAGE, clock=clock, sleep=clock.sleep).call(failing(Status(503), then=None))
    b = Backoff(retry.STORAGE)
    jittered = [b.next() for _ in range(20)]
    assert len(clock.sleeps) > 5 and len(set(jittered)) > 1  # it did draw, many times
    assert random.getstate() == py
    assert torch.equal(torch.get_rng_state(), th)
