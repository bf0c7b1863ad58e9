"""trainer/timeline.py and `status --plot`: the job's timeline from the goodput ledger."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from trainer.config import StatusConfig
from trainer.observe.ledger import LEDGER_DIR, LEDGER_FILE
from trainer.status import main as status_main
from trainer.observe.timeline import sessions
from tests.trainer.support import restore_logging  # noqa: F401  (fixture)


def _ledger(run_dir: Path) -> None:
    """Node a: a session that crashed at step 140 (checkpoint 100 durable on two tiers), one
    preempted at 180 (emergency save on persistent and GCS); node b: one that finished at 300."""
    t = 1_800_000_000.0
    evs: list[tuple[str, float, str, dict]] = [
        ("s1", 0, "session_start", {"started": t, "node": "a", "main": True, "price_per_hour": 2.0}),
        ("s1", 5, "restore", {"step": 0, "seconds": 1.0, "startup_s": 4.0}),
        ("s1", 30, "checkpoint", {"step": 100, "blocked_s": 0.1, "productive_s": 25.0}),
        ("s1", 31, "durable", {"tier": "local", "step": 100}),
        ("s1", 33, "durable", {"tier": "gcs", "step": 100}),
        ("s1", 40, "progress", {"step": 140, "productive_s": 35.0}),
        ("s2", 60, "session_start", {"started": t + 55, "node": "a", "main": True, "price_per_hour": 2.0}),
        ("s2", 62, "restore", {"step": 100, "seconds": 1.0, "startup_s": 1.0}),
        ("s2", 80, "preemption_notice", {"step": 180, "reason": "SIGTERM"}),
        ("s2", 82, "preempted", {"step": 180, "productive_s": 18.0, "blocked_s": 2.0, "persistent_ok": True,
                                 "gcs_ok": True}),
        ("s3", 120, "session_start", {"started": t + 110, "node": "b", "main": True, "price_per_hour": 3.0}),
        ("s3", 125, "restore", {"step": 180, "seconds": 1.0, "startup_s": 4.0}),
        ("s3", 150, "finish", {"step": 300, "blocked_s": 0.5, "productive_s": 25.0}),
    ]
    seq: dict[str, int] = {}
    lines = []
    for session, dt, event, fields in evs:
        lines.append(json.dumps({"session": session, "seq": seq.setdefault(session, 0), "t": t + dt, "event": event,
                                 **fields}))
        seq[session] += 1
    (run_dir / LEDGER_DIR).mkdir(parents=True)
    (run_dir / LEDGER_DIR / LEDGER_FILE).write_text("\n".join(lines) + "\n")


def test_sessions_outcomes_and_lost_work(tmp_path: Path) -> None:
    _ledger(tmp_path)
    from trainer.observe.ledger import read_events

    ss = sessions(read_events(tmp_path / LEDGER_DIR / LEDGER_FILE))
    assert [(s.node, s.outcome) for s in ss] == [("a", "crashed"), ("a", "preempted"), ("b", "finished")]
    t = 1_800_000_000.0
    assert ss[0].t_lost == t + 30  # from step 100 on, the crashed session's work was thrown away
    assert ss[1].t_lost is None and ss[2].t_lost is None
    assert ss[0].durable == [(t + 31, "local"), (t + 33, "gcs")]
    assert ss[1].emergency == [(t + 82, "persistent"), (t + 82, "gcs")] and ss[1].notices == [t + 80]


def test_status_plot_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _ledger(tmp_path)
    out = tmp_path / "timeline.png"
    assert status_main(StatusConfig(run_dir=tmp_path, plot=out)) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    assert f"timeline written to {out}" in capsys.readouterr().err


def test_without_matplotlib_the_message_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    _ledger(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    assert status_main(StatusConfig(run_dir=tmp_path, plot=tmp_path / "t.png")) == 2
    assert "command line: plot: --plot needs matplotlib: pip install matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "t.png").exists()


@pytest.mark.usefixtures("restore_logging")
def test_a_real_run_records_its_checkpoints_per_tier(tmp_path: Path) -> None:
    from trainer.config import RunConfig
    from trainer.observe.ledger import read_events
    from trainer.train import run

    cfg = RunConfig(run_dir=tmp_path / "run", local_dir=tmp_path / "local", steps=10, batch_size=4,
                    task="tests.trainer.example_task:build", health_port=None, watch_metadata=False,
                    checkpoint_every_steps=5)
    assert run(cfg).code == 0
    durable = {(e["tier"], e["step"]) for e in read_events(tmp_path / "run" / LEDGER_DIR / LEDGER_FILE)
               if e["event"] == "durable"}
    assert {("local", 5), ("persistent", 5), ("local", 10), ("persistent", 10)} <= durable
