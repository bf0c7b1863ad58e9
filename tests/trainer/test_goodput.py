"""trainer/goodput.py: the ledger survives torn lines and lost disks; the report's arithmetic."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from trainer.goodput import LEDGER_DIR, LEDGER_FILE, Ledger, read_events, read_store_events, report


def ev(session: str, seq: int, t: float, event: str, **kw: object) -> dict:
    return {"session": session, "seq": seq, "t": t, "event": event, **kw}


def test_torn_last_line_is_skipped_and_not_glued_to_the_next(tmp_path: Path) -> None:
    a = Ledger(tmp_path, session="a")
    a.append("session_start", started=1.0)
    a.close()
    path = tmp_path / LEDGER_DIR / LEDGER_FILE
    with open(path, "ab") as f:
        f.write(b'{"session": "a", "seq": 1, "ev')  # SIGKILL mid-write
    assert [e["event"] for e in read_events(path)] == ["session_start"]
    b = Ledger(tmp_path, session="b")
    b.append("session_start", started=2.0)
    b.close()
    assert [(e["session"], e["event"]) for e in read_events(path)] == [("a", "session_start"), ("b", "session_start")]


def test_report_arithmetic() -> None:
    events = [
        # Session 1: starts at 0, restores nothing, 100 s productive up to step 100, checkpoint at
        # step 50 (blocked 1 s), preempted at step 100 but that save is lost (the disk too).
        ev("s1", 0, 0.0, "session_start", started=0.0),
        ev("s1", 1, 10.0, "restore", step=0, seconds=2.0, startup_s=8.0),
        ev("s1", 2, 60.0, "checkpoint", step=50, blocked_s=1.0, productive_s=50.0),
        ev("s1", 3, 110.0, "progress", step=100, productive_s=100.0),
        ev("s1", 4, 111.0, "preemption_notice", step=100),
        # Session 2 comes back 89 s later, from step 50: 50 s of session 1 are lost.
        ev("s2", 0, 200.0, "session_start", started=200.0),
        ev("s2", 1, 210.0, "restore", step=50, seconds=4.0, startup_s=6.0),
        ev("s2", 2, 260.0, "finish", step=100, blocked_s=0.5, productive_s=50.0),
    ]
    r = report(events)
    assert r.wall_s == 260.0
    assert r.productive_s == pytest.approx(100.0)
    assert r.lost_s == pytest.approx(50.0)
    assert r.restore_s == 6.0 and r.startup_s == 14.0
    assert r.checkpoint_blocked_s == 1.5
    assert r.downtime_s == pytest.approx(260.0 - 111.0 - 60.0)
    assert r.goodput == pytest.approx(100.0 / 260.0)
    assert (r.preemptions, r.crashes, r.failures, r.sessions, r.finished) == (1, 0, 0, 2, True)


def test_lost_work_interpolates_and_counts_crashes() -> None:
    events = [
        ev("s1", 0, 0.0, "session_start", started=0.0),
        ev("s1", 1, 1.0, "restore", step=0, seconds=0.0, startup_s=1.0),
        ev("s1", 2, 21.0, "progress", step=20, productive_s=20.0),  # then SIGKILL
        ev("s2", 0, 30.0, "session_start", started=30.0),
        ev("s2", 1, 31.0, "restore", step=15, seconds=0.0, startup_s=1.0),
    ]
    r = report(events)
    assert r.lost_s == pytest.approx(5.0) and r.productive_s == pytest.approx(15.0)
    assert r.crashes == 1 and r.preemptions == 0 and not r.finished


def test_mirror_and_recovery_from_gcs(tmp_path: Path, gcs_emulator) -> None:
    from trainer.storage import GcsStore

    store = GcsStore(gcs_emulator.uri, client=gcs_emulator.client)
    a = Ledger(tmp_path / "run", store=store, session="000-a")
    a.append("session_start", started=1.0)
    a.append("restore", step=0, seconds=0.5, startup_s=1.0)
    a.close()
    assert len(read_store_events(store)) == 2
    shutil.rmtree(tmp_path / "run")  # the persistent disk is lost
    b = Ledger(tmp_path / "run", store=store, session="001-b")
    b.append("session_start", started=5.0)
    b.close()
    local = read_events(tmp_path / "run" / LEDGER_DIR / LEDGER_FILE)
    assert [(e["session"], e["seq"]) for e in local] == [("000-a", 0), ("000-a", 1), ("001-b", 0)]
    assert len(read_store_events(store)) == 3
    assert json.loads(store.get_bytes(f"{LEDGER_DIR}/001-b/000000.json"))["started"] == 5.0
