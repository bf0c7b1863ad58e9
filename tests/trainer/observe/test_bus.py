"""trainer.observe.bus, .events and .sinks: one event, every sink; the ledger's records unchanged;
a sink that fails stops nothing; a sink is a module of the registry."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from trainer.observe import events as ev
from trainer.observe.bus import BaseSink, Bus, SinkContext
from trainer.observe.health import Health
from trainer.observe.ledger import LEDGER_DIR, LEDGER_FILE, Ledger, read_events
from trainer.observe.sinks import build, discover, register, validate
from trainer.observe.sinks.ledger import LedgerSink


class Recorder(BaseSink):
    name = "recorder"

    def __init__(self) -> None:
        self.got: list[ev.Event] = []

    def handle(self, event: ev.Event) -> None:
        self.got.append(event)


class Broken(BaseSink):
    name = "broken"

    def handle(self, event: ev.Event) -> None:
        raise RuntimeError("this sink is down")


def test_every_sink_gets_each_event_once_and_a_broken_one_stops_nothing(caplog: pytest.LogCaptureFixture) -> None:
    a, b = Recorder(), Recorder()
    bus = Bus([a, Broken(), b])
    for step in (1, 2, 3, 4):
        bus.emit(ev.Progress(step, float(step)))
    assert [e.step for e in a.got] == [e.step for e in b.got] == [1, 2, 3, 4]
    # Counted, logged at the 1st, 2nd and 4th failure: bounded noise, never an exception.
    assert [r.getMessage().split(" count=")[1].split()[0] for r in caplog.records if "sink_error" in r.getMessage()] \
        == ["1", "2", "4"]


# The ledger's records as the loop wrote them before the seam existed: same event, same fields.
LEDGER_RECORDS = [
    (ev.Restored(12, 1.5, 2, 3.25, tier="gcs", path="gs://b/p/step-12"),
     {"event": "restore", "step": 12, "seconds": 1.5, "world_size": 2, "startup_s": 3.25}),
    (ev.CheckpointSaved(10, 0.01, 4.0), {"event": "checkpoint_save", "step": 10, "blocked_s": 0.01, "productive_s": 4.0}),
    (ev.CheckpointDurable("gcs", 10), {"event": "durable", "tier": "gcs", "step": 10}),
    (ev.Progress(11, 5.0), {"event": "progress", "step": 11, "productive_s": 5.0}),
    (ev.Notice("SIGTERM", 13), {"event": "preemption_notice", "reason": "SIGTERM", "step": 13}),
    (ev.Notice("SIGTERM"), {"event": "preemption_notice", "reason": "SIGTERM"}),
    (ev.Preempted(13, 6.0, 2.5, ok={"persistent": True, "gcs": False, "local": True}, seconds=2.0, detail="x"),
     {"event": "preempted", "step": 13, "productive_s": 6.0, "blocked_s": 2.5, "persistent_ok": True,
      "gcs_ok": False, "local_ok": True}),
    (ev.Preempted(detail="notice during start-up (SIGTERM)"), {"event": "preempted", "blocked_s": 0.0}),
    (ev.Paused(20, 1.0, 9.0), {"event": "paused", "step": 20, "blocked_s": 1.0, "productive_s": 9.0}),
    (ev.Finished(40, 1.0, 19.0, again=True), {"event": "finished", "step": 40, "blocked_s": 1.0, "productive_s": 19.0}),
    (ev.Failed("bad_input", "x" * 600, trace="tb"), {"event": "failed", "reason": "bad_input", "detail": "x" * 500}),
    (ev.TierFailing("gcs", 1.0e9, 3, "Forbidden: 403"),
     {"event": "tier_failing", "tier": "gcs", "since": 1.0e9, "failures": 3, "error": "Forbidden: 403"}),
    (ev.TierOk("gcs"), {"event": "tier_ok", "tier": "gcs"}),
    (ev.StepsChanged(30, 40, 60), {"event": "steps_changed", "step": 30, "from": 40, "to": 60}),
    (ev.CapacityWait("us-central1-a", "SPOT", 1.7e9, waited_s=30.0),
     {"event": "capacity_wait", "zone": "us-central1-a", "provisioning": "SPOT", "boot_time": 1.7e9}),
    (ev.Stalled(7, 601.0), {"event": "stalled", "step": 7, "seconds": 601.0}),
    (ev.DataWorkersDied(5, 24, "1234:SIGKILL", 1, True),
     {"event": "data_workers_died", "step": 5, "consumed": 24, "died": "1234:SIGKILL", "deaths": 1,
      "restarted": True}),
]


def test_the_ledger_sink_records_each_event_with_the_ledgers_own_fields(tmp_path: Path) -> None:
    bus = Bus([LedgerSink(Ledger(tmp_path, session="s"))])
    for event, _ in LEDGER_RECORDS:
        bus.emit(event)
    bus.emit(ev.Step(1, 10, 2.0, 1e-3))  # not a ledger event
    bus.emit(ev.Eval(1, {"loss": 1.0}, 2, 0.1))
    bus.close(0.0)
    got = [{k: v for k, v in e.items() if k not in ("session", "seq", "t", "e")}
           for e in read_events(tmp_path / LEDGER_DIR / LEDGER_FILE)]
    assert got == [want for _, want in LEDGER_RECORDS]


def test_a_stall_is_told_once_by_the_watch_and_again_only_after_a_step(tmp_path: Path) -> None:
    now = [0.0]
    h = Health(stall_timeout_s=10.0, clock=lambda: now[0])
    told: list[tuple[int, float]] = []
    h.on_stalled = lambda step, seconds: told.append((step, seconds))
    h.beat(5)
    now[0] = 9.0
    h.check()
    assert told == [] and h.answer() == "ok"
    now[0] = 11.0
    h.check()
    h.check()
    assert told == [(5, 11.0)] and h.answer() == "stalled"
    h.beat(6)
    now[0] = 22.5
    h.check()
    assert told == [(5, 11.0), (6, 11.5)]


def test_the_registry_finds_the_sink_modules_and_checks_their_tables() -> None:
    sinks = discover()
    assert list(sinks)[:3] == ["log", "ledger", "tensorboard"] and "jsonl" in sinks
    assert validate({"jsonl": {"path": "/tmp/e.jsonl"}})["jsonl"]["every_rank"] is False
    with pytest.raises(ValueError, match="jsonl.path: Field required"):
        validate({"jsonl": {}})
    with pytest.raises(ValueError, match="nosuch: no such sink with settings; allowed: jsonl"):
        validate({"nosuch": {}})


def test_a_sink_is_one_registration_away_and_runs_where_its_factory_says(tmp_path: Path) -> None:
    made: list[SinkContext] = []

    @register("test-only-recorder", default=True)
    def make(ctx: SinkContext) -> Recorder | None:
        made.append(ctx)
        return Recorder() if ctx.is_main else None

    try:
        ctx = SinkContext(cfg=None, run_dir=tmp_path, session="s", rank=1, is_main=False, is_node_leader=False,
                          log=logging.getLogger("t"))
        assert [s.name for s in build(ctx, {}, only=("test-only-recorder",))] == []
        main = SinkContext(cfg=None, run_dir=tmp_path, session="s", rank=0, is_main=True, is_node_leader=True,
                           log=logging.getLogger("t"))
        assert [s.name for s in build(main, {}, only=("test-only-recorder",))] == ["recorder"]
        assert [c.rank for c in made] == [1, 0]
    finally:
        from trainer.observe.sinks import SINKS

        SINKS.pop("test-only-recorder")


def test_the_jsonl_sink_writes_every_event_as_a_line(tmp_path: Path) -> None:
    from trainer.observe.sinks.jsonl import make

    ctx = SinkContext(cfg=None, run_dir=tmp_path, session="s", rank=0, is_main=True, is_node_leader=True,
                      log=logging.getLogger("t"), settings={"path": str(tmp_path / "e" / "events.jsonl")})
    bus = Bus([make(ctx)])
    bus.emit(ev.Step(3, 10, 2.5, 1e-3, {"acc": 0.5}))
    bus.emit(ev.Finished(10, 1.0, 9.0))
    bus.close(0.0)
    lines = [json.loads(x) for x in (tmp_path / "e" / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["step"], e["rank"]) for e in lines] == [("Step", 3, 0), ("finished", 10, 0)]
    assert lines[0]["metrics"] == {"acc": 0.5}
