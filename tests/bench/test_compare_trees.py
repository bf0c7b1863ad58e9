"""bench/compare_trees.py: two real trees, each with its own bench module and Python, run in
subprocesses taking turns; the side-by-side table reads what each printed."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from bench import compare_trees

FAKE_BENCH = '''
import os, sys
with open(os.environ["ORDER_LOG"], "a") as f:
    f.write(os.path.basename(os.getcwd()) + "\\n")
print("| measure | size | seconds | verdict |")
print("|---|---|---|---|")
print(f"| write | 1.00 GiB | {sys.argv[1]} s | {sys.argv[2]} |")
'''


def _tree(root: Path, seconds: str, verdict: str) -> Path:
    (root / "bench").mkdir(parents=True)
    (root / "bench" / "__init__.py").write_text("")
    (root / "bench" / "fake_bench.py").write_text(FAKE_BENCH.replace("sys.argv[1]", repr(seconds))
                                                  .replace("sys.argv[2]", repr(verdict)))
    (root / ".venv" / "bin").mkdir(parents=True)
    (root / ".venv" / "bin" / "python").symlink_to(sys.executable)
    return root


def test_the_trees_take_turns_and_the_table_gives_after_over_before(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before, after = _tree(tmp_path / "old", "2.0", "ok"), _tree(tmp_path / "new", "3.0", "ok")
    log = tmp_path / "order.log"
    code = compare_trees.main([str(before), str(after), "--rounds", "2", "--bench", "fake_bench --any-arg",
                               "--env", f"ORDER_LOG={log}", "--json", str(tmp_path / "runs.json")])
    assert code == 0
    assert log.read_text().split() == ["old", "new", "new", "old"]  # the first tree alternates
    out = capsys.readouterr().out
    assert "| write | seconds | 2.0, 2.0 | 3.0, 3.0 | 2.0 | 3.0 | 1.500 | **no** |" in out
    assert "size" not in out.split("after / before")[1]  # equal in every run: left out
    assert "verdict" not in out.split("after / before")[1]
    # The saved runs print the same table again, running nothing.
    assert compare_trees.main(["--from-json", str(tmp_path / "runs.json")]) == 0
    assert "| write | seconds | 2.0, 2.0 | 3.0, 3.0 | 2.0 | 3.0 | 1.500 | **no** |" in capsys.readouterr().out
    assert len(log.read_text().split()) == 4


def test_a_failing_run_is_reported_and_the_exit_status_says_so(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before, after = _tree(tmp_path / "old", "2.0", "ok"), _tree(tmp_path / "new", "3.0", "ok")
    (after / "bench" / "fake_bench.py").write_text("raise SystemExit('broken bench')")
    code = compare_trees.main([str(before), str(after), "--rounds", "1", "--bench", "fake_bench x",
                               "--env", f"ORDER_LOG={tmp_path / 'order.log'}"])
    assert code == 1
    out = capsys.readouterr().out
    assert "after, round 1: FAILED (exit 1)" in out and "broken bench" in out
    assert "no comparison" in out


def test_a_tree_without_bench_or_python_is_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = _tree(tmp_path / "old", "2.0", "ok")
    assert compare_trees.main([str(before), str(tmp_path), "--bench", "fake_bench"]) == 2
    assert "has no bench/" in capsys.readouterr().err
