"""bench/restore_memory_bench.py restores one saved state in one process and on two real gloo ranks,
and reports each rank's memory against the one process's."""
from __future__ import annotations

import re

import pytest

from bench import restore_memory_bench

pytestmark = pytest.mark.xdist_group("torchrun")


def test_it_restores_both_ways_and_reports_every_rank(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("SPOTTRAIN_BENCH_RESTORE_GB", "0.02")
    restore_memory_bench.main()
    out = capsys.readouterr().out
    assert re.search(r"state: 0\.0\d GiB in 1172 tensors; 2 gloo ranks", out), out
    rows = {m.group(1): m for m in re.finditer(r"^\| (one process|rank \d of 2)[^|]*\| ([\d.]+) \| ([\d.]+) \|", out, re.M)}
    assert sorted(rows) == ["one process", "rank 0 of 2", "rank 1 of 2"], out
    assert float(rows["one process"].group(2)) > 0.01  # the restore held the state in memory
    assert re.search(r"worst rank: [\d.]+x one process \(goal <= 1\.3x: (met|NOT met)\)", out), out
