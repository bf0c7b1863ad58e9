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
    restores: list[float] = []

    def measure_5(d: Path, gb: float, rows: list) -> None:
        # Measure 5 (fresh processes, 85 s of the suite) runs in test_checkpoint_bench_restore.py;
        # here only that the bench calls it with the state's size and prints its rows.
        assert d.is_dir() and str(d).startswith(str(tmp_path))
        restores.append(gb)
        rows.append(("5. restore", "size", "s", "s", "1.00"))

    monkeypatch.setattr(checkpoint_bench, "_measure_restore", measure_5)
    checkpoint_bench.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line]
    measures = [r.split("|")[1].strip()[:2] for r in rows[1:]]
    # measure 2 per hash (BLAKE3, SHA-256), 3 per state size, 4 warm and cold, then measure 5's
    assert measures == ["1.", "2.", "2.", "3.", "3.", "3.", "4.", "4.", "5."]
    assert restores == [0.02]
    assert all("(ok)" in r for r in rows if r.startswith("| 3."))
    assert list(tmp_path.iterdir()) == []  # everything it wrote is removed


def test_a_selection_of_measures_runs_only_those(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        logging_restored: None) -> None:
    monkeypatch.setenv("SPOTTRAIN_BENCH_GB", "0.02")
    monkeypatch.setenv("SPOTTRAIN_BENCH_DIR", str(tmp_path))
    monkeypatch.setenv("SPOTTRAIN_BENCH_MEASURES", "2,4")
    monkeypatch.setattr(checkpoint_bench, "REPEATS", 1)
    monkeypatch.setattr(checkpoint_bench, "_measure_restore", lambda *a: pytest.fail("measure 5 was not asked for"))
    checkpoint_bench.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line]
    assert [r.split("|")[1].strip()[:2] for r in rows[1:]] == ["2.", "2.", "4.", "4."]


@pytest.mark.parametrize("value", ["6", "two", ","])
def test_a_selection_naming_no_measure_is_refused_with_exit_2(
        value: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("SPOTTRAIN_BENCH_MEASURES", value)
    with pytest.raises(SystemExit) as e:
        checkpoint_bench.main()
    assert e.value.code == 2
    assert f"SPOTTRAIN_BENCH_MEASURES={value!r}: give measure numbers 1-5" in capsys.readouterr().err
