"""trainer.observe.sinks.trackers against the real trackers: W&B (``wandb``, offline) and MLflow
(``mlflow-skinny``, its file store), each continuing one tracker run across sessions without
sending a step twice, read back from what the tracker itself recorded.

W&B offline sends nothing anywhere: each process writes its records to a run directory of its
own (``offline-run-TIME-ID``, all with the run's id: the fragments ``wandb sync`` uploads as one
run, in order of start), read back here with ``wandb leet inspect --json``, W&B's reader of its
transaction log. MLflow's file store (a ``file:`` URI, which MLflow 3 opens only with
``MLFLOW_ALLOW_FILE_STORE=true``) is read back with ``MlflowClient``.

A session here is an in-process ``run``. Where a session leaves its W&B run open (a preemption),
the end of its process is W&B's exit hook, ``wandb.teardown(exit_code)`` (what W&B registers with
``atexit``): it ends the run with the process's exit status and stops W&B's service process.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

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

WANDB_CLI = Path(sys.executable).with_name("wandb")
FIGURES = {"train/loss", "lr", "throughput/steps_per_s", "throughput/samples_per_s"}


def _cfg(run_dir: Path, **kw: object) -> RunConfig:
    return RunConfig(run_dir=run_dir, steps=24, task="tests.trainer.example_task:build", batch_size=4,
                     health_port=None, watch_metadata=False, checkpoint_every_steps=5, log_every_steps=1, **kw)


def _descendants(pid: int) -> list[str]:
    """The command lines of every live process below ``pid``."""
    parent: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            parent[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], {pid}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier}
        for p in frontier:
            try:
                found.append(Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode())
            except OSError:
                pass
    return found


@pytest.fixture
def wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The real ``wandb``, offline, with every file it writes under tmp_path and no account; its
    service process is gone at the end."""
    for var in ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_ENTITY", "WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_RESUME",
                "WANDB_NAME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    # A session's end waits at most CLOSE_S for the tracker; W&B's first init takes seconds on a
    # loaded machine, and what is under test is what reaches the run, not how fast.
    monkeypatch.setattr(trackers, "CLOSE_S", 120.0)
    # W&B copies the process's console into the run by wrapping sys.stdout and sys.stderr; the
    # exit hook run in this process (a session's end) would leave the wrappers of a run it ended
    # writing to a service that is gone.
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    for var in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    import wandb

    yield wandb
    wandb.teardown()
    assert not [c for c in _descendants(os.getpid()) if "wandb" in c]


@pytest.fixture
def mlflow_uri(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A real MLflow file store under tmp_path."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return (tmp_path / "mlruns").as_uri()


def wandb_fragments(*wandb_parents: Path) -> list[dict[str, Any]]:
    """Every W&B offline run directory under ``PARENT/wandb``, in order of start: its run id,
    project, entity, the history's steps in order with their keys, and its exit code (None
    while it has none), as ``wandb leet inspect --json`` reads them."""
    dirs = [d for parent in wandb_parents for d in sorted((parent / "wandb").glob("offline-run-*"))]
    readers = [subprocess.Popen([str(WANDB_CLI), "leet", "inspect", "--json", str(d)], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for d in dirs]
    out = []
    for reader in readers:
        text, err = reader.communicate(timeout=120)
        assert reader.returncode == 0, err
        records = [json.loads(line) for line in text.splitlines() if line.strip()]
        (started,) = [r["run"] for r in records if r["type"] == "run"]
        exits = [r["exit"].get("exit_code", 0) for r in records if r["type"] == "exit"]
        out.append({"start": started["start_time"], "run_id": started["run_id"], "project": started["project"],
                    "entity": started.get("entity"), "exit_code": exits[-1] if exits else None,
                    "history": [(int(r["history"]["step"]["num"]),
                                 {k for k in r["history"]["item"] if not k.startswith("_")})
                                for r in records if r["type"] == "history"]})
    return sorted(out, key=lambda f: f["start"])


def mlflow_points(uri: str, run_id: str) -> list[tuple[int, str]]:
    """Every (step, key) point the MLflow run holds, duplicates kept, by step."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    keys = client.get_run(run_id).data.metrics
    return sorted((m.step, key) for key in keys for m in client.get_metric_history(run_id, key))


def _state(run_dir: Path, name: str) -> dict[str, Any]:
    return json.loads((run_dir / "trackers" / f"{name}.json").read_text())


def _paused_preempted_finished(run_dir: Path, sinks: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                               after: Callable[[int, int], None]) -> int:
    """Three sessions of one run: paused at step 10, preempted by a real SIGTERM four steps
    later, resumed to its end (``after(session, exit_status)`` after each); the step the
    preempted session saved."""
    example_task.FETCHES[0] = 0
    assert run(_cfg(run_dir, sinks=sinks, stop_at_step=10)).code == 75
    after(1, 75)
    # 4 samples a step: the 14th fetch is in the session's 4th step, which completes and is saved.
    monkeypatch.setenv("SIGTERM_AT_FETCH", "14")
    example_task.FETCHES[0] = 0
    out = run(_cfg(run_dir, sinks=sinks))
    assert (out.code, out.steps_run) == (75, 4)
    after(2, 75)
    monkeypatch.delenv("SIGTERM_AT_FETCH")
    assert run(_cfg(run_dir, sinks=sinks)).code == 0
    after(3, 0)
    return 10 + out.steps_run


def test_a_paused_and_preempted_run_continues_one_wandb_run_with_one_point_per_step(
        tmp_path: Path, wandb: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = tmp_path / "run"
    sent: dict[int, int] = {}

    def after(session: int, status: int) -> None:
        if session == 2:  # the preempted session left its run open: its process's exit hook ends it
            wandb.teardown(exit_code=status)
        sent[session] = _state(run_dir, "wandb")["last_step"]

    saved = _paused_preempted_finished(run_dir, {"wandb": {"project": "demo", "entity": "team"}}, monkeypatch,
                                       after)

    paused, preempted, resumed = wandb_fragments(run_dir / "trackers")  # one fragment a process
    run_id = _state(run_dir, "wandb")["run_id"]
    assert {f["run_id"] for f in (paused, preempted, resumed)} == {run_id}
    assert (paused["project"], paused["entity"]) == ("demo", "team")
    # The sink ended the paused run and the finished one (the exit hook would have said 75); the
    # preempted session's run was left to W&B's exit hook.
    assert (paused["exit_code"], preempted["exit_code"], resumed["exit_code"]) == (1, 75, 0)
    assert all(keys >= FIGURES for f in (paused, preempted, resumed) for _, keys in f["history"])
    # Steps go up across the fragments, one point each; the preempted session's unsent points
    # (after the newest step it had sent, up to its emergency save) are the only gap.
    assert [s for s, _ in paused["history"]] == list(range(1, 11)) and sent[1] == 10
    assert [s for s, _ in preempted["history"]] == list(range(11, sent[2] + 1)) and sent[2] <= saved == 14
    assert [s for s, _ in resumed["history"]] == list(range(saved + 1, 25)) and sent[3] == 24


def test_a_paused_and_preempted_run_continues_one_mlflow_run_with_one_point_per_step(
        tmp_path: Path, mlflow_uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_uri)
    run_dir = tmp_path / "run"
    sent: dict[int, int] = {}
    statuses: dict[int, str] = {}

    def after(session: int, status: int) -> None:  # a process's exit does nothing to an MLflow run
        state = _state(run_dir, "mlflow")
        sent[session] = state["last_step"]
        statuses[session] = client.get_run(state["run_id"]).info.status

    saved = _paused_preempted_finished(run_dir, {"mlflow": {"experiment": "demo", "tracking_uri": mlflow_uri}},
                                       monkeypatch, after)

    (experiment,) = [e for e in client.search_experiments() if e.name == "demo"]
    (only,) = client.search_runs([experiment.experiment_id])
    assert only.info.run_id == _state(run_dir, "mlflow")["run_id"]
    # Paused and preempted: ended, not finished (after a notice, with the time the save left).
    assert statuses == {1: "KILLED", 2: "KILLED", 3: "FINISHED"}
    points = mlflow_points(mlflow_uri, only.info.run_id)
    assert len(points) == len(set(points))
    steps = sorted({s for s, key in points if key == "train/loss"})
    assert steps == [*range(1, sent[2] + 1), *range(saved + 1, 25)] and 10 <= sent[2] <= saved == 14
    assert all({key for s, key in points if s == step} >= FIGURES for step in steps)


def test_a_missing_tracker_package_is_bad_input_naming_the_table(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` fails, as where it is not installed
    out = run(_cfg(tmp_path / "run", sinks={"wandb": {"project": "demo"}}))
    assert out.code == 2
    assert "sinks.wandb: the wandb package is not installed" in out.reason
    assert not (tmp_path / "run" / "trackers").exists()


def test_a_tracking_uri_mlflow_cannot_open_is_bad_input_naming_the_field(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # MLflow 3 refuses its file store unless asked for it: every session would crash at start.
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    uri = (tmp_path / "mlruns").as_uri()
    out = run(_cfg(tmp_path / "run", sinks={"mlflow": {"experiment": "demo", "tracking_uri": uri}}))
    assert out.code == 2
    assert out.reason.startswith(f"sinks.mlflow.tracking_uri: MLflow 3.17.2 cannot use {uri} here: ")
    assert "MLFLOW_ALLOW_FILE_STORE" in out.reason
    assert not (tmp_path / "run" / "trackers").exists()


class _Sessions:
    """Sessions of the sink alone, driven by the loop's own events, on one run dir and bucket."""

    def __init__(self, tmp_path: Path, tracker_for: Callable[[SinkContext], Any]) -> None:
        self.tracker_for = tracker_for
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
        tmp_path: Path, mlflow_uri: str) -> None:
    """On MLflow, which keeps every point it is sent, a step sent twice is there twice (W&B online
    drops a point below its run's step; W&B offline keeps no step across processes)."""
    import mlflow

    settings = {"experiment": "demo", "tracking_uri": mlflow_uri, "name": None}
    s = _Sessions(tmp_path, lambda ctx: trackers.Mlflow(mlflow, settings, ctx))
    s.session(tmp_path / "disk", 0, range(1, 13))   # crashed after step 12: the checkpoint is at 10
    s.session(tmp_path / "disk", 10, range(11, 16))  # 11, 12 again: not sent; 13.. are
    s.session(tmp_path / "new-disk", 15, range(16, 19), finished=True)  # the disk lost: the bucket's state
    state = json.loads(s.bucket.get_bytes("trackers/t.json"))
    assert state["last_step"] == 18 and _state(tmp_path / "disk", "t")["run_id"] == state["run_id"]
    points = mlflow_points(mlflow_uri, state["run_id"])
    assert [step for step, key in points if key == "train/loss"] == list(range(1, 19))
    assert [step for step, key in points if key == "eval/loss"] == [5, 10, 15]
    assert len(points) == len(set(points))
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_uri)
    assert [r.info.run_id for r in client.search_runs([client.get_experiment_by_name("demo").experiment_id])] \
        == [state["run_id"]]
    assert client.get_run(state["run_id"]).info.status == "FINISHED"


def test_a_notice_during_the_last_step_ends_the_mlflow_run_finished(tmp_path: Path, mlflow_uri: str) -> None:
    """The emergency save of the last step completes the run (exit 0): its tracker run is finished,
    not left running nor killed, though the notice stopped the sink before ``Finished``."""
    import mlflow
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "run"
    ctx = SinkContext(cfg=RunConfig(run_dir=run_dir, steps=3, task="x:y"), run_dir=run_dir, session="s", rank=0,
                      is_main=True, is_node_leader=True, log=logging.getLogger("test"), settings={})
    sink = trackers.TrackerSink("t", trackers.Mlflow(mlflow, {"experiment": "demo", "tracking_uri": mlflow_uri,
                                                              "name": None}, ctx), ctx)
    sink.handle(ev.Restored(step=0, seconds=0.0, world_size=1, startup_s=0.0))
    window = {"loss": 1.0, "lr": 0.1, "steps_per_s": 2.0, "samples_per_s": 8.0}
    for s in (1, 2, 3):
        sink.handle(ev.Step(step=s, total=3, loss=1.0, lr=0.1, window=window))
    sink.handle(ev.Notice(reason="SIGTERM", step=3))
    sink.handle(ev.Finished(step=3, blocked_s=0.0, productive_s=1.0))
    assert sink.close(timeout=30)
    run_id = _state(run_dir, "t")["run_id"]
    assert MlflowClient(tracking_uri=mlflow_uri).get_run(run_id).info.status == "FINISHED"
