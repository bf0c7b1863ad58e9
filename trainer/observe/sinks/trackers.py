"""Experiment trackers as sinks (rank 0): Weights & Biases (``[sinks.wandb]``) and MLflow
(``[sinks.mlflow]``). The tracker's package is the user's dependency, not the trainer's: it is
imported when the sink is built, and a run whose config names a tracker that is not installed
stops at start (exit 2) saying so.

What they get: the figures TensorBoard gets (``train/loss``, ``lr``, ``throughput/...``, the
task's own ``train/NAME`` every ``log_every_steps``; ``eval/NAME``; ``goodput/goodput`` and
``goodput/cost_usd``), each at its optimizer step.

One tracker run per training run, across preemptions: the tracker run's id is kept in the run
dir (``trackers/NAME.json``, with the newest step sent) and mirrored to the bucket beside the
ledger, so a recreated VM, or one whose disk was lost, continues the same tracker run (W&B:
``wandb.init(id=..., resume="allow")``; MLflow: the same run, set running again). A session
that resumes from an older checkpoint than the tracker has seen trains some steps again: their
points are not sent twice (every step up to the newest step sent is skipped), so each curve
has one point per step, the first session's. The state file is written before the points go,
so a crash loses at most one window's points and never sends one twice; its bucket copy is
written at most every ``mirror_every_s`` and at the end (after losing the disk, points of that
last interval may be sent again).

How it stays out of the loop: ``handle`` queues; a thread of its own makes every tracker call.
A failing tracker drops its points (logged on the 1st, 2nd, 4th, ... failure), never stops the
run. A preemption notice stops the thread at once and drops what is queued (the window is the
emergency save's); once the save is over, the time it left (at most ``CLOSE_S``) ends the
tracker run as not finished (MLflow's; W&B's own exit hook ends its run with the exit status).
A normal end sends what is queued, for at most ``CLOSE_S``, and ends the tracker run.
"""
from __future__ import annotations

import json
import queue
import threading
import time
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

from trainer.observe.bus import BaseSink, SinkContext
from trainer.observe.events import Eval, Event, Finished, Goodput, Notice, Restored, Step
from trainer.observe.sinks import SinkUnavailable, register
from trainer.observe.sinks.tensorboard import scalars

STATE_DIR = "trackers"
#: How long ``close`` may spend sending what is queued at a normal end.
CLOSE_S = 10.0
#: Points waiting for a slow tracker; more are dropped (counted), never waited for.
QUEUE_MAX = 10_000


class Tracker(Protocol):
    """One tracker's calls, made one at a time on the sink's threads, never on the loop's."""

    #: Whether the tracker's own exit hook ends a run left open when the process exits (W&B's
    #: does, with the process's exit status); one that does not gets its run ended after a notice.
    exit_ends_run: bool

    def open(self, run_id: str | None) -> str:
        """Start or continue the tracker run ``run_id`` (None: a new one); its id."""

    def log(self, step: int, points: dict[str, float]) -> None: ...

    def finish(self, finished: bool) -> None: ...


class WandbSettings(BaseModel):
    """``[sinks.wandb]``: the W&B run's place (credentials: ``WANDB_API_KEY`` or ``wandb login``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    project: str = Field(min_length=1, max_length=128)
    """The W&B project."""
    entity: str | None = None
    """The W&B entity (user or team); None: the account's default."""
    name: str | None = None
    """The run's display name; None: W&B picks one."""
    mirror_every_s: float = Field(default=60.0, gt=0)
    """Seconds between two copies of the tracker state to the bucket."""


class MlflowSettings(BaseModel):
    """``[sinks.mlflow]``: the MLflow run's place."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    experiment: str = Field(min_length=1, max_length=500)
    """The MLflow experiment (created when missing)."""
    tracking_uri: str | None = None
    """The tracking server (``http://HOST:PORT``); None: MLflow's default (``MLFLOW_TRACKING_URI``, else
    ``sqlite:///mlflow.db`` in the working directory, which mlflow-skinny cannot open)."""
    name: str | None = None
    """The run's name; None: MLflow picks one."""
    mirror_every_s: float = Field(default=60.0, gt=0)
    """Seconds between two copies of the tracker state to the bucket."""


class Wandb:
    exit_ends_run = True

    def __init__(self, wandb: Any, settings: dict[str, Any], ctx: SinkContext) -> None:
        self.wandb, self.s, self.ctx = wandb, settings, ctx
        self.run: Any = None

    def open(self, run_id: str | None) -> str:
        d = self.ctx.run_dir / STATE_DIR
        d.mkdir(parents=True, exist_ok=True)
        self.run = self.wandb.init(project=self.s["project"], entity=self.s["entity"], name=self.s["name"],
                                   id=run_id, resume="allow", dir=str(d),
                                   config={"steps": self.ctx.cfg.steps, "task": self.ctx.cfg.task})
        return str(self.run.id)

    def log(self, step: int, points: dict[str, float]) -> None:
        self.run.log(points, step=step)

    def finish(self, finished: bool) -> None:
        self.run.finish(exit_code=0 if finished else 1)


class Mlflow:
    exit_ends_run = False

    def __init__(self, mlflow: Any, settings: dict[str, Any], ctx: SinkContext) -> None:
        from mlflow.tracking import MlflowClient

        self.mlflow, self.s = mlflow, settings
        try:
            self.client = MlflowClient(tracking_uri=settings["tracking_uri"])
        except Exception as e:  # noqa: BLE001 - it reaches nothing yet: a URI this MLflow cannot use
            # (a scheme it lacks, such as sqlite: in mlflow-skinny, or its file store, which MLflow 3
            # refuses without MLFLOW_ALLOW_FILE_STORE=true) is bad input, said once at start, not a
            # crash of every session.
            uri = settings["tracking_uri"] or "MLflow's default"
            raise SinkUnavailable(f"sinks.mlflow.tracking_uri: MLflow {getattr(mlflow, '__version__', '?')} cannot "
                                  f"use {uri} here: {' '.join(str(e).split())[:1000]}") from None
        self.run_id = ""

    def open(self, run_id: str | None) -> str:
        if run_id is not None:
            self.client.update_run(run_id, status="RUNNING")
            self.run_id = run_id
            return run_id
        exp = self.client.get_experiment_by_name(self.s["experiment"])
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(self.s["experiment"])
        self.run_id = self.client.create_run(exp_id, run_name=self.s["name"]).info.run_id
        return self.run_id

    def log(self, step: int, points: dict[str, float]) -> None:
        from mlflow.entities import Metric

        ms = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, ms, step) for k, v in points.items()])

    def finish(self, finished: bool) -> None:
        # Not finished: paused, preempted or failed; the next session sets it running again.
        self.client.set_terminated(self.run_id, status="FINISHED" if finished else "KILLED")


class TrackerSink(BaseSink):
    handles = (Restored, Step, Eval, Goodput, Finished, Notice)

    def __init__(self, name: str, tracker: Tracker, ctx: SinkContext, *, mirror_every_s: float = 60.0) -> None:
        self.name = name
        self.tracker = tracker
        self.ctx = ctx
        self.log = ctx.log.getChild(name)
        self.key = f"{STATE_DIR}/{name}.json"
        self.path = ctx.run_dir / self.key
        self.mirror_every_s = mirror_every_s
        self._store: Any = None
        self._mirrored_at = float("-inf")
        self.run_id: str | None = None
        self.last_step = -1          # the newest step sent, from every session
        self.finished = False
        self.failures = 0
        self._sent: set[int] = set()  # steps this session sent points at
        self._q: queue.Queue[tuple[str, Any] | None] = queue.Queue(maxsize=QUEUE_MAX)
        self.dropped = 0              # points a slow tracker left no room for
        self._stop = threading.Event()
        self._noticed = False         # a preemption notice stopped the thread
        self._opened = False          # the tracker run was started or continued
        self._thread: threading.Thread | None = None

    def mirror_to(self, store: Any) -> None:
        self._store = store

    # --- the loop's side: queue, nothing else -----------------------------------------------------
    def handle(self, ev: Event) -> None:
        if isinstance(ev, Finished):  # also after a notice: the tracker run ends finished
            self.finished = True
        if self._stop.is_set():
            return
        if isinstance(ev, Notice):
            self.flush(0.0)
        elif isinstance(ev, Restored):
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"{self.name}-sink", daemon=True)
                self._thread.start()
        elif not isinstance(ev, Finished):
            points = scalars(ev)
            if points:
                self._queue(ev.step, points)  # type: ignore[attr-defined]

    def _queue(self, step: int, points: dict[str, float]) -> None:
        try:
            self._q.put_nowait(("log", (step, points)))
        except queue.Full:
            self.dropped += 1

    # --- the thread's side ------------------------------------------------------------------------
    def _run(self) -> None:
        state = self._load()
        self.run_id, self.last_step = state.get("run_id"), int(state.get("last_step", -1))
        if not self._call("open", lambda: self._started(self.tracker.open(self.run_id))):
            self._stop.set()  # no tracker run: the points have nowhere to go (said once)
            return
        while not self._stop.is_set():
            item = self._q.get()
            if item is None or self._stop.is_set():
                break
            step, points = item[1]
            # An earlier session's steps are not sent again; this session may send several
            # points at one step (its figures, an evaluation, goodput).
            if step < self.last_step or (step == self.last_step and step not in self._sent):
                continue
            self._sent.add(step)
            if step > self.last_step:
                self.last_step = step
                self._save()
            self._call("log", lambda: self.tracker.log(step, points))
        if not self._stop.is_set():  # a normal end: the tracker run ends too
            self._call("finish", lambda: self.tracker.finish(self.finished))
            self._save(mirror=True)

    def _started(self, run_id: str) -> None:
        new = run_id != self.run_id
        self.run_id, self._opened = run_id, True
        self._save(mirror=True)
        self.log.info("event=tracker tracker=%s run_id=%s %s (points after step %d)", self.name, run_id,
                      "new" if new else "continued", self.last_step)

    def _call(self, what: str, fn: Any) -> bool:
        try:
            fn()
            return True
        except Exception as e:  # noqa: BLE001 - a tracker is never worth stopping the run for
            self._failed(what, e)
            return False

    def _failed(self, what: str, e: BaseException) -> None:
        self.failures += 1
        n = self.failures
        if n & (n - 1) == 0:  # the 1st, 2nd, 4th, ... failure
            self.log.warning("event=sink_error sink=%s what=%s count=%d error=%s (points dropped; training "
                             "goes on)", self.name, what, n, " ".join(str(e).split())[:300])

    def _load(self) -> dict[str, Any]:
        """The state in the run dir, else the bucket's copy; the newer of both by step."""
        found: list[dict[str, Any]] = []
        try:
            found.append(json.loads(self.path.read_bytes()))
        except (OSError, ValueError):
            pass
        if self._store is not None:
            try:
                found.append(json.loads(self._store.get_bytes(self.key)))
            except Exception:  # noqa: BLE001 - none yet, or the bucket unreachable: the run dir's
                pass
        found = [s for s in found if isinstance(s, dict) and isinstance(s.get("run_id"), str)
                 and isinstance(s.get("last_step", -1), int)]
        return max(found, key=lambda s: s.get("last_step", -1), default={})

    def _save(self, *, mirror: bool = False) -> None:
        data = json.dumps({"run_id": self.run_id, "last_step": self.last_step}, sort_keys=True).encode()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_bytes(data)
            tmp.replace(self.path)
        except OSError as e:
            self._failed("state", e)
        now = time.monotonic()
        if self._store is not None and (mirror or now - self._mirrored_at >= self.mirror_every_s):
            self._mirrored_at = now
            self._call("mirror", lambda: self._store.put_bytes(self.key, data, overwrite=True))

    # --- lifecycle ----------------------------------------------------------------------------------
    def flush(self, timeout: float) -> bool:
        """Only ever called when a notice leaves little time: stop at once, drop what is queued."""
        self._noticed = True
        self._stop.set()
        try:
            self._q.put_nowait(None)  # wakes the thread; a full queue wakes it anyway
        except queue.Full:
            pass
        return True

    def close(self, timeout: float) -> bool:
        end = time.monotonic() + max(0.0, min(timeout, CLOSE_S))
        if self._thread is not None and not self._stop.is_set():
            try:
                self._q.put(None, timeout=max(0.0, end - time.monotonic()))
            except queue.Full:  # a tracker that slow gets no more time: the run ends anyway
                self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(0.0, end - time.monotonic()))
            if (self._noticed and self._opened and not self.tracker.exit_ends_run and not self._thread.is_alive()
                    and time.monotonic() < end):
                # After a notice the emergency save is over by now: what time it left ends the
                # tracker run, which would otherwise show running until the next session.
                ender = threading.Thread(target=self._call, args=("finish", lambda: self.tracker.finish(self.finished)),
                                         name=f"{self.name}-sink-end", daemon=True)
                ender.start()
                ender.join(timeout=max(0.0, end - time.monotonic()))
        return True


def _import(module: str, table: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise SinkUnavailable(f"sinks.{table}: the {module} package is not installed ({e}); install it beside the "
                         f"trainer (it is your dependency, not the trainer's) or remove [sinks.{table}]") from None


@register("wandb", settings=WandbSettings)
def make_wandb(ctx: SinkContext) -> TrackerSink | None:
    if not ctx.is_main:
        return None
    return TrackerSink("wandb", Wandb(_import("wandb", "wandb"), ctx.settings, ctx), ctx,
                       mirror_every_s=ctx.settings["mirror_every_s"])


@register("mlflow", settings=MlflowSettings)
def make_mlflow(ctx: SinkContext) -> TrackerSink | None:
    if not ctx.is_main:
        return None
    return TrackerSink("mlflow", Mlflow(_import("mlflow", "mlflow"), ctx.settings, ctx), ctx,
                       mirror_every_s=ctx.settings["mirror_every_s"])
