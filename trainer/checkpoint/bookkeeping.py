"""What one checkpointer's parts (``trainer.checkpoint.checkpointer``: the save policy, the disk
writer, the uploader, the restore survey, the emergency save) record about its saves and read from
one another, in one place:

* each tier's schedule: when it was last saved (step and time) and its automatic interval
  (``trainer.checkpoint.interval``), which ``due_tiers`` answers from;
* each tier's health: since when its writes fail, how many did, the last error (``failing``,
  ``describe_failing``), reported on each change to ``on_tier_health``;
* what a save's success or failure does to both, the stats, and ``on_durable``;
* whose state this process saves: its ``session`` (a manifest's ``writer``), the disk folders it
  wrote or restored (``verified``) and the writers of the checkpoints it restored (``restored``):
  ``same_state`` answers whether a copy already there is this state.

It never touches a store: no I/O, no thread of its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from typing import Any, Callable

from trainer.checkpoint.interval import YoungDalyPolicy, changed_materially
from trainer.checkpoint.tiers import Tier, Tiers

#: What ``failing()`` holds for a tier: since (unix time), failures, error.
Failure = dict[str, Any]


@dataclasses.dataclass
class Schedule:
    """When a tier was last saved to, and its automatic interval."""

    auto: YoungDalyPolicy | None
    last_step: int = 0
    last_time: float | None = None
    logged_interval: float | None = None


class Bookkeeping:
    """The schedule, health, stats and session state one checkpointer's parts share."""

    def __init__(self, tiers: Tiers, *, session: str, mtbf_s: float, log: logging.Logger) -> None:
        self.tiers, self.session, self.log = tiers, session, log
        self.schedule = {t.name: Schedule(YoungDalyPolicy(mtbf_s=mtbf_s) if t.cadence.automatic else None)
                         for t in tiers}
        self.started = time.monotonic()
        #: (tier, step) disk folders holding this process's state: it wrote them, or restored from them.
        self.verified: set[tuple[str, int]] = set()
        #: step -> writer of the checkpoint this process restored.
        self.restored: dict[int, str] = {}
        self._lock = threading.Lock()
        self._failing: dict[str, Failure] = {}
        #: Called with (tier, failure record or None when it works again) on each change (rank 0).
        #: Must not raise (errors are logged).
        self.on_tier_health: Callable[[str, Failure | None], None] | None = None
        #: Called with (tier, step) once a periodic save is durable on a tier (rank 0); must not block.
        self.on_durable: Callable[[str, int], None] | None = None
        self.stats: dict[str, Any] = {
            "saves": 0, "tier_writes_ok": 0, "tier_writes_failed": 0, "deferred_steps": 0,
            "waited": 0, "blocked_s_total": 0.0, "last_blocked_s": None, "last_error": None,
            "uploads_superseded": 0, "update_waited_s_total": 0.0, "writes_yielded": 0,
            "writes_lifted": 0,
        }

    # ------------------------------------------------------------------------------ schedule
    def interval_s(self, tier: str) -> float | None:
        """The automatic interval currently in force for ``tier`` (None for fixed cadences)."""
        auto = self.schedule[tier].auto
        return auto.decide().seconds if auto else None

    def _tier_due(self, t: Tier, step: int, now: float) -> bool:
        s = self.schedule[t.name]
        base = s.last_time if s.last_time is not None else self.started
        if s.auto is not None:
            d = s.auto.decide()
            if changed_materially(s.logged_interval, d.seconds):
                self.log.info("checkpoint interval for %s: %.0fs (%s)", t.name, d.seconds, d.reason)
                s.logged_interval = d.seconds
            return now - base >= d.seconds
        c = t.cadence
        if c.every_steps is not None and step >= (s.last_step // c.every_steps + 1) * c.every_steps:
            return True
        return c.every_seconds is not None and now - base >= c.every_seconds

    def due_tiers(self, step: int) -> list[Tier]:
        """The tiers whose cadence says to save at ``step``, in table order."""
        now = time.monotonic()
        return [t for t in self.tiers if self._tier_due(t, step, now)]

    def saved(self, tiers: list[Tier], step: int) -> None:
        """``tiers`` got ``step`` (or will: a save started): count their intervals from now."""
        now = time.monotonic()
        for t in tiers:
            self.schedule[t.name].last_step, self.schedule[t.name].last_time = step, now

    def blocked(self, tiers: list[Tier], seconds: float) -> None:
        """A save of ``tiers`` held the loop ``seconds`` (the interval policy's C)."""
        for t in tiers:
            auto = self.schedule[t.name].auto
            if auto is not None:
                auto.observe(blocked_s=seconds)

    def blocked_longer(self, tiers: list[Tier], seconds: float) -> None:
        """The next optimizer step waited ``seconds`` more for that save's copy (added to C)."""
        for t in tiers:
            auto = self.schedule[t.name].auto
            if auto is not None:
                auto.blocked_longer(seconds)

    # ------------------------------------------------------------------------------ outcomes
    def succeeded(self, t: Tier, step: int, write_s: float) -> None:
        """A periodic save of ``step`` is on ``t`` (written, or uploaded, and verified)."""
        self.stats["tier_writes_ok"] += 1
        auto = self.schedule[t.name].auto
        if auto is not None:
            auto.observe(write_s=write_s)
        self.log.info("checkpoint step %d durable on %s in %.2fs", step, t.name, write_s)
        self.note(t.name, None)
        if self.on_durable is not None:
            with contextlib.suppress(Exception):
                self.on_durable(t.name, step)

    def failed(self, tier: str, step: int, e: BaseException) -> None:
        """A background save of ``step`` to ``tier`` failed (``"?"``: a thread died)."""
        self.stats["tier_writes_failed"] += 1
        self.stats["last_error"] = f"{tier} step {step}: {type(e).__name__}: {e}"
        self.log.error("checkpoint step %d on %s failed (training continues; nothing partial is "
                       "visible): %s: %s", step, tier, type(e).__name__, e)
        if tier in self.tiers:
            self.note(tier, f"{type(e).__name__}: {e}"[:300])

    def note(self, tier: str, error: str | None) -> None:
        """Track whether ``tier`` keeps failing (``error`` None: it just worked)."""
        changed: Failure | None = None
        with self._lock:
            rec = self._failing.get(tier)
            if error is None:
                if rec is None:
                    return
                del self._failing[tier]
                self.log.info("checkpoint tier %s works again (after %d failed write(s))", tier, rec["failures"])
            else:
                rec = self._failing.setdefault(tier, {"since": time.time(), "failures": 0})
                rec["failures"] += 1
                rec["error"] = " ".join(error.split())  # one line: it goes into the health answer
                changed = dict(rec)
        if self.on_tier_health is not None:
            try:
                self.on_tier_health(tier, changed)
            except Exception as e:  # noqa: BLE001 - reporting must never break a save
                self.log.warning("reporting the health of tier %s failed: %s", tier, e)

    def failing(self) -> dict[str, Failure]:
        """Tiers whose latest writes failed: tier -> {since (unix time), failures, error}."""
        with self._lock:
            return {k: dict(v) for k, v in self._failing.items()}

    # ------------------------------------------------------------------------------ this state
    def same_state(self, step: int, writer: str | None = None) -> set[str]:
        """The writers whose copy of ``step`` holds the state this process saves for it: this
        session, the one whose checkpoint of that step it restored, and ``writer``."""
        return {w for w in (self.session, self.restored.get(step), writer) if w}


def describe_failing(failing: dict[str, Failure]) -> str:
    """One line for the tiers ``failing()`` returns, e.g. ``gcs failing since
    2026-11-24T04:00:00Z (3 failed writes; last: Forbidden: ...)``; empty when none is."""
    def one(tier: str, rec: Failure) -> str:
        since, n = rec.get("since"), rec.get("failures")
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(since)) if isinstance(since, (int, float)) else "?"
        return f"{tier} failing since {when} ({n} failed write{'' if n == 1 else 's'}; last: {rec.get('error')})"

    return "; ".join(one(tier, rec) for tier, rec in sorted(failing.items()))


__all__ = ["Bookkeeping", "Failure", "Schedule", "describe_failing"]
