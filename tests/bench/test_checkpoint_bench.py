"""bench/checkpoint_bench.py kept runnable against the real checkpointer (its restore measure
still built a Checkpointer the old way, and every run of the bench failed at its last table)."""
from __future__ import annotations

from pathlib import Path

import pytest

from bench import checkpoint_bench


def test_every_measure_runs_on_a_small_state_and_the_emergency_saves_are_durable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        logging_restored: None) -> None:
    monkeypatch.setenv("SPOTTRAIN_BENCH_GB", "0.02")  # one 16 MiB tensor
    monkeypatch.setenv("SPOTTRAIN_BENCH_DIR", str(tmp_path))
    monkeypatch.setattr(checkpoint_bench, "REPEATS", 1)  # each measure once: its code, not its figures
    checkpoint_bench.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line]
    measures = [r.split("|")[1].strip()[:2] for r in rows[1:]]
    # measure 2 per hash (BLAKE3, SHA-256), 3 per state size, 4 warm and cold, 5 warm and cold
    # for torch.load and each hash
    assert measures == ["1.", "2.", "2.", "3.", "3.", "3.", "4.", "4."] + ["5."] * 6
    assert all("(ok)" in r for r in rows if r.startswith("| 3."))
    assert list(tmp_path.iterdir()) == []  # everything it wrote is removed
