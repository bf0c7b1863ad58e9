"""bench/state_size_bench.py runs against the real checkpointer on a small state, and its fit is
the budget divided by the seconds a GiB costs (the trainer's share plus the disk's)."""
from __future__ import annotations

from pathlib import Path

import pytest

from bench import state_size_bench


def test_it_measures_every_moment_on_both_places_and_leaves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        logging_restored: None) -> None:
    monkeypatch.setenv("SPOTTRAIN_BENCH_SIZES_GB", "0.02")  # one 16 MiB tensor
    monkeypatch.setenv("SPOTTRAIN_BENCH_DIR", str(tmp_path))
    state_size_bench.main()
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| 0.0")]
    assert [r.split("|")[2].strip() for r in rows] == ["RAM disk", "this disk"]
    fit = [line for line in out.splitlines() if line.startswith("| PD-SSD") or line.startswith("| local SSD")]
    assert len(fit) == len(state_size_bench.PD_SIZES_GB) * len(state_size_bench.VCPUS) + len(state_size_bench.LOCAL_SSDS)
    assert list(tmp_path.iterdir()) == []


def test_the_fit_is_the_budget_over_the_seconds_a_gib_costs() -> None:
    # 1 s/GiB of the trainer's own and a disk writing one GiB a second: 2 s a GiB, 10 GiB in 20 s.
    assert state_size_bench.fits(20.0, 1.0, (1 << 30) / 1e6) == pytest.approx(10.0)
    assert state_size_bench.fits(20.0, 1.0, 100.0) < state_size_bench.fits(20.0, 1.0, 1000.0)
