"""Retries: how a call that may fail for a while is tried again, for every caller at once.

The storage tiers (``checkpoint.stores``), the data staging (``data.staging``), the REST client of
Compute, Cloud Run and Cloud Storage (``gce``), the checkpoint key's fetch (``checkpoint.key``),
the scaler's start of the control job (``scale``) and the log shipper retry through ``Retry``; the
preemption watcher, the writer lease's renewals, start-up's wait for a tier and the durability
retries draw their waits from ``Backoff``. The startup script's bash loop (the code download) is
rendered from ``IAM_GRANT`` by ``stacks/boot.py``. Standard library only: ``gce``, ``scale``,
``control`` and ``log_shipper`` run beside the trainer without its dependencies.

The rule, once:

- **Waits** grow from ``first_s`` by ``factor`` up to ``cap_s`` and are drawn from
  ``[wait * (1 - jitter), wait]``, so that many threads or VMs failing together do not retry
  together. The draws come from a private ``random.Random``, never the global ``random``: exact
  resume restores the training process's Python RNG, and a retry on a background thread, at a
  moment that differs between runs, must not move it. Loops that every rank runs together (the
  durability retries, the wait for a tier) use ``jitter=0``: every rank must take the same decision
  at the same try.
- **What is retried** (``transient``): HTTP 408, 429, 500, 502, 503 and 504, no answer at all
  (status 0), and connection errors and timeouts. Anything else is final at once: a 4xx says no,
  and asking again gets the same no.
- **Bounds**: ``deadline_s`` (seconds after the first try) and ``attempts``; a caller's own
  absolute deadline (an emergency save's, a stopping shipper's) bounds every wait. A wait that
  would end past a bound is not started: the last error is raised at once.
- **403, the grant still propagating**: IAM grants "typically propagate in 2 minutes, but could
  potentially take 7 minutes or longer", so a new VM can meet its own bucket, secret or job
  before its grant. A 403 is retried only within ``grace_s`` after the first try, with waits of
  its own (``grace_first_s`` doubling to ``grace_cap_s``, no jitter: a grant is not load); after
  the grace a 403 is final. ``grace_s=0``: a 403 is final at once (a running trainer's storage
  calls: start-up already waited for the grant).
- **Abort**: an ``abort`` (an ``Event`` or a callable) is checked before every try and ends a
  wait at once (a preemption notice, a shutdown); the call raises ``Aborted`` (or the caller's
  subclass).
- The clock and the sleeper are injectable: tests neither sleep nor measure time.
"""
from __future__ import annotations

import http.client
import random
import threading
import time
import urllib.error
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

T = TypeVar("T")

#: Answers worth another try: a request timeout, throttling and server-side trouble. Not 501 or
#: 505 (the server cannot do it), never a 4xx that says no.
RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
#: The answer of an IAM grant that has not arrived yet (or of one that does not exist).
FORBIDDEN = 403


@dataclass(frozen=True)
class Policy:
    """How one kind of call is retried (see the module docstring)."""

    first_s: float = 0.5
    """The first wait after a transient error."""
    factor: float = 2.0
    cap_s: float = 30.0
    """No wait is longer than this (before jitter)."""
    jitter: float = 0.5
    """A wait is drawn from ``[wait * (1 - jitter), wait]``; 0: exactly ``wait``."""
    deadline_s: float | None = None
    """Transient errors are retried this long after the first try (None: no such bound)."""
    attempts: int | None = None
    """At most this many tries in all (None: no such bound)."""
    grace_s: float = 0.0
    """A 403 is retried this long after the first try; after that it is final (0: at once;
    ``math.inf``: as long as the call is retried at all)."""
    grace_first_s: float = 5.0
    grace_cap_s: float = 60.0

    def __post_init__(self) -> None:
        if self.first_s < 0 or self.factor < 1 or self.cap_s < 0 or not 0 <= self.jitter <= 1:
            raise ValueError(f"retry policy: {self}")
        if self.attempts is not None and self.attempts < 1:
            raise ValueError(f"retry policy: attempts {self.attempts}; allowed: 1 or more")


#: IAM propagation: a 403 is retried for 10 minutes (the longest propagation Google names, and
#: some), waiting 5 s, then doubling to a minute. The startup script's code download uses these
#: numbers too (rendered by ``stacks/boot.py``).
IAM_GRANT = Policy(grace_s=600.0, grace_first_s=5.0, grace_cap_s=60.0)
#: One call to Cloud Storage through google-cloud-storage: the checkpoint tiers and the staging.
STORAGE = Policy(first_s=0.5, cap_s=30.0, deadline_s=300.0)
#: One REST call of ``gce.Client`` (small control-plane calls): six tries in all.
REST = Policy(first_s=1.0, cap_s=30.0, attempts=6)

#: The generator every jitter draws from unless a caller brings its own (tests).
_RNG = random.Random()


class Aborted(Exception):
    """A retried call was stopped on purpose (the abort was set before a try or during a wait)."""


class Backoff:
    """The waits of one policy, one after another: ``next()``; ``reset()`` after a success."""

    def __init__(self, policy: Policy, *, first_s: float | None = None, cap_s: float | None = None,
                 jitter: float | None = None, rng: random.Random | None = None) -> None:
        self.first_s = policy.first_s if first_s is None else first_s
        self.cap_s = policy.cap_s if cap_s is None else cap_s
        self.factor = policy.factor
        self.jitter = policy.jitter if jitter is None else jitter
        self._rng = rng or _RNG
        self._wait = self.first_s

    def next(self) -> float:
        wait = min(self._wait, self.cap_s)
        self._wait = min(self._wait * self.factor, self.cap_s)
        if self.jitter:
            wait *= 1.0 - self.jitter * self._rng.random()
        return wait

    def reset(self) -> None:
        self._wait = self.first_s


# --- what is retried ------------------------------------------------------------------------
def status_of(exc: BaseException) -> int | None:
    """The HTTP status an error carries (``code``, or ``response.status_code``), else None."""
    code = getattr(exc, "code", None)
    if isinstance(code, int) and not isinstance(code, bool):
        return code
    sc = getattr(getattr(exc, "response", None), "status_code", None)
    return sc if isinstance(sc, int) else None


def transient_status(code: int) -> bool:
    """An answer worth another try (0: no answer at all)."""
    return code == 0 or code in RETRY_STATUS


#: Errors of the standard library that mean the request got no answer.
TRANSPORT = (ConnectionError, TimeoutError, http.client.HTTPException, urllib.error.URLError)


def never(exc: BaseException) -> bool:
    """No error is transient: for a call whose client retries those itself (only its 403s are
    retried here, within the grace)."""
    return False


def transient(exc: BaseException, extra: tuple[type[BaseException], ...] = ()) -> bool:
    """Would another try of what raised ``exc`` likely succeed? A transient status, or a
    connection error or timeout (``TRANSPORT``, plus a client library's own ``extra`` types),
    also when wrapped by another error (its cause)."""
    if isinstance(exc, Aborted):
        return False
    code = status_of(exc)
    if code is not None:
        return transient_status(code)
    if isinstance(exc, TRANSPORT + extra):
        return True
    cause = exc.__cause__ or exc.__context__
    return cause is not None and cause is not exc and transient(cause, extra)


@dataclass(frozen=True)
class Try:
    """One failed try, as a caller's ``on_retry`` and ``on_give_up`` see it."""

    attempt: int  # 1 for the first try
    error: BaseException
    forbidden: bool  # a 403 (the grace's rule applies), not a transient error
    elapsed_s: float  # since the first try of this Retry
    wait_s: float = 0.0  # the wait before the next try (on_retry)
    why: str = ""  # on_give_up: "final", "forbidden", "deadline" or "attempts"


class Retry:
    """Calls ``fn`` until it succeeds or the policy says stop (see the module docstring).

    One ``Retry`` may serve several calls of one operation: the 403 grace runs from its first
    try (a key fetch that reads, creates, then reads again has one grace, not three).

    ``transient``: the caller's classifier (default :func:`transient`); a 403 is decided by the
    grace, not by it. ``deadline``: an absolute ``clock()`` time (or a callable returning one, or
    None) past which no wait ends. ``sleep(seconds)``: returns truthy when the wait was aborted
    (default: waits on ``abort``). ``aborted``: the exception raised on an abort.
    ``on_retry(try)`` before each wait (to log it), ``on_give_up(try)`` before the last error is
    raised (it may raise its own instead).
    """

    def __init__(self, policy: Policy, *, transient: Callable[[BaseException], bool] = transient,
                 abort: Any = None, deadline: float | Callable[[], float | None] | None = None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], Any] | None = None,
                 rng: random.Random | None = None, aborted: type[Exception] = Aborted,
                 on_retry: Callable[[Try], None] | None = None,
                 on_give_up: Callable[[Try], None] | None = None) -> None:
        self.policy = policy
        self._transient = transient
        self._abort = abort
        self._deadline = deadline
        self.clock = clock
        self._sleep = sleep
        self._rng = rng
        self._aborted_error = aborted
        self.on_retry = on_retry
        self.on_give_up = on_give_up
        self.started: float | None = None

    def aborting(self) -> bool:
        a = self._abort
        if a is None:
            return False
        return a.is_set() if isinstance(a, threading.Event) else bool(a())

    def _wait(self, seconds: float) -> bool:
        """Wait ``seconds``; True when aborted meanwhile."""
        if self._sleep is not None:
            return bool(self._sleep(seconds))
        a = self._abort
        if isinstance(a, threading.Event):
            return a.wait(seconds)
        if a is None:
            time.sleep(seconds)
            return False
        end = self.clock() + seconds
        while not a():  # a callable: looked at ten times a second
            left = end - self.clock()
            if left <= 0:
                return False
            time.sleep(min(left, 0.1))
        return True

    def _hard_deadline(self) -> float | None:
        d = self._deadline
        return d() if callable(d) else d

    def call(self, fn: Callable[[], T], what: str = "call") -> T:
        p = self.policy
        start = self.clock()
        if self.started is None:
            self.started = start
        backoff = Backoff(p, rng=self._rng)
        grant = Backoff(p, first_s=p.grace_first_s, cap_s=p.grace_cap_s, jitter=0.0)
        attempt = 0
        while True:
            attempt += 1
            if self.aborting():
                raise self._aborted_error(f"{what}: aborted")
            try:
                return fn()
            except Exception as exc:
                now = self.clock()
                forbidden = status_of(exc) == FORBIDDEN
                seen = Try(attempt, exc, forbidden, now - self.started)
                why = ""
                if forbidden:
                    left = p.grace_s - (now - self.started)
                    wait = min(grant.next(), left)
                    if left <= 0:
                        why = "forbidden"
                elif not self._transient(exc):
                    wait, why = 0.0, "final"
                else:
                    wait = backoff.next()
                    if p.attempts is not None and attempt >= p.attempts:
                        why = "attempts"
                    elif p.deadline_s is not None and now + wait >= start + p.deadline_s:
                        why = "deadline"
                hard = self._hard_deadline()
                if not why and hard is not None and now + wait >= hard:
                    why = "deadline"
                if why:
                    if self.on_give_up is not None:
                        self.on_give_up(Try(attempt, exc, forbidden, seen.elapsed_s, why=why))
                    raise
                if self.on_retry is not None:
                    self.on_retry(Try(attempt, exc, forbidden, seen.elapsed_s, wait_s=wait))
                if self._wait(wait):
                    raise self._aborted_error(f"{what}: aborted") from exc
