"""trainer/observe/glance.py and `trainer status --watch`: the run at a glance from its ledger."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.config import RunConfig
from trainer.observe.glance import SILENT_S, glance, lines
from trainer.train import run
from tests.trainer import example_task
from tests.trainer.support import restore_logging  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("restore_logging")


def _ev(session: str, seq: int, t: float, event: str, **fields: object) -> dict:
    return {"session": session, "seq": seq, "t": t, "event": event, **fields}


def _training(t0: float = 1000.0) -> list[dict]:
    """An earlier session preempted at step 40, and the newest one training: steps 40 -> 100 in 30 s."""
    return [
        _ev("a", 0, t0, "session_start", main=True), _ev("a", 1, t0 + 20, "progress", step=40, productive_s=18),
        _ev("a", 2, t0 + 21, "preempted", step=40),
        _ev("b", 0, t0 + 100, "session_start", main=True), _ev("b", 1, t0 + 105, "restore", step=40),
        _ev("b", 2, t0 + 120, "progress", step=70, productive_s=14),
        _ev("b", 3, t0 + 135, "checkpoint_save", step=100),
    ]


def test_a_training_session_has_a_rate_an_eta_and_a_vm_up() -> None:
    g = glance(_training(), now=1000.0 + 145, steps=1000)
    # The newest session only: (100 - 40) steps in 30 s, not the preempted one's.
    assert g["step"] == 100 and g["steps_per_s"] == pytest.approx(2.0)
    assert g["eta_s"] == pytest.approx(450.0) and g["last_event_age_s"] == pytest.approx(10.0)
    assert (g["vm_up"], g["silent"], g["doing"], g["session"]) == (True, False, "training", "b")
    first, vm = lines(g)
    assert first == "at a glance: step 100/1000 (10.0%), 2 steps/s, ETA 7m30s; last event 10s ago (checkpoint_save)"
    assert vm == "VM: up (session b), training"


def test_a_session_that_says_nothing_is_called_silent() -> None:
    g = glance(_training(), now=1000.0 + 135 + SILENT_S + 1, steps=1000)
    assert g["vm_up"] and g["silent"]
    assert "SILENT for 3m01s: hung, or gone without a word" in lines(g)[1]
    assert not glance(_training(), now=1000.0 + 135 + SILENT_S, steps=1000)["silent"]


@pytest.mark.parametrize(("tail", "doing"), [
    (_ev("b", 4, 1140.0, "preempted", step=100), "preempted: waiting for the group to recreate the VM"),
    (_ev("b", 4, 1140.0, "paused", step=100, reason="max_usd", cost_usd=2.0, max_usd=1.5),
     "paused at the spend cap (max_usd)"),
    (_ev("b", 4, 1140.0, "failed", reason="bad_input", detail="x"), "stopped on an error (bad_input)"),
    (_ev("b", 4, 1140.0, "finished", step=1000), "finished"),
])
def test_an_ended_session_means_no_vm_and_says_why(tail: dict, doing: str) -> None:
    g = glance([*_training(), tail], now=1140.0 + 5 * SILENT_S, steps=1000)
    assert (g["vm_up"], g["silent"], g["eta_s"], g["doing"]) == (False, False, None, doing)
    assert lines(g)[1] == f"VM: none running; {doing}"


def test_extend_steps_moves_the_total_and_an_empty_ledger_says_so() -> None:
    events = [*_training(), _ev("b", 4, 1136.0, "steps_changed", step=100, to=2000, **{"from": 1000})]
    assert glance(events, now=1140.0, steps=1000)["steps"] == 2000
    empty = glance([], now=0.0)
    assert (empty["step"], empty["vm_up"]) == (None, False)
    assert lines(empty) == ["at a glance: nothing in the ledger yet (no trainer has started)"]


def _paused_run(run_dir: Path) -> None:
    example_task.FETCHES[0] = 0
    cfg = RunConfig(run_dir=run_dir, steps=30, task="tests.trainer.example_task:build", batch_size=4,
                    health_port=None, watch_metadata=False, checkpoint_every_steps=5, stop_at_step=15)
    assert run(cfg).code == 75


def test_status_shows_the_glance_of_a_real_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from trainer.cli import main as cli

    _paused_run(tmp_path / "run")
    capsys.readouterr()
    assert cli(["status", "--run-dir", str(tmp_path / "run"), "--json"]) == 0
    g = json.loads(capsys.readouterr().out)["glance"]
    assert (g["step"], g["steps"], g["vm_up"], g["doing"]) == (15, 30, False, "paused at stop_at_step")
    assert g["steps_per_s"] > 0 and g["last_event"] == "paused"
    assert cli(["status", "--run-dir", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("at a glance: step 15/30 (50.0%), ") and "ago (paused)" in out[0]
    assert out[1] == "VM: none running; paused at stop_at_step"


def test_watch_refreshes_count_times_and_count_needs_watch(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from trainer.cli import main as cli

    _paused_run(tmp_path / "run")
    capsys.readouterr()
    assert cli(["status", "--run-dir", str(tmp_path / "run"), "--watch", "0", "--count", "3", "--json"]) == 0
    reports = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(reports) == 3 and {r["glance"]["step"] for r in reports} == {15}
    assert cli(["status", "--run-dir", str(tmp_path / "run"), "--watch", "0", "--count", "2"]) == 0
    assert capsys.readouterr().out.count("at a glance: step 15/30") == 2
    assert cli(["status", "--run-dir", str(tmp_path / "run"), "--count", "2"]) == 2
    assert "count: --count bounds --watch; give --watch too" in capsys.readouterr().err
    assert cli(["status", "--run-dir", str(tmp_path / "run"), "--watch", "-1", "--count", "2"]) == 2
    assert "watch_s" in capsys.readouterr().err
