"""One Cloud Monitoring dashboard per experiment, "spottrain NAME" (docs/watch.md has its picture).

Its charts read the stack's log-based metrics (`stacks.run_metrics`: steps/s, loss, eval loss, the
step reached, preemptions and restores, tier failures, capacity waits, boots, stalls and failures)
and the custom metrics the trainer writes (`run_metrics.CUSTOM_METRICS`: goodput, cost so far
against on demand), plus a panel of the run's log entries. `dashboard_json` is the body of
`projects.dashboards` (cloud.google.com/monitoring/api/ref_v3/rest/v1/projects.dashboards): a
mosaic layout of 48 columns; `metric_types` lists every metric a chart reads, which the tests
check against what the stack declares.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from cdktn_provider_google.monitoring_dashboard import MonitoringDashboard
from constructs import Construct

from stacks import run_metrics as M
from stacks.alert_rules import see_more
from stacks.experiment import Experiment

COLUMNS = 48


def _series(metric_type: str, aligner: str, *, period_s: int = 60, reducer: str = "REDUCE_SUM",
            group_by: tuple[str, ...] = (), extra: str = "", legend: str = "", plot: str = "LINE",
            resource: str = "gce_instance") -> dict[str, Any]:
    aggregation: dict[str, Any] = {"alignmentPeriod": f"{period_s}s", "perSeriesAligner": aligner,
                                   "crossSeriesReducer": reducer}
    if group_by:
        aggregation["groupByFields"] = list(group_by)
    flt = f'metric.type="{metric_type}" resource.type="{resource}"' + (f" {extra}" if extra else "")
    out: dict[str, Any] = {"timeSeriesQuery": {"timeSeriesFilter": {"filter": flt, "aggregation": aggregation}},
                           "plotType": plot}
    if legend:
        out["legendTemplate"] = legend
    return out


# The API answers a dashboard without the fields at their default value (0, "", an enum's 0), and
# the provider's diff counts a field only the configuration has as a change: a tile at xPos 0 or
# an axis labelled "" would show the dashboard changed at every `make diff`. So the body never
# writes a default (drill.fake_project.read_back models the read; tests/drill/test_fake_project.py).
def _chart(title: str, *datasets: dict[str, Any], y: str = "") -> dict[str, Any]:
    axis = {"label": y, "scale": "LINEAR"} if y else {"scale": "LINEAR"}
    return {"title": title, "xyChart": {"dataSets": list(datasets), "yAxis": axis}}


def _tile(x: int, y: int, w: int, h: int, widget: dict[str, Any]) -> dict[str, Any]:
    tile = {"xPos": x, "yPos": y, "width": w, "height": h, "widget": widget}
    return {k: v for k, v in tile.items() if v != 0}


def dashboard(exp: Experiment, name: str) -> dict[str, Any]:
    """The dashboard's JSON body."""
    p = exp.gcp.project
    log = {n: M.metric_type(name, n) for n in M.by_name(p, name)}
    custom = {k.removeprefix(M.CUSTOM_PREFIX): k for k in M.CUSTOM_METRICS}
    job = f'metric.labels.experiment="{name}"'
    text = (f"**Experiment `{name}`**, run `runs/{name}` in project `{p}`. {see_more(exp, name)} Checkpoints, "
            f"goodput and cost so far: `python -m trainer status --gcs-uri gs://{exp.bucket_name(name)}/runs/{name}`.")
    tiles = [
        _tile(0, 0, 48, 6, {"title": f"spottrain {name}", "text": {"content": text, "format": "MARKDOWN"}}),
        _tile(0, 6, 24, 16, _chart("Steps per second", _series(log["steps_per_s"], "ALIGN_PERCENTILE_50",
                                                                 reducer="REDUCE_MEAN", legend="steps/s"), y="steps/s")),
        _tile(24, 6, 24, 16, _chart(
            "Loss and eval loss", _series(log["loss"], "ALIGN_PERCENTILE_50", reducer="REDUCE_MEAN", legend="train"),
            _series(log["eval_loss"], "ALIGN_PERCENTILE_50", reducer="REDUCE_MEAN", legend="eval", period_s=300),
            y="loss")),
        _tile(0, 22, 16, 16, _chart(
            "Step reached", _series(log["step"], "ALIGN_PERCENTILE_99", reducer="REDUCE_MAX", legend="logged"),
            _series(custom["step"], "ALIGN_MAX", reducer="REDUCE_MAX", extra=job, resource="global",
                    legend="trainer"), y="step")),
        _tile(16, 22, 16, 16, _chart(
            "Goodput (productive share of the time)",
            _series(custom["goodput"], "ALIGN_MEAN", reducer="REDUCE_MEAN", period_s=300, extra=job,
                    resource="global", legend="goodput"), y="0-1")),
        _tile(32, 22, 16, 16, _chart(
            "Cost so far against on demand (USD)",
            _series(custom["cost_usd"], "ALIGN_MAX", reducer="REDUCE_MAX", period_s=300, extra=job,
                    resource="global", legend="spent"),
            _series(custom["on_demand_cost_usd"], "ALIGN_MAX", reducer="REDUCE_MAX", period_s=300, extra=job,
                    resource="global", legend="on demand"), y="USD")),
        _tile(0, 38, 16, 16, _chart(
            "Preemptions and restores (per hour)",
            _series(log["preemptions"], "ALIGN_SUM", period_s=3600, legend="preemptions", plot="STACKED_BAR"),
            _series(log["restores"], "ALIGN_SUM", period_s=3600, group_by=("metric.label.tier",),
                    legend="restores from ${metric.labels.tier}", plot="STACKED_BAR"))),
        _tile(16, 38, 16, 16, _chart(
            "Checkpoint tiers failing (per hour)",
            _series(log["tier_failing"], "ALIGN_SUM", period_s=3600, group_by=("metric.label.tier",),
                    legend="${metric.labels.tier}", plot="STACKED_BAR"))),
        _tile(32, 38, 16, 16, _chart(
            "Capacity waits: VM creations refused (per hour)",
            _series(log["capacity_waits"], "ALIGN_SUM", period_s=3600, legend="stockouts", plot="STACKED_BAR"))),
        _tile(0, 54, 24, 16, _chart(
            "VM boots by cause, stalls and failures (per hour)",
            _series(log["boots"], "ALIGN_SUM", period_s=3600, group_by=("metric.label.after",),
                    legend="boot after ${metric.labels.after}", plot="STACKED_BAR"),
            _series(log["stalls"], "ALIGN_SUM", period_s=3600, legend="stalled", plot="STACKED_BAR"),
            _series(log["failures"], "ALIGN_SUM", period_s=3600, group_by=("metric.label.reason",),
                    legend="failed: ${metric.labels.reason}", plot="STACKED_BAR"))),
        _tile(24, 54, 24, 16, {"title": "The run's log", "logsPanel": {
            "filter": M.base_filter(p, name), "resourceNames": [f"projects/{p}"]}}),
    ]
    return {"displayName": f"spottrain {name}", "mosaicLayout": {"columns": COLUMNS, "tiles": tiles},
            "labels": {"spottrain": ""}}


_METRIC_TYPE = re.compile(r'metric\.type="([^"]+)"')


def metric_types(body: dict[str, Any]) -> set[str]:
    """Every metric type a chart of the dashboard reads."""
    return set(_METRIC_TYPE.findall(json.dumps(body).replace('\\"', '"')))


@dataclass(frozen=True)
class DashboardProps:
    project: str
    name: str
    exp: Experiment


class RunDashboard(Construct):
    def __init__(self, scope: Construct, id_: str, props: DashboardProps) -> None:
        super().__init__(scope, id_)
        self.body = dashboard(props.exp, props.name)
        # The legends' ${metric.labels.X} are Monitoring's templates, not Terraform's: "$${" keeps
        # them literal through Terraform's string interpolation.
        self.dashboard = MonitoringDashboard(self, "dashboard", project=props.project,
                                             dashboard_json=json.dumps(self.body, sort_keys=True).replace("${", "$${"))
