"""trainer/goodput.py: the ledger survives torn lines and lost disks; the report's arithmetic."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from trainer.observe.goodput import report
from trainer.observe.ledger import LEDGER_DIR, LEDGER_FILE, Ledger, read_events, read_store_events


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


def test_a_ledger_written_before_finish_was_renamed_still_reads(tmp_path: Path) -> None:
    """``Finished`` was ``finish`` in the ledger and ``event=finished`` in its log line; it is
    ``finished`` in both now, and a ledger that says ``finish`` (the run dir's or the mirror's)
    reads as ``finished``: the report, the glance and the rollback guard see a finished run."""
    from trainer.observe.events import Finished
    from trainer.observe.glance import glance

    assert Finished.kind == Finished.line == "finished"
    old = [ev("s1", 0, 0.0, "session_start", started=0.0), ev("s1", 1, 1.0, "restore", step=0, seconds=0.1,
                                                               startup_s=1.0),
           ev("s1", 2, 9.0, "finish", step=8, blocked_s=0.5, productive_s=8.0)]
    path = tmp_path / LEDGER_DIR / LEDGER_FILE
    path.parent.mkdir(parents=True)
    path.write_text("".join(json.dumps(e) + "\n" for e in old))
    events = read_events(path)
    assert [e["event"] for e in events] == ["session_start", "restore", "finished"]
    assert report(old).finished and report(events).finished
    assert glance(events, now=10.0)["doing"] == "finished"

    class Mirror:
        def list(self, prefix: str) -> list[str]:
            return [f"{prefix}s1/{e['seq']:06d}.json" for e in old]

        def get_bytes(self, key: str) -> bytes:
            return json.dumps(old[int(key[-11:-5])]).encode()

    assert [e["event"] for e in read_store_events(Mirror())][-1] == "finished"


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
    from trainer.checkpoint.stores import GcsStore

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
    # Recovered in the background: in the file after this session's first event, in any order.
    assert sorted((e["session"], e["seq"]) for e in local) == [("000-a", 0), ("000-a", 1), ("001-b", 0)]
    assert len(read_store_events(store)) == 3
    assert json.loads(store.get_bytes(f"{LEDGER_DIR}/001-b/000000.json"))["started"] == 5.0


def test_cost_over_two_sessions_at_different_prices() -> None:
    events = [
        # Session 1 at $2/h (on demand $6/h): 0..3600 s, reaches step 100 but is killed; the
        # next session restores from step 50, so half of its 3000 productive seconds survive.
        ev("s1", 0, 0.0, "session_start", started=0.0, price_per_hour=2.0, on_demand_price_per_hour=6.0),
        ev("s1", 1, 100.0, "restore", step=0, seconds=50.0, startup_s=50.0),
        ev("s1", 2, 1600.0, "checkpoint", step=50, blocked_s=0.0, productive_s=1500.0),
        ev("s1", 3, 3600.0, "progress", step=100, productive_s=3000.0),  # then SIGKILL
        # Session 2 at $3/h (on demand $7.2/h), started 400 s later, runs 1800 s to step 150.
        ev("s2", 0, 4000.0, "session_start", started=4000.0, price_per_hour=3.0, on_demand_price_per_hour=7.2),
        ev("s2", 1, 4100.0, "restore", step=50, seconds=60.0, startup_s=40.0),
        ev("s2", 2, 5800.0, "finish", step=150, blocked_s=0.0, productive_s=1700.0),
    ]
    c = report(events).cost
    # Each session billed for its own span (the 400 s between them is no VM).
    assert c.cost_so_far == pytest.approx(1.0 * 2.0 + 0.5 * 3.0)
    assert c.cost_per_1000_steps == pytest.approx(3.5 / 150 * 1000)
    # Goodput 1 on demand: only the productive seconds that survived, at each session's price.
    assert c.on_demand_equivalent == pytest.approx(1500 / 3600 * 6.0 + 1700 / 3600 * 7.2)
    assert c.savings == pytest.approx(c.on_demand_equivalent - 3.5)
    assert (c.priced_sessions, c.unpriced_sessions) == (2, 0)
    d = report(events).as_dict()["cost"]
    assert d["cost_so_far"] == 3.5 and d["priced_sessions"] == 2


def test_cost_without_prices_is_null_and_counted_unpriced() -> None:
    events = [
        ev("s1", 0, 0.0, "session_start", started=0.0),  # a ledger from before prices existed
        ev("s1", 1, 10.0, "restore", step=0, seconds=0.0, startup_s=10.0),
        ev("s1", 2, 370.0, "progress", step=20, productive_s=360.0),
        ev("s2", 0, 400.0, "session_start", started=400.0, price_per_hour=None, on_demand_price_per_hour=None),
        ev("s2", 1, 410.0, "restore", step=20, seconds=0.0, startup_s=10.0),
    ]
    d = report(events).as_dict()["cost"]
    assert d == {"cost_so_far": None, "cost_per_1000_steps": None, "on_demand_equivalent": None,
                 "savings": None, "priced_sessions": 0, "unpriced_sessions": 2}
    assert report([]).as_dict()["cost"]["unpriced_sessions"] == 0


def test_cost_with_one_unpriced_session_is_a_lower_bound_without_savings() -> None:
    events = [
        ev("s1", 0, 0.0, "session_start", started=0.0),
        ev("s1", 1, 3600.0, "progress", step=10, productive_s=3000.0),
        ev("s2", 0, 3600.0, "session_start", started=3600.0, price_per_hour=1.0, on_demand_price_per_hour=4.0),
        ev("s2", 1, 3700.0, "restore", step=10, seconds=0.0, startup_s=100.0),
        ev("s2", 2, 7200.0, "progress", step=20, productive_s=3400.0),
    ]
    c = report(events).cost
    assert c.cost_so_far == pytest.approx(1.0)  # session 1's hour is unknown, not free
    assert c.cost_per_1000_steps == pytest.approx(1.0 / 20 * 1000)
    assert c.on_demand_equivalent == pytest.approx(3400 / 3600 * 4.0)
    assert c.savings is None
    assert (c.priced_sessions, c.unpriced_sessions) == (1, 1)


def test_two_nodes_roll_up_per_node_and_for_the_job() -> None:
    """An on-demand coordinator `c` ($6/h, rank 0 throughout) and a Spot worker `w` ($2/h): the
    worker is lost at step 100 (checkpoint at 50); the coordinator restarts alone from 50."""
    hour = 3600.0
    events = [
        ev("c1", 0, 0.0, "session_start", started=0.0, node="c", main=True, price_per_hour=6.0,
           on_demand_price_per_hour=6.0),
        ev("c1", 1, 10.0, "restore", step=0, seconds=1.0, startup_s=9.0),
        ev("c1", 2, 510.0, "checkpoint", step=50, blocked_s=0.0, productive_s=500.0),
        ev("c1", 3, 1010.0, "progress", step=100, productive_s=1000.0),
        ev("c1", 4, 1020.0, "failed", reason="exception", detail="peer gone"),
        ev("w1", 0, 0.0, "session_start", started=0.0, node="w", main=False, price_per_hour=2.0,
           on_demand_price_per_hour=6.0),
        ev("w1", 1, 10.0, "restore", step=0, seconds=1.0, startup_s=9.0),
        ev("w1", 2, 1010.0, "progress", step=100, productive_s=1000.0),  # then the VM is gone
        ev("c2", 0, 1030.0, "session_start", started=1030.0, node="c", main=True, price_per_hour=6.0,
           on_demand_price_per_hour=6.0),
        ev("c2", 1, 1040.0, "restore", step=50, seconds=2.0, startup_s=8.0),
        ev("c2", 2, 2040.0, "finish", step=150, blocked_s=0.0, productive_s=1000.0),
    ]
    r = report(events)
    # The job follows its rank-0 sessions (the coordinator's): 500 s of c1 were redone.
    assert (r.sessions, r.failures, r.finished, r.steps) == (2, 1, True, 150)
    assert r.productive_s == pytest.approx(1500.0) and r.lost_s == pytest.approx(500.0)
    assert r.wall_s == pytest.approx(2040.0)
    assert set(r.nodes) == {"c", "w"}
    c, w = r.nodes["c"], r.nodes["w"]
    assert (c["sessions"], c["finished"], w["sessions"], w["finished"]) == (2, True, 1, False)
    # The job restored from step 50 after the worker was gone: half its work is lost too.
    assert w["productive_s"] == pytest.approx(500.0) and w["lost_s"] == pytest.approx(500.0)
    assert c["productive_s"] == pytest.approx(1500.0) and c["lost_s"] == pytest.approx(500.0)
    # The job's cost is the nodes' costs together, each at its own price.
    expected = (1020.0 + 1010.0) / hour * 6.0 + 1010.0 / hour * 2.0
    assert r.cost.cost_so_far == pytest.approx(expected)
    assert r.cost.cost_per_1000_steps == pytest.approx(expected / 150 * 1000)
    assert r.cost.priced_sessions == 3
    assert report([e for e in events if e["session"].startswith("c")]).nodes == {}  # one node: no rollup


def test_time_without_a_vm_is_counted_by_zone_and_provisioning_model() -> None:
    """Session 1 ends at 100; the next VM boots at 700 in zone b (Spot), its trainer starts at 760:
    600 s waited for capacity, 60 s were boot. Session 3 is a restart on that same VM (booted
    before session 2 ended): no wait. Session 4 comes 1000 s later on demand in zone c."""
    events = [
        ev("s1", 0, 0.0, "session_start", started=0.0),
        ev("s1", 1, 1.0, "placement", zone="us-central1-a", provisioning="SPOT", boot_time=-50.0),
        ev("s1", 2, 100.0, "preemption_notice", step=10),
        ev("s2", 0, 760.0, "session_start", started=760.0),
        ev("s2", 1, 761.0, "placement", zone="us-central1-b", provisioning="SPOT", boot_time=700.0),
        ev("s2", 2, 800.0, "progress", step=20, productive_s=30.0),  # then a crash
        ev("s3", 0, 810.0, "session_start", started=810.0),
        ev("s3", 1, 811.0, "placement", zone="us-central1-b", provisioning="SPOT", boot_time=700.0),
        ev("s3", 2, 900.0, "preemption_notice", step=30),
        ev("s4", 0, 1950.0, "session_start", started=1950.0),
        ev("s4", 1, 1951.0, "placement", zone="us-central1-c", provisioning="STANDARD", boot_time=1900.0),
        ev("s4", 2, 2000.0, "finish", step=40, blocked_s=0.0, productive_s=40.0),
    ]
    r = report(events)
    assert r.capacity_wait == {"us-central1-b/SPOT": 600.0, "us-central1-c/STANDARD": 1000.0}
    assert r.capacity_wait_s == 1600.0
    assert r.downtime_s == pytest.approx(660.0 + 10.0 + 1050.0)  # waits, boots and the crash gap
    d = r.as_dict()
    assert d["capacity_wait"] == {"us-central1-b/SPOT": 600.0, "us-central1-c/STANDARD": 1000.0}


def test_sessions_without_a_placement_count_no_capacity_wait() -> None:
    events = [
        ev("s1", 0, 0.0, "session_start", started=0.0),
        ev("s1", 1, 100.0, "preemption_notice", step=10),
        ev("s2", 0, 900.0, "session_start", started=900.0),
        ev("s2", 1, 1000.0, "finish", step=20, blocked_s=0.0, productive_s=10.0),
    ]
    r = report(events)
    assert (r.capacity_wait_s, r.capacity_wait) == (0.0, {})
    assert r.downtime_s == pytest.approx(800.0)


# ------------------------------------------------------------------------------------------------
# The ledger is best-effort: malformed events are skipped, write errors are counted, never fatal.
# ------------------------------------------------------------------------------------------------

GOOD = [ev("s1", 0, 0.0, "session_start", started=0.0),
        ev("s1", 1, 1.0, "restore", step=0, seconds=0.5, startup_s=0.5),
        ev("s1", 2, 11.0, "progress", step=10, productive_s=10.0)]

MALFORMED = [
    ["not", "an", "object"],
    "a string",
    {"session": "s9", "seq": 0, "event": "progress"},                                 # no t
    {"seq": 0, "t": 1.0, "event": "progress"},                                        # no session
    ev("s9", "zero", 1.0, "progress", step=1, productive_s=1.0),                       # seq not a number
    ev("s9", -1, 1.0, "progress", step=1, productive_s=1.0),                           # negative seq
    ev(7, 0, 1.0, "progress", step=1, productive_s=1.0),                               # session not a string
    ev("s9", 1, "noon", "progress", step=1, productive_s=1.0),                         # t not a number
    ev("s9", 2, float("nan"), "progress", step=1, productive_s=1.0),                   # t NaN
    ev("s9", 3, 1.0, "progress", step="3", productive_s=1.0),                          # step a string
    ev("s9", 4, 1.0, "progress", step=2.5, productive_s=1.0),                          # step not whole
    ev("s9", 5, 1.0, "progress", step=True, productive_s=1.0),                         # step a bool
    ev("s9", 6, 1.0, "progress", productive_s=1.0),                                    # productive_s, no step
    ev("s9", 7, 1.0, "checkpoint", step=1, productive_s="1", blocked_s=0.1),          # productive_s a string
    ev("s9", 8, 1.0, "checkpoint", step=1, productive_s=1.0, blocked_s=None),         # blocked_s null
    ev("s9", 9, 1.0, "restore", seconds=1.0, startup_s=1.0),                           # restore without step
    ev("s9", 10, 1.0, "session_start"),                                                # no started
    ev("s9", 11, 1.0, 42),                                                             # event not a string
]


def test_report_and_readers_skip_malformed_events_with_a_warning(tmp_path: Path, caplog) -> None:
    r = report(GOOD + MALFORMED)
    assert r.skipped_events == len(MALFORMED)
    assert (r.sessions, r.productive_s) == (1, 10.0)  # as if only GOOD were there
    assert "event=ledger_skip" in caplog.text
    path = tmp_path / LEDGER_DIR / LEDGER_FILE
    path.parent.mkdir(parents=True)
    path.write_text("".join(json.dumps(e) + "\n" for e in GOOD + MALFORMED))
    skipped: list[str] = []
    assert read_events(path, skipped=skipped) == GOOD
    assert len(skipped) == len(MALFORMED) and skipped[7].endswith("'t' is not a number ('noon')")


def test_malformed_objects_in_the_mirror_do_not_stop_a_session_or_status(tmp_path: Path, gcs_emulator) -> None:
    from trainer.config import StatusConfig
    from trainer.status import collect
    from trainer.checkpoint.stores import GcsStore

    store = GcsStore(gcs_emulator.uri, client=gcs_emulator.client)
    for e in GOOD:
        store.put_bytes(f"{LEDGER_DIR}/{e['session']}/{e['seq']:06d}.json", json.dumps(e).encode())
    for i, bad in enumerate(MALFORMED):
        store.put_bytes(f"{LEDGER_DIR}/s9/{100 + i:06d}.json", json.dumps(bad).encode())
    store.put_bytes(f"{LEDGER_DIR}/s9/000999.json", b"{not json")
    store.put_bytes(f"{LEDGER_DIR}/s9/000998.json", b"[" * 200_000)  # planted: RecursionError in json
    skipped: list[str] = []
    assert sorted(map(str, read_store_events(store, skipped=skipped))) == sorted(map(str, GOOD))
    assert len(skipped) == len(MALFORMED)  # (the unparsable one is a torn write: silent)
    # A new session recovers the good ones into its (empty) run dir and carries on.
    led = Ledger(tmp_path / "run", store=store, session="s2")
    led.append("session_start", started=20.0)
    assert led.close()
    local = read_events(tmp_path / "run" / LEDGER_DIR / LEDGER_FILE)
    assert sorted((e["session"], e["seq"]) for e in local) == [("s1", 0), ("s1", 1), ("s1", 2), ("s2", 0)]
    s = collect(StatusConfig(run_dir=tmp_path / "run", gcs_uri=gcs_emulator.uri))
    assert s["goodput"]["sessions"] == 2 and s["goodput"]["skipped_events"] == len(MALFORMED)


def test_a_read_only_run_dir_never_stops_the_ledger_and_the_errors_reach_the_mirror(small_fs, gcs_emulator) -> None:
    from trainer.checkpoint.stores import GcsStore

    fs = small_fs("run", 1 << 20)
    fs.readonly()
    store = GcsStore(gcs_emulator.uri, client=gcs_emulator.client)
    led = Ledger(fs.path, session="s1")  # cannot create its file: counted, not raised
    led.append("session_start", started=0.0)
    led.mirror_to(store)
    led.append("restore", step=0, seconds=0.0, startup_s=0.0)
    assert led.close()
    assert led.errors["local"] >= 2 and led.errors["mirror"] == 0
    r = report(read_store_events(store))
    assert r.sessions == 1 and r.ledger_errors == {"local": 2}


def test_a_full_run_dir_loses_no_later_event_once_there_is_room_again(small_fs) -> None:
    fs = small_fs("run", 256 << 10)
    led = Ledger(fs.path, session="s1")
    led.append("session_start", started=0.0)
    fs.fill()
    for i in range(100):  # past the file's last page: ENOSPC, counted
        led.append("progress", step=i + 1, productive_s=float(i + 1))
    assert led.errors["local"] > 0
    fs.free()
    led.append("finished", step=101, blocked_s=0.0, productive_s=101.0)
    led.close()
    events = read_events(fs.path / LEDGER_DIR / LEDGER_FILE)
    assert events[0]["event"] == "session_start" and events[-1]["event"] == "finished"  # nothing glued
    assert [e["seq"] for e in events] == sorted(e["seq"] for e in events)


def test_status_names_an_unreadable_tier_and_what_the_ledger_could_not_do(tmp_path: Path, gcs_proxy) -> None:
    from trainer.config import StatusConfig
    from trainer.status import _human, collect

    path = tmp_path / LEDGER_DIR / LEDGER_FILE
    path.parent.mkdir(parents=True)
    lines = GOOD + [ev("s1", 3, 12.0, "ledger_error", where="mirror", count=4, error="503"), MALFORMED[7]]
    path.write_text("".join(json.dumps(e) + "\n" for e in lines))
    gcs_proxy.proxy.add("*", r".", "status", status=403, times=None)
    s = collect(StatusConfig(run_dir=tmp_path, gcs_uri=gcs_proxy.uri))
    assert list(s["unknown_tiers"]) == ["gcs"] and "Forbidden" in s["unknown_tiers"]["gcs"]
    assert s["goodput"]["ledger_errors"] == {"mirror": 4} and s["goodput"]["skipped_events"] == 1
    text = _human(s)
    assert "WARNING: gcs cannot be read (Forbidden" in text and "it may hold a newer checkpoint" in text
    assert "ledger: 4 failed write(s) to the mirror, 1 malformed event(s) skipped" in text


def test_staging_is_badput_of_its_own_before_the_first_session() -> None:
    events = [
        # `trainer stage` ran from 0 to 30 s (a session of its own, no session_start), then the
        # trainer trained 0..100 s productive and finished; a second boot staged nothing new.
        ev("st1", 0, 30.0, "staging", started=0.0, seconds=30.0, downloaded_bytes=1000, node="vm"),
        ev("s1", 0, 31.0, "session_start", started=31.0, node="vm"),
        ev("s1", 1, 32.0, "restore", step=0, seconds=0.0, startup_s=1.0),
        ev("s1", 2, 131.0, "preemption_notice", step=100),
        ev("s1", 3, 132.0, "preempted", step=100, productive_s=100.0),
        ev("st2", 0, 202.0, "staging", started=200.0, seconds=2.0, downloaded_bytes=0, node="vm"),
        ev("s2", 0, 203.0, "session_start", started=203.0, node="vm"),
        ev("s2", 1, 204.0, "restore", step=100, seconds=0.0, startup_s=1.0),
        ev("s2", 2, 304.0, "finish", step=200, productive_s=100.0),
    ]
    r = report(events)
    assert r.staging_s == pytest.approx(32.0) and r.staging_bytes == 1000
    assert r.wall_s == pytest.approx(304.0)  # from the first staging, not the first session
    assert r.sessions == 2 and r.crashes == 0  # staging runs are not trainer sessions
    assert r.downtime_s == pytest.approx(304.0 - 101.0 - 101.0 - 32.0)
    assert r.goodput == pytest.approx(200.0 / 304.0)
    assert r.nodes == {}  # one node, whatever the number of staging runs


def test_nodes_staging_side_by_side_count_once_for_the_job() -> None:
    events = [
        ev("a", 0, 10.0, "staging", started=0.0, downloaded_bytes=5, node="n1"),
        ev("b", 0, 12.0, "staging", started=1.0, downloaded_bytes=5, node="n2"),
    ]
    r = report(events)
    assert r.staging_s == pytest.approx(12.0) and r.staging_bytes == 10 and r.sessions == 0
    assert r.nodes["n1"]["staging_s"] == pytest.approx(10.0)


def test_a_wall_clock_step_mid_session_changes_no_duration(tmp_path: Path) -> None:
    """A 49 s session whose wall clock jumps +1 h after 10 s (NTP, a mis-set clock): the real
    ledger, with the clocks injected, records it; the report sees 49 s, not 3649 s."""
    mono, wall = [500.0], [1_800_000_000.0]

    def tick(seconds: float, step: float = 0.0) -> None:
        mono[0] += seconds
        wall[0] += seconds + step

    led = Ledger(tmp_path / "run", session="s1", wall=lambda: wall[0], clock=lambda: mono[0])
    led.append("session_start", started=wall[0], price_per_hour=3.6, on_demand_price_per_hour=7.2)
    tick(4.0)
    led.append("restore", step=0, seconds=1.0, startup_s=3.0)
    tick(10.0, step=3600.0)  # the clock step
    led.append("checkpoint", step=10, blocked_s=0.5, productive_s=10.0)
    tick(35.0)
    led.append("finish", step=40, blocked_s=0.5, productive_s=44.0)
    assert led.close()
    r = report(read_events(tmp_path / "run" / LEDGER_DIR / LEDGER_FILE))
    assert r.wall_s == pytest.approx(49.0) and r.downtime_s == pytest.approx(0.0)
    assert r.goodput == pytest.approx(44.0 / 49.0)
    assert r.cost.cost_so_far == pytest.approx(49.0 / 3600 * 3.6)
