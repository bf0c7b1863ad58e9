"""trainer.checkpoint.interval: Young/Daly arithmetic and the policy's clamps."""

from __future__ import annotations

import math

import pytest

from trainer.checkpoint.interval import YoungDalyPolicy, changed_materially, young_daly


def test_young_daly_formula() -> None:
    assert young_daly(2.0, 3600.0) == pytest.approx(120.0)
    assert young_daly(0.5, 6 * 3600) == pytest.approx(math.sqrt(2 * 0.5 * 21600))
    assert young_daly(0.0, 100.0) == 0.0
    with pytest.raises(ValueError):
        young_daly(-1, 100)
    with pytest.raises(ValueError):
        young_daly(1, 0)


def test_first_save_before_any_measurement() -> None:
    p = YoungDalyPolicy(mtbf_s=3600, first_save_s=45)
    d = p.decide()
    assert d.seconds == 45 and "first save" in d.reason
    assert not p.measured


def test_interval_from_blocked_cost() -> None:
    p = YoungDalyPolicy(mtbf_s=3600, min_interval_s=0)
    p.observe(blocked_s=2.0, write_s=10.0)
    d = p.decide()
    assert d.seconds == pytest.approx(120.0)  # sqrt(2*2*3600); 10 s write / 0.5 duty = 20 < 120
    assert "Young/Daly" in d.reason and "C=2.000s" in d.reason


def test_slow_write_raises_interval() -> None:
    p = YoungDalyPolicy(mtbf_s=3600, max_write_duty=0.5)
    p.observe(blocked_s=0.02, write_s=100.0)  # T* = 12 s, but a write takes 100 s
    d = p.decide()
    assert d.seconds == pytest.approx(200.0)
    assert "background write" in d.reason


def test_clamps() -> None:
    p = YoungDalyPolicy(mtbf_s=3600, min_interval_s=30)
    p.observe(blocked_s=0.001)
    assert p.decide().seconds == 30
    q = YoungDalyPolicy(mtbf_s=100, max_interval_s=20)
    q.observe(blocked_s=50)
    assert q.decide().seconds == 20 and "capped" in q.decide().reason
    r = YoungDalyPolicy(mtbf_s=100)
    r.observe(blocked_s=50)
    assert r.decide().seconds == 50  # default cap: MTBF / 2


def test_moving_average() -> None:
    p = YoungDalyPolicy(alpha=0.5)
    p.observe(blocked_s=1.0, write_s=4.0)
    p.observe(blocked_s=3.0, write_s=8.0)
    assert p.blocked_s == pytest.approx(2.0)
    assert p.write_s == pytest.approx(6.0)
    p.observe(write_s=2.0)  # only the write time
    assert p.blocked_s == pytest.approx(2.0) and p.write_s == pytest.approx(4.0)


def test_a_wait_after_the_save_counts_as_part_of_its_blocked_time() -> None:
    """The optimizer step's wait for a save's copy is added to that save's cost afterwards: the
    average is what observing the sum at once would have given, first save or not."""
    for seen in ([], [1.0], [1.0, 3.0]):
        once, later = YoungDalyPolicy(alpha=0.5), YoungDalyPolicy(alpha=0.5)
        for x in seen:
            once.observe(blocked_s=x)
            later.observe(blocked_s=x)
        once.observe(blocked_s=0.2 + 0.6)
        later.observe(blocked_s=0.2)
        later.blocked_longer(0.6)
        assert later.blocked_s == pytest.approx(once.blocked_s)
    nothing = YoungDalyPolicy()
    nothing.blocked_longer(1.0)  # no save observed: nothing to add to
    assert nothing.blocked_s is None


@pytest.mark.parametrize("kw", [{"mtbf_s": 0}, {"first_save_s": -1}, {"max_write_duty": 0},
                                {"alpha": 1.5}, {"min_interval_s": -1}])
def test_rejects_bad_parameters(kw: dict) -> None:
    with pytest.raises(ValueError):
        YoungDalyPolicy(**kw)


def test_changed_materially() -> None:
    assert changed_materially(None, 10)
    assert not changed_materially(100, 120)
    assert changed_materially(100, 130)
    assert changed_materially(100, 70)
    assert changed_materially(0, 1) and not changed_materially(0, 0)
