"""trainer/checkpoint/tier_wait.py: start-up decides nothing while a tier is unknown; bounded; says why."""
from __future__ import annotations

import logging

import pytest

from tests.trainer.support import SleepClock
from trainer.checkpoint.tier_wait import WAITS, Stopped, StillUnknown, TierUnknown, until_known


class Clock(SleepClock):
    """Time that moves only when the wait sleeps (the sleeps are what is under test)."""


def test_waits_with_backoff_then_returns_what_the_attempt_found(caplog) -> None:
    clock, said = Clock(), []
    answers = iter([TierUnknown({"gcs": "Forbidden: 403"})] * 7 + ["restored"])

    def attempt() -> str:
        a = next(answers)
        if isinstance(a, Exception):
            raise a
        return a

    with caplog.at_level(logging.INFO):
        got = until_known(attempt, wait_s=900, log=logging.getLogger("t"), on_wait=said.append,
                          sleep=clock.sleep, clock=clock)
    assert got == "restored"
    assert clock.sleeps == [1, 2, 4, 8, 16, 30, 30]  # doubling, capped
    assert WAITS.cap_s == 30
    line = next(r.getMessage() for r in caplog.records if "event=waiting_for_tier" in r.getMessage())
    assert 'tier=gcs error="Forbidden: 403" waited_s=0 until=' in line
    assert said[0].startswith("for gcs (unknown for 0s, giving up at ")
    assert "event=tiers_known" in caplog.text


def test_gives_up_after_the_bound_with_a_clear_error() -> None:
    clock = Clock()

    def attempt() -> None:
        raise TierUnknown({"gcs": "ConnectionError: refused"})

    with pytest.raises(StillUnknown, match=r"gcs stayed unknown for 10 s \(wait_for_tiers_s = 10\)"):
        until_known(attempt, wait_s=10, log=logging.getLogger("t"), on_wait=lambda s: None,
                    sleep=clock.sleep, clock=clock)
    assert sum(clock.sleeps) == 10  # the last pause is cut to the bound


def test_every_rank_gives_up_when_one_does_and_a_notice_stops_the_wait() -> None:
    clock = Clock()

    def attempt() -> None:
        raise TierUnknown({"gcs (rank 0)": "403"})

    # Another rank's clock is past the bound: the agreed decision wins over this rank's own.
    with pytest.raises(StillUnknown):
        until_known(attempt, wait_s=900, log=logging.getLogger("t"), on_wait=lambda s: None,
                    sleep=clock.sleep, clock=clock, agree=lambda give_up, stop: (True, stop))
    with pytest.raises(Stopped):
        until_known(attempt, wait_s=900, log=logging.getLogger("t"), on_wait=lambda s: None,
                    sleep=lambda s: True, clock=clock)
