"""bench/own_loop_bench.py kept runnable and fair: both variants train the example's own loop for
the same steps on the same model and data, each in a process of its own, and the spottrain one
goes through the real `python -m trainer run --script` path (it saves its final checkpoint)."""
from __future__ import annotations

import math

import pytest

from bench import own_loop_bench


def test_both_variants_train_the_same_steps_and_only_spottrain_saves(capsys: pytest.CaptureFixture[str],
                                                                     tmp_path) -> None:
    results = own_loop_bench.measure(steps=3, rounds=2, batch=4, samples=16)
    assert set(results) == {"plain", "spottrain"}
    for variant, runs in results.items():
        assert len(runs) == 2
        for r in runs:
            assert r["steps"] == 3 and r["loop_s"] > 0 and r["steps_per_s"] > 0, (variant, r)
            assert math.isfinite(r["final_loss"]), (variant, r)
            assert "cpu_steps_per_s" in r and "steady_steps_per_s" in r  # nan in a run this short
    assert all(r["saves"] == 0 for r in results["plain"])
    assert all(r["saves"] >= 1 for r in results["spottrain"])  # the trainer's final checkpoint, on disk
    text = own_loop_bench.table(results, 3, 4, 16)
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line][1:]
    # Three figures a variant: wall (whole loop, steady) and the steady CPU time.
    assert [row.split("|")[1].strip() for row in rows] == [v for v in own_loop_bench.VARIANTS.values() for _ in "123"]
    assert [row.split("|")[4].strip() for row in rows[:1]] == ["1.000"]  # the plain loop is the baseline
    assert [row.split("|")[5].strip() for row in rows[:1]] == ["1.000"]  # paired with itself, per round

