"""trainer.observe.sinks.trackers: W&B and MLflow sinks that continue one tracker run across
sessions without sending a step twice.

Neither ``wandb`` nor ``mlflow`` is a dependency of this repository (nor installed here), so the
tests put an in-test stand-in module under each name: it keeps the real API's signatures
(``wandb.init(..., id=, resume=)``, ``Run.log(data, step=)``, ``Run.finish(exit_code=)``,
``wandb.util.generate_id``; ``MlflowClient.create_run/update_run/log_batch/set_terminated``,
``mlflow.entities.Metric``) and, like W&B, refuses a step lower than the run's current one.
"""
from __future__ import annotations

import json
import logging
import sys
import types
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.trainer import example_task
from tests.trainer.support import restore_logging  # noqa: F401  (fixture)
from trainer.checkpoint.stores import DirStore
from trainer.config import RunConfig
from trainer.observe import events as ev
from trainer.observe.bus import SinkContext
from trainer.observe.sinks import trackers
from trainer.train import run

pytestmark = pytest.mark.usefixtures("restore_logging")


class WandbServer:
    """What W&B keeps: runs by id, each with its points (step, key) and its state."""

    def __init__(self) -> None:
        self.runs: dict[str, dict[str, Any]] = {}
        self.inits: list[dict[str, Any]] = []

    def module(self) -> types.ModuleType:
        server = self

        class Run:
            def __init__(self, run_id: str) -> None:
                self.id = run_id
                self.rec = server.runs.setdefault(run_id, {"points": [], "state": "running", "step": 0})
                self.rec["state"] = "running"

            def log(self, data: dict[str, Any], step: int | None = None, commit: bool | None = None) -> None:
                if step is not None and step < self.rec["step"]:
                    return  # W&B drops it with a warning: steps only go up
                self.rec["step"] = step if step is not None else self.rec["step"] + 1
                self.rec["points"] += [(self.rec["step"], k) for k in data]

            def finish(self, exit_code: int | None = None, quiet: bool | None = None) -> None:
                self.rec["state"] = "finished" if not exit_code else "failed"

        def init(project: str | None = None, entity: str | None = None, name: str | None = None,
                 id: str | None = None, resume: bool | str | None = None, dir: str | None = None,  # noqa: A002
                 config: dict | None = None, **kwargs: Any) -> Run:
            server.inits.append({"project": project, "entity": entity, "id": id, "resume": resume, "dir": dir})
            if id in server.runs and resume not in ("allow", "must", True):
                raise RuntimeError(f"run {id} exists: resume it or use another id")
            return Run(id or uuid.uuid4().hex[:8])

        wandb = types.ModuleType("wandb")
        wandb.init = init  # type: ignore[attr-defined]
        wandb.util = types.SimpleNamespace(generate_id=lambda length=8: uuid.uuid4().hex[:length])  # type: ignore[attr-defined]
        return wandb


@pytest.fixture
def wandb(monkeypatch: pytest.MonkeyPatch) -> WandbServer:
    server = WandbServer()
    monkeypatch.setitem(sys.modules, "wandb", server.module())
    return server


def _cfg(run_dir: Path, **kw: object) -> RunConfig:
    return RunConfig(run_dir=run_dir, steps=24, task="tests.trainer.example_task:build", batch_size=4,
                     health_port=None, watch_metadata=False, checkpoint_every_steps=5, log_every_steps=1, **kw)


def test_a_paused_run_continues_the_same_wandb_run_with_one_point_per_step(tmp_path: Path, wandb: WandbServer) -> None:
    sinks = {"wandb": {"project": "demo", "entity": "team"}}
    example_task.FETCHES[0] = 0
    assert run(_cfg(tmp_path / "run", sinks=sinks, stop_at_step=10)).code == 75
    assert run(_cfg(tmp_path / "run", sinks=sinks)).code == 0

    assert len(wandb.inits) == 2 and len(wandb.runs) == 1
    first, second = wandb.inits
    assert first["id"] == second["id"] and second["resume"] == first["resume"] == "allow"
    assert (first["project"], first["entity"]) == ("demo", "team")
    rec = wandb.runs[first["id"]]
    losses = [step for step, key in rec["points"] if key == "train/loss"]
    assert losses == list(range(1, 25)) and rec["state"] == "finished"
    assert len(rec["points"]) == len(set(rec["points"]))
    state = json.loads((tmp_path / "run" / "trackers" / "wandb.json").read_text())
    assert state == {"run_id": first["id"], "last_step": 24}


def test_a_missing_tracker_package_is_bad_input_naming_the_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` fails, as where it is not installed
    out = run(_cfg(tmp_path / "run", sinks={"wandb": {"project": "demo"}}))
    assert out.code == 2
    assert "sinks.wandb: the wandb package is not installed" in out.reason
    assert not (tmp_path / "run" / "trackers").exists()


class _Sessions:
    """Sessions of the sink alone, driven by the loop's own events, on one run dir and bucket."""

    def __init__(self, tmp_path: Path, tracker_for: Any) -> None:
        self.tmp_path, self.tracker_for = tmp_path, tracker_for
        self.bucket = DirStore(tmp_path / "bucket", "gcs")
        (tmp_path / "bucket").mkdir()

    def session(self, run_dir: Path, restored: int, steps: range, *, finished: bool = False) -> None:
        cfg = RunConfig(run_dir=run_dir, steps=100, task="x:y")
        ctx = SinkContext(cfg=cfg, run_dir=run_dir, session="s", rank=0, is_main=True, is_node_leader=True,
                          log=logging.getLogger("test"), settings={})
        sink = trackers.TrackerSink("t", self.tracker_for(ctx), ctx)
        sink.mirror_to(self.bucket)
        sink.handle(ev.Restored(step=restored, seconds=0.0, world_size=1, startup_s=0.0))
        for s in steps:
            window = {"loss": 1.0 / s, "lr": 0.1, "steps_per_s": 2.0, "samples_per_s": 8.0}
            sink.handle(ev.Step(step=s, total=100, loss=1.0 / s, lr=0.1, window=window))
            if s % 5 == 0:
                sink.handle(ev.Eval(step=s, values={"loss": 0.5}, batches=1, seconds=0.1))
        if finished:
            sink.handle(ev.Finished(step=steps[-1], blocked_s=0.0, productive_s=1.0))
        assert sink.close(timeout=30)


def test_steps_trained_again_after_a_crash_are_not_sent_twice_and_a_lost_disk_uses_the_mirror(
        tmp_path: Path, wandb: WandbServer) -> None:
    import wandb as stand_in

    s = _Sessions(tmp_path, lambda ctx: trackers.Wandb(stand_in, {"project": "p", "entity": None, "name": None}, ctx))
    s.session(tmp_path / "disk", 0, range(1, 13))   # crashed after step 12: the checkpoint is at 10
    s.session(tmp_path / "disk", 10, range(11, 16))  # 11, 12 again: not sent; 13.. are
    s.session(tmp_path / "new-disk", 15, range(16, 19), finished=True)  # the disk lost: the bucket's state
    (rec,) = wandb.runs.values()
    assert [step for step, key in rec["points"] if key == "train/loss"] == list(range(1, 19))
    assert [step for step, key in rec["points"] if key == "eval/loss"] == [5, 10, 15]
    assert len(rec["points"]) == len(set(rec["points"])) and rec["state"] == "finished"
    assert len({i["id"] for i in wandb.inits}) == 1
    assert json.loads(s.bucket.get_bytes("trackers/t.json"))["last_step"] == 18


class MlflowServer:
    """What an MLflow tracking server keeps: experiments, runs, metrics (key, step) and statuses."""

    def __init__(self) -> None:
        self.experiments: dict[str, str] = {}
        self.runs: dict[str, dict[str, Any]] = {}

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        server = self

        class Metric:
            def __init__(self, key: str, value: float, timestamp: int, step: int, run_id: str | None = None) -> None:
                self.key, self.value, self.timestamp, self.step = key, value, timestamp, step

        class MlflowClient:
            def __init__(self, tracking_uri: str | None = None, registry_uri: str | None = None) -> None:
                self.uri = tracking_uri

            def get_experiment_by_name(self, name: str) -> Any:
                eid = server.experiments.get(name)
                return None if eid is None else types.SimpleNamespace(experiment_id=eid, name=name)

            def create_experiment(self, name: str, artifact_location: str | None = None,
                                  tags: dict | None = None) -> str:
                server.experiments[name] = str(len(server.experiments) + 1)
                return server.experiments[name]

            def create_run(self, experiment_id: str, start_time: int | None = None, tags: dict | None = None,
                           run_name: str | None = None) -> Any:
                rid = uuid.uuid4().hex
                server.runs[rid] = {"experiment": experiment_id, "status": "RUNNING", "metrics": [], "name": run_name}
                return types.SimpleNamespace(info=types.SimpleNamespace(run_id=rid))

            def update_run(self, run_id: str, status: str | None = None, name: str | None = None) -> None:
                if status is not None:
                    server.runs[run_id]["status"] = status

            def log_batch(self, run_id: str, metrics: Any = (), params: Any = (), tags: Any = (),
                          synchronous: bool | None = None) -> None:
                if server.runs[run_id]["status"] != "RUNNING":
                    raise RuntimeError(f"run {run_id} is {server.runs[run_id]['status']}")
                server.runs[run_id]["metrics"] += [(m.step, m.key) for m in metrics]

            def set_terminated(self, run_id: str, status: str | None = None, end_time: int | None = None) -> None:
                server.runs[run_id]["status"] = status or "FINISHED"

        mlflow = types.ModuleType("mlflow")
        tracking = types.ModuleType("mlflow.tracking")
        tracking.MlflowClient = MlflowClient  # type: ignore[attr-defined]
        entities = types.ModuleType("mlflow.entities")
        entities.Metric = Metric  # type: ignore[attr-defined]
        mlflow.tracking, mlflow.entities = tracking, entities  # type: ignore[attr-defined]
        for name, module in (("mlflow", mlflow), ("mlflow.tracking", tracking), ("mlflow.entities", entities)):
            monkeypatch.setitem(sys.modules, name, module)


def test_a_paused_run_continues_the_same_mlflow_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server = MlflowServer()
    server.install(monkeypatch)
    sinks = {"mlflow": {"experiment": "demo", "tracking_uri": "http://127.0.0.1:5000"}}
    example_task.FETCHES[0] = 0
    assert run(_cfg(tmp_path / "run", sinks=sinks, stop_at_step=10)).code == 75
    (rid, rec), = server.runs.items()
    assert rec["status"] == "KILLED"  # paused, not finished
    assert run(_cfg(tmp_path / "run", sinks=sinks)).code == 0
    assert list(server.runs) == [rid] and server.experiments == {"demo": "1"}
    assert [step for step, key in rec["metrics"] if key == "train/loss"] == list(range(1, 25))
    assert len(rec["metrics"]) == len(set(rec["metrics"])) and rec["status"] == "FINISHED"
