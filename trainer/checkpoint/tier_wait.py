"""Start-up's rule for a tier it cannot see: unknown is not empty.

A configured tier that cannot be listed or read (GCS answering 403 while a new VM's IAM grant
propagates, which takes up to about 7 minutes; GCS down; a disk that fails to read) may hold the
job's newest checkpoint. Deciding where to resume without it could restart an old step, or step
0, while that checkpoint exists. So the trainer decides nothing while a configured tier is
unknown: it tries again with bounded backoff, logs what it waits for (``event=waiting_for_tier``
with the tier, the error, the time waited and the time it gives up), answers the health check
``ok waiting ...`` so that the managed instance group does not recreate the VM meanwhile, and
after ``wait_for_tiers_s`` (default 900 s: twice the longest IAM propagation) gives up with exit
69 (EX_UNAVAILABLE) having trained, written and deleted nothing. systemd's ``Restart=on-failure``
starts it again 10 s later, and it waits again: a tier that stays unknown costs an idle VM, never
a fresh start.

Why the trainer does not proceed when a *known* tier holds a checkpoint: nothing bounds what the
unknown tier may hold. GCS can be ahead of this disk (another VM of the job wrote it after a
zone change; a save that reached GCS but not the disk), so a known checkpoint, however new, may
be older than the unknown tier's. Resuming from it would redo (and re-upload, colliding with the
create-only objects) work that exists, and count it twice in the ledger. Waiting costs the
outage's length of an idle VM; a GCS outage also blocks every GCS save, so little is lost.

Under torchrun the attempt is collective and raises on every rank at once, and the decisions to
give up or to stop for a preemption notice are agreed on by all ranks (``agree``).
"""
from __future__ import annotations

import logging
import time
from datetime import datetime, timezone
from typing import Callable, TypeVar

from trainer import retry, untrusted

T = TypeVar("T")

#: Default of ``RunConfig.wait_for_tiers_s``: covers IAM propagation (up to ~7 minutes) twice.
DEFAULT_WAIT_S = 900.0
#: The waits between tries: 1 s doubling to 30 s, no jitter (every rank decides together).
WAITS = retry.Policy(first_s=1.0, cap_s=30.0, jitter=0.0)


class TierUnknown(Exception):
    """A configured tier could not be listed or read: what it holds is unknown (not empty)."""

    def __init__(self, tiers: dict[str, str]):
        self.tiers = dict(tiers)  # tier name -> the error
        super().__init__("; ".join(f"{t}: {why}" for t, why in self.tiers.items()))


class StillUnknown(Exception):
    """A tier stayed unknown for the whole wait: the trainer exits 69 without training."""


class Stopped(Exception):
    """A preemption notice came during the wait: nothing was trained, nothing to save."""


def until_known(attempt: Callable[[], T], *, wait_s: float, log: logging.Logger,
                on_wait: Callable[[str], None], sleep: Callable[[float], bool],
                agree: Callable[[bool, bool], tuple[bool, bool]] = lambda give_up, stop: (give_up, stop),
                stop_requested: Callable[[], bool] = lambda: False,
                clock: Callable[[], float] = time.monotonic, waited_before: float = 0.0) -> T:
    """``attempt()`` until it raises no :class:`TierUnknown`; its result.

    ``on_wait(text)`` is told what is awaited (the health answer); ``sleep(s)`` returns True when
    interrupted by a preemption notice; ``agree(give_up, stop)`` makes both decisions job-wide.
    Raises :class:`StillUnknown` once ``waited_before`` (earlier waits of the same start-up) plus
    this wait reach ``wait_s``, and :class:`Stopped` on a notice.
    """
    start = clock() - waited_before
    end_wall = time.time() - waited_before + wait_s
    backoff = retry.Backoff(WAITS)
    tries = 0
    while True:
        tries += 1
        try:
            result = attempt()
        except TierUnknown as e:
            unknown = e
        else:
            if tries > 1:
                log.info("event=tiers_known waited_s=%.1f tries=%d", clock() - start, tries)
            return result
        waited = clock() - start
        give_up, stop = agree(waited >= wait_s, stop_requested())
        what = ", ".join(sorted(unknown.tiers))
        if stop:
            raise Stopped(f"a preemption notice came while waiting for {what}")
        if give_up:
            raise StillUnknown(
                f"{what} stayed unknown for {waited:.0f} s (wait_for_tiers_s = {wait_s:g}): {unknown}. "
                "Nothing was trained, written or deleted; the trainer never starts from scratch "
                "while a configured tier cannot be read. Fix access to it (IAM, network) or wait: "
                "the next start tries again")
        pause = min(backoff.next(), max(0.0, wait_s - waited))
        # The health answer first: whoever reads the line below may ask it at once.
        on_wait(f"for {what} (unknown for {waited:.0f}s, giving up at {_iso(end_wall)})")
        for tier, why in sorted(unknown.tiers.items()):
            log.warning("event=waiting_for_tier tier=%s error=%s waited_s=%.0f until=%s next_try_s=%.0f "
                        "(not deciding where to resume while %s cannot be read: it may hold the newest "
                        "checkpoint)", tier, untrusted.shown(_one_line(why)), waited, _iso(end_wall), pause, tier)
        if sleep(pause):
            raise Stopped(f"a preemption notice came while waiting for {what}")


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _one_line(text: str) -> str:
    return " ".join(str(text).split())[:300]
