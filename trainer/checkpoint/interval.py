"""Automatic checkpoint interval: Young/Daly from the run's own measured checkpoint cost.

Young (1974) and Daly (2006): with a checkpoint cost C and a mean time between failures MTBF,
the expected waste per unit time is about ``C / T + T / (2 * MTBF)`` (time spent saving, plus on
average half an interval of lost work per failure), minimised at ``T* = sqrt(2 * C * MTBF)``.

Which C. Saves here are asynchronous: the loop is blocked only while the state is copied to host
memory; the write, fsync and upload run in the background while training continues. So the cost
that the training pays per checkpoint, the C in the formula, is the *blocked* time, not the write
time. The write time matters differently: it delays when a checkpoint becomes durable (a constant
added to the lost work that does not depend on T, so it drops out of the optimum) and it bounds
how often we *can* save, because one save is in flight at a time and a background write competes
with the data loader for CPU and I/O. Hence the interval is

    T = clamp(max(sqrt(2 * C_blocked * MTBF), write_s / max_write_duty), min_interval_s, max_interval_s)

with the default ``max_write_duty = 0.5``: the background writer is busy at most half the time.
Each tier measures its own write time (local SSD, persistent disk, GCS upload), so slower tiers
get longer intervals while sharing the same C.

Default MTBF, 6 hours. Spot GPU VMs on Google Cloud have no availability guarantee; preemption
rates for popular GPU types (A100, H100, L4) in busy zones are reported at one every few hours to
one per day, plus host errors and bugs that kill the process. Preemptions with notice are covered
by the emergency save, so the periodic interval guards mostly against failures *without* notice
(hard kills, OOM, kernel/driver faults); 6 h is a deliberately pessimistic estimate of how often
those and notice-less preemptions happen. The cost of erring: with C = 0.2 s, T* is 93 s at 6 h and
66 s at 3 h, both cheap, so a pessimistic MTBF costs little. Override with ``mtbf_s``.

First save. Until a save has been measured there is no C; the first automatic save happens
``first_save_s`` (default 60 s) after the run (re)started, long enough to get past start-up and
compilation, short enough that a crash early in a run loses at most a minute.
"""

from __future__ import annotations

import dataclasses
import math

DEFAULT_MTBF_S = 6 * 3600.0
DEFAULT_FIRST_SAVE_S = 60.0


def young_daly(cost_s: float, mtbf_s: float) -> float:
    """The optimal interval ``sqrt(2 * C * MTBF)`` in seconds."""
    if cost_s < 0 or mtbf_s <= 0:
        raise ValueError("cost must be >= 0 and MTBF > 0")
    return math.sqrt(2.0 * cost_s * mtbf_s)


@dataclasses.dataclass(frozen=True)
class IntervalDecision:
    """The interval in seconds and one human line explaining it (for the log)."""

    seconds: float
    reason: str


@dataclasses.dataclass
class YoungDalyPolicy:
    """Automatic interval for one tier, fed with measurements of that tier's saves."""

    mtbf_s: float = DEFAULT_MTBF_S
    first_save_s: float = DEFAULT_FIRST_SAVE_S
    #: Never save more often than this, whatever the measurements say.
    min_interval_s: float = 10.0
    #: Never wait longer than this between saves (None: MTBF / 2).
    max_interval_s: float | None = None
    #: The background writer may be busy at most this fraction of the time.
    max_write_duty: float = 0.5
    #: Weight of the newest measurement in the moving averages.
    alpha: float = 0.3
    blocked_s: float | None = None
    write_s: float | None = None
    _blocked_weight: float = dataclasses.field(default=1.0, repr=False)  # the newest blocked_s's share

    def __post_init__(self) -> None:
        if self.mtbf_s <= 0 or self.first_save_s < 0 or self.min_interval_s < 0:
            raise ValueError("mtbf_s must be > 0, first_save_s and min_interval_s >= 0")
        if not 0 < self.max_write_duty <= 1 or not 0 < self.alpha <= 1:
            raise ValueError("max_write_duty and alpha must be in (0, 1]")

    def observe(self, *, blocked_s: float | None = None, write_s: float | None = None) -> None:
        """Record one save: seconds the loop was blocked, seconds this tier's write took."""
        a = self.alpha
        if blocked_s is not None:
            self._blocked_weight = 1.0 if self.blocked_s is None else a
            self.blocked_s = blocked_s if self.blocked_s is None else a * blocked_s + (1 - a) * self.blocked_s
        if write_s is not None:
            self.write_s = write_s if self.write_s is None else a * write_s + (1 - a) * self.write_s

    def blocked_longer(self, seconds: float) -> None:
        """The newest save blocked the loop ``seconds`` more than ``observe`` was told (the
        optimizer step waited for its copy): the average becomes what it would be had the
        observation included them."""
        if self.blocked_s is not None:
            self.blocked_s += self._blocked_weight * seconds

    @property
    def measured(self) -> bool:
        return self.blocked_s is not None

    def decide(self) -> IntervalDecision:
        if self.blocked_s is None:
            return IntervalDecision(self.first_save_s,
                                    f"first save {self.first_save_s:.0f}s after start (no cost measured yet)")
        hi = self.max_interval_s if self.max_interval_s is not None else self.mtbf_s / 2
        t_opt = young_daly(self.blocked_s, self.mtbf_s)
        reason = (f"Young/Daly sqrt(2*C*MTBF) with C={self.blocked_s:.3f}s blocked per save, "
                  f"MTBF={self.mtbf_s / 3600:.1f}h -> {t_opt:.0f}s")
        t = t_opt
        if self.write_s is not None and self.write_s / self.max_write_duty > t:
            t = self.write_s / self.max_write_duty
            reason += (f"; raised to {t:.0f}s so the {self.write_s:.1f}s background write keeps "
                       f"the writer busy <= {self.max_write_duty:.0%} of the time")
        if t < self.min_interval_s:
            t = self.min_interval_s
            reason += f"; raised to the minimum {t:.0f}s"
        if t > hi:
            t = hi
            reason += f"; capped at {t:.0f}s"
        return IntervalDecision(t, reason)


def changed_materially(old: float | None, new: float, tolerance: float = 0.25) -> bool:
    """True when ``new`` differs from ``old`` by more than ``tolerance`` (relative)."""
    if old is None:
        return True
    if old == 0:
        return new != 0
    return abs(new - old) / old > tolerance
