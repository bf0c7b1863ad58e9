"""trainer.observe.sinks.monitoring against the loopback Monitoring API (drill.fake_observability),
which refuses what Google refuses: the points it writes are accepted, at most one per series and
interval; a Monitoring that fails never slows, stops or changes the run."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

from drill.fake_observability import FakeObservability
from drill.metadata_server import MetadataServer
from stacks.run_metrics import CUSTOM_METRICS
from tests.trainer import example_task
from tests.trainer.support import restore_logging  # noqa: F401  (fixture)
from trainer.config import RunConfig, StatusConfig
from trainer.observe import events as ev
from trainer.observe.sinks import monitoring
from trainer.status import collect
from trainer.train import run

PROJECT = "my-project-123456"
TABLE = {"project": PROJECT, "experiment": "demo", "run": "runs/demo"}


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def apis(monkeypatch: pytest.MonkeyPatch):
    """The VM's metadata server (its token) and Cloud Monitoring, both on loopback."""
    with MetadataServer(project_id=PROJECT) as md, FakeObservability(PROJECT, token=md.token) as obs:
        monkeypatch.setenv("GCE_METADATA_HOST", md.host)
        monkeypatch.setenv("SPOTTRAIN_MONITORING_API", obs.monitoring_api)
        yield obs


def _points(obs: FakeObservability) -> dict[str, list[float]]:
    return {k[0].removeprefix(monitoring.PREFIX): [v for _, v in pts] for k, pts in obs.series.items()}


def test_the_series_are_the_ones_the_dashboard_charts() -> None:
    assert {monitoring.PREFIX + m for m in monitoring.METRICS} == set(CUSTOM_METRICS)


def test_each_series_gets_at_most_one_point_an_interval_and_google_takes_every_one(apis: FakeObservability) -> None:
    apis.clock = clock = Clock(1.7e9)
    sink = monitoring.MonitoringSink(TABLE, logging.getLogger("t"), clock=clock, start=False)
    sink.handle(ev.Step(1, 100, 2.0, 1e-3))
    sink.handle(ev.Goodput(1, 0.5, 0.01, 0.02))
    sink.handle(ev.Step(2, 100, 2.0, 1e-3))   # only the newest value of an interval is sent
    assert sink.send_due()
    sink.handle(ev.Step(3, 100, 2.0, 1e-3))
    clock.t += 30                             # within the minute: nothing goes out
    assert sink.send_due()
    calls = len(apis.calls)
    sink.handle(ev.Goodput(3, 0.75, 0.02, None))  # no on-demand price: that series gets no point
    clock.t += 30
    assert sink.send_due()
    clock.t += 60
    assert sink.send_due()                    # nothing new: no request at all
    assert len(apis.calls) == calls + 1 and all(status == 200 for _, _, status in apis.calls)
    assert _points(apis) == {"step": [2.0, 3.0], "goodput": [0.5, 0.75], "cost_usd": [0.01, 0.02],
                             "on_demand_cost_usd": [0.02]}
    key = next(iter(apis.series))
    assert '"experiment": "demo"' in key[1] and '"run": "runs/demo"' in key[1] and '"type": "global"' in key[2]
    assert apis.descriptors[monitoring.PREFIX + "step"] == ("GAUGE", "DOUBLE")


def test_a_failing_monitoring_is_logged_once_per_doubling_and_the_points_dropped(
        apis: FakeObservability, caplog: pytest.LogCaptureFixture) -> None:
    apis.clock = clock = Clock(1.7e9)
    apis.fail("POST", "/timeSeries$", 503, times=None)
    sink = monitoring.MonitoringSink(TABLE, logging.getLogger("t"), clock=clock, start=False)
    for step in range(1, 9):
        sink.handle(ev.Step(step, 100, 2.0, 1e-3))
        assert not sink.send_due()
        clock.t += 60
    counts = [r.getMessage().split(" count=")[1].split()[0] for r in caplog.records if "sink_error" in r.getMessage()]
    assert counts == ["1", "2", "4", "8"]
    apis.faults.clear()                       # Monitoring is back: the newest value goes out
    sink.handle(ev.Step(9, 100, 2.0, 1e-3))
    assert sink.send_due() and _points(apis) == {"step": [9.0]}


def test_a_notice_drops_what_is_unsent_and_close_returns_at_once(apis: FakeObservability) -> None:
    sink = monitoring.MonitoringSink(TABLE, logging.getLogger("t"))
    sink.handle(ev.Step(5, 100, 2.0, 1e-3))
    sink.handle(ev.Notice("SIGTERM", 5))
    assert sink.close(30.0)
    assert sink._thread is not None and not sink._thread.is_alive()
    assert apis.calls == [] and sink._values == {}


def test_bad_settings_name_the_field() -> None:
    from trainer.observe.sinks import validate

    with pytest.raises(ValueError, match=r"^monitoring\.every_s: "):
        validate({"monitoring": {**TABLE, "every_s": 1}})
    with pytest.raises(ValueError, match=r"^monitoring\.project: "):
        validate({"monitoring": {**TABLE, "project": "Not A Project"}})


# --- a real training run ------------------------------------------------------------------------
def _cfg(run_dir: Path, **kw: object) -> RunConfig:
    return RunConfig(run_dir=run_dir, steps=20, task="tests.trainer.example_task:build", batch_size=4,
                     health_port=None, watch_metadata=False, checkpoint_every_steps=7, progress_every_s=0.01,
                     price_per_hour=2.0, on_demand_price_per_hour=6.0, **kw)


@pytest.mark.usefixtures("restore_logging")
def test_a_training_run_writes_its_metrics_and_a_failing_monitoring_changes_nothing(
        tmp_path: Path, apis: FakeObservability, capsys: pytest.CaptureFixture) -> None:
    example_task.FETCHES[0] = 0
    assert run(_cfg(tmp_path / "plain")).code == 0
    reference = collect(StatusConfig(run_dir=tmp_path / "plain"))["model_digest"]

    example_task.FETCHES[0] = 0
    assert run(_cfg(tmp_path / "watched", sinks={"monitoring": TABLE})).code == 0
    assert collect(StatusConfig(run_dir=tmp_path / "watched"))["model_digest"] == reference
    assert apis.calls and all(status == 200 for _, _, status in apis.calls), apis.calls
    got = _points(apis)
    assert set(got) == set(monitoring.METRICS)
    assert got["step"][-1] == 20.0 and 0 < got["goodput"][-1] <= 1
    assert 0 < got["cost_usd"][-1] and 0 < got["on_demand_cost_usd"][-1]

    # Monitoring down for good: the same model, and the failure said (not once per point).
    apis.fail("POST", "/timeSeries$", 503, times=None)
    capsys.readouterr()
    example_task.FETCHES[0] = 0
    assert run(_cfg(tmp_path / "outage", sinks={"monitoring": TABLE})).code == 0
    assert collect(StatusConfig(run_dir=tmp_path / "outage"))["model_digest"] == reference
    err = capsys.readouterr().err
    assert "event=sink_error sink=monitoring what=timeSeries.create count=1 " in err
    assert err.count("sink=monitoring") == sum(1 for _, _, status in apis.calls if status == 503).bit_length()
