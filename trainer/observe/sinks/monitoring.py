"""The job's goodput, cost and step as Cloud Monitoring custom metrics (rank 0), for the
experiment's dashboard: ``custom.googleapis.com/spottrain/{goodput,cost_usd,on_demand_cost_usd,step}``.

On a VM the stack turns it on (``[sinks.monitoring]`` with the project, the experiment and the
run, in the trainer's config file); locally it is off unless a config sets that table.

What it writes: one GAUGE DOUBLE point per series and request (``projects.timeSeries.create``),
on the resource ``global`` with the labels ``experiment`` and ``run``, each series at most once
every ``every_s`` (60 by default; Cloud Monitoring refuses a series written more often than
every 5 s, and charts by the minute). The values are the newest the events told: ``Step``'s
step, ``Goodput``'s goodput, cost so far and on-demand equivalent (``trainer.observe.goodput``).

How it stays out of the way: ``handle`` only records the newest values; a background thread
sends them, with the VM's metadata-server token, to ``SPOTTRAIN_MONITORING_API`` (default
https://monitoring.googleapis.com/v3). A failed or refused write drops its points (the next
interval sends newer ones) and is logged on the 1st, 2nd, 4th, ... failure. A preemption
notice (its ``Notice`` event, or ``flush``) stops the thread and drops what is unsent at once:
the emergency save's budget is never spent here. ``close`` at a normal end sends the newest values once, if their
series may take a point by then, within a few seconds at most.
"""
from __future__ import annotations

import os
import threading
import time
from datetime import datetime, timezone
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field

from trainer.observe.bus import BaseSink, SinkContext
from trainer.observe.events import Event, Goodput, Notice, Step
from trainer.observe.sinks import register

DEFAULT_API = "https://monitoring.googleapis.com/v3"
PREFIX = "custom.googleapis.com/spottrain/"
#: The series it writes (``stacks.run_metrics.CUSTOM_METRICS`` charts them).
METRICS = ("goodput", "cost_usd", "on_demand_cost_usd", "step")
#: Cloud Monitoring's floor between two points of one series.
MIN_EVERY_S = 5.0
#: How long ``close`` may spend on the last points at a normal end.
CLOSE_S = 5.0


class Settings(BaseModel):
    """``[sinks.monitoring]``."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    project: str = Field(pattern=r"^[a-z][a-z0-9-]{4,28}[a-z0-9]$")
    """The project whose Cloud Monitoring gets the points (the VM's account writes them:
    ``roles/monitoring.metricWriter``)."""
    experiment: str = Field(min_length=1, max_length=1024)
    """The ``experiment`` label of every series."""
    run: str = Field(min_length=1, max_length=1024)
    """The ``run`` label of every series (the run's checkpoint prefix, ``runs/NAME``)."""
    every_s: float = Field(default=60.0, ge=MIN_EVERY_S)
    """Seconds between two points of one series (at least 5, Cloud Monitoring's floor)."""
    timeout_s: float = Field(default=10.0, gt=0, le=60)
    """Seconds one write may take before it counts as failed."""


def _rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class MonitoringSink(BaseSink):
    name = "monitoring"
    handles = (Step, Goodput, Notice)

    def __init__(self, settings: dict[str, Any], log: Any, *, clock: Callable[[], float] = time.time,
                 client: Any = None, start: bool = True) -> None:
        from trainer.cloud.gce import Client

        self.s = Settings.model_validate(settings)
        self.log = log
        self.clock = clock
        self.client = client or Client(timeout=self.s.timeout_s, retries=0)
        api = (os.environ.get("SPOTTRAIN_MONITORING_API") or DEFAULT_API).rstrip("/")
        self.url = f"{api}/projects/{self.s.project}/timeSeries"
        self._lock = threading.Lock()
        self._values: dict[str, float] = {}     # metric -> newest value not yet sent
        self._sent_at: dict[str, float] = {}    # metric -> end time of its last point
        self.failures = 0
        self.writes = 0                         # requests Cloud Monitoring answered 200
        self._stop = threading.Event()
        self._last_word = False                 # close: send the newest values once more
        self._thread: threading.Thread | None = None
        if start:
            self._thread = threading.Thread(target=self._run, name="monitoring-sink", daemon=True)
            self._thread.start()

    # --- the loop's side: record, nothing else ------------------------------------------------
    def handle(self, ev: Event) -> None:
        if isinstance(ev, Notice):  # the shutdown window is the save's, not ours
            self._drop()
            return
        with self._lock:
            if isinstance(ev, Step):
                self._values["step"] = float(ev.step)
            elif isinstance(ev, Goodput):
                self._values["goodput"] = float(ev.goodput)
                if ev.cost_usd is not None:
                    self._values["cost_usd"] = float(ev.cost_usd)
                if ev.on_demand_cost_usd is not None:
                    self._values["on_demand_cost_usd"] = float(ev.on_demand_cost_usd)

    # --- the thread's side ----------------------------------------------------------------------
    def _run(self) -> None:
        # Wake often enough that a series is sent soon after it may be; a write in flight holds
        # this thread only, never the loop.
        while not self._stop.wait(min(self.s.every_s, MIN_EVERY_S)):
            self.send_due()
        if self._last_word:
            self.send_due()

    def due(self, now: float) -> dict[str, float]:
        """The series that may take a point at ``now``, with their newest values (taken)."""
        with self._lock:
            out = {m: v for m, v in self._values.items()
                   if now - self._sent_at.get(m, float("-inf")) >= self.s.every_s}
            for m in out:
                del self._values[m]
                self._sent_at[m] = now  # even if the write fails: it may have landed
            return out

    def send_due(self) -> bool:
        """One write of every series that is due; False when it failed (its points are dropped,
        the next interval sends newer ones)."""
        now = self.clock()
        points = self.due(now)
        if not points:
            return True
        body = {"timeSeries": [self._series(m, v, now) for m, v in sorted(points.items())]}
        try:
            self.client.request("POST", self.url, body=body)
        except Exception as e:  # noqa: BLE001 - a metric is never worth stopping the run for
            self.failures += 1
            n = self.failures
            if n & (n - 1) == 0:  # the 1st, 2nd, 4th, ... failure
                self.log.warning("event=sink_error sink=monitoring what=timeSeries.create count=%d error=%s "
                                 "(points dropped; training goes on)", n, " ".join(str(e).split())[:300])
            return False
        self.writes += 1
        return True

    def _series(self, metric: str, value: float, now: float) -> dict[str, Any]:
        return {"metric": {"type": PREFIX + metric, "labels": {"experiment": self.s.experiment, "run": self.s.run}},
                "resource": {"type": "global", "labels": {"project_id": self.s.project}},
                "metricKind": "GAUGE", "valueType": "DOUBLE",
                "points": [{"interval": {"endTime": _rfc3339(now)}, "value": {"doubleValue": value}}]}

    # --- lifecycle ------------------------------------------------------------------------------
    def _drop(self) -> None:
        self._stop.set()
        with self._lock:
            self._values.clear()

    def flush(self, timeout: float) -> bool:
        """Only ever called when a notice leaves little time: stop, drop what is unsent, at once."""
        self._drop()
        return True

    def close(self, timeout: float) -> bool:
        """A normal end: the newest values once more (where their series may take a point), for
        at most ``CLOSE_S``; after a notice: at once. Nothing is kept only on this VM either way."""
        if not self._stop.is_set():
            self._last_word = True
            self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(0.0, min(timeout, CLOSE_S)))
        return True


@register("monitoring", settings=Settings)
def make(ctx: SinkContext) -> MonitoringSink | None:
    return MonitoringSink(ctx.settings, ctx.log.getChild("monitoring")) if ctx.is_main else None
