"""Whether the synthesized stack's alert policies fire on what the drill's loopback Cloud Logging
received: each policy's condition, as the stack declares it, evaluated over the entries
`drill.fake_observability.FakeObservability` holds.

- A log-match condition (`condition_matched_log`) fires on every entry its Logging filter matches
  (cloud.google.com/monitoring/alerts/log-based-alerts): one incident per entry, notifications
  rate-limited by the policy.
- A threshold condition (`condition_threshold`) on a log-based metric: the metric's own filter and
  label extractors (`google_logging_metric`, found by the `metric.type` the condition names) give
  the points, one per matching entry (a DELTA INT64 counter); the condition's metric-label filter
  (`metric.labels.K="v"` or `one_of("a", ...)`) keeps those it names; `ALIGN_SUM` over the
  alignment period then `REDUCE_SUM` over the series is the number of points in a window of that
  length, and the condition holds at an instant when that number is above `threshold_value`
  (`COMPARISON_GT`). With a `duration` it fires once it has held at every evaluation for that
  long (cloud.google.com/monitoring/alerts/concepts-indepth#duration; evaluated here each minute
  and at each point), never past the last entry received (what has not happened yet).

Only what the stack's policies use is understood; anything else is an error, never a silent
"does not fire".
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from drill.fake_observability import FakeObservability, Filter, field_at, parse_time

_METRIC_TYPE = re.compile(r'metric\.type="logging\.googleapis\.com/user/([^"]+)"')
_METRIC_REF = re.compile(r"^\$\{google_logging_metric\.([A-Za-z0-9_-]+)\.name\}$")
_LABEL = re.compile(r'metric\.labels\.([a-z_]+)\s*=\s*(?:one_of\(([^)]*)\)|("[^"]*"))')
_EXTRACT = re.compile(r"^EXTRACT\(([A-Za-z0-9_.]+)\)$")


class EvalError(Exception):
    """A policy this evaluator does not understand."""


@dataclass
class Policy:
    """One alert policy's single condition, as the evaluator reads it."""

    title: str  # the condition's display name: "training stalled"
    log_match: bool
    filter: str  # the Logging filter of the entries it counts
    threshold: float = 0.0
    period_s: float = 0.0
    duration_s: float = 0.0
    labels: dict[str, set[str]] = field(default_factory=dict)  # metric label -> the values kept
    extractors: dict[str, list[str]] = field(default_factory=dict)  # metric label -> jsonPayload path


@dataclass
class Outcome:
    policy: Policy
    fired: bool
    entries: list[dict[str, Any]]  # what the condition counted (log-match: each one an incident)


def _seconds(text: Any) -> float:
    return float(str(text or "0s").removesuffix("s"))


def policies(stack: dict[str, Any]) -> dict[str, Policy]:
    """The stack's alert policies by condition title."""
    resources = stack.get("resource", {})
    metrics = resources.get("google_logging_metric", {})
    by_name = {str(m.get("name")): m for m in metrics.values()}
    out: dict[str, Policy] = {}
    for key, policy in resources.get("google_monitoring_alert_policy", {}).items():
        conditions = policy.get("conditions") or []
        if len(conditions) != 1:
            raise EvalError(f"{key}: {len(conditions)} conditions; the stack declares one per policy")
        (c,) = conditions
        title = str(c.get("display_name"))
        if "condition_matched_log" in c:
            out[title] = Policy(title, True, str(c["condition_matched_log"]["filter"]))
            continue
        t = c.get("condition_threshold")
        if t is None:
            raise EvalError(f"{key}: a condition of another kind ({', '.join(c)})")
        flt = str(t["filter"])
        m = _METRIC_TYPE.search(flt)
        if m is None:
            raise EvalError(f"{key}: no log-based metric in {flt!r}")
        ref = _METRIC_REF.match(m.group(1))
        metric = metrics.get(ref.group(1)) if ref else by_name.get(m.group(1))
        if metric is None:
            raise EvalError(f"{key}: the stack declares no metric {m.group(1)}")
        if t.get("comparison") != "COMPARISON_GT":
            raise EvalError(f"{key}: comparison {t.get('comparison')}")
        (agg,) = t.get("aggregations") or [{}]
        if agg.get("per_series_aligner") != "ALIGN_SUM" or agg.get("cross_series_reducer") != "REDUCE_SUM":
            raise EvalError(f"{key}: aggregation {agg}")
        labels = {}
        for lm in _LABEL.finditer(flt):
            values = re.findall(r'"([^"]*)"', lm.group(2) or lm.group(3))
            labels[lm.group(1)] = set(values)
        extractors = {}
        for label, how in (metric.get("label_extractors") or {}).items():
            e = _EXTRACT.match(str(how))
            if e is None:
                raise EvalError(f"{key}: label extractor {how!r}")
            extractors[label] = e.group(1).split(".")
        missing = set(labels) - set(extractors)
        if missing:
            raise EvalError(f"{key}: the metric has no label {', '.join(sorted(missing))}")
        out[title] = Policy(title, False, str(metric["filter"]), float(t.get("threshold_value", 0)),
                            _seconds(agg.get("alignment_period")), _seconds(t.get("duration")), labels, extractors)
    return out


def counted(policy: Policy, observability: FakeObservability) -> list[dict[str, Any]]:
    """The entries the condition counts: its filter's, and of those the label values it keeps."""
    Filter(policy.filter)  # refused here, not matched as nothing, if the fake cannot read it
    entries = observability.matching(policy.filter)
    for label, values in policy.labels.items():
        entries = [e for e in entries if str(field_at(e, policy.extractors[label])) in values]
    return entries


def fires(policy: Policy, entries: list[dict[str, Any]], until: datetime | None = None) -> bool:
    """Whether the condition fires on `entries` (already counted), evaluated up to `until`
    (default: the last entry)."""
    if policy.log_match:
        return bool(entries)
    times = sorted(parse_time(e["timestamp"]) for e in entries)
    if not times:
        return False
    end = until or times[-1]
    period, duration = timedelta(seconds=policy.period_s), timedelta(seconds=policy.duration_s)

    def holds(at: datetime) -> bool:
        return sum(1 for t in times if at - period < t <= at) > policy.threshold

    for start in times:
        if start + duration > end:
            break
        steps = int(policy.duration_s // 60)
        instants = [start + timedelta(seconds=60 * i) for i in range(steps + 1)] + [start + duration]
        instants += [t for t in times if start <= t <= start + duration]
        if all(holds(at) for at in instants):
            return True
    return False


def evaluate(stack: dict[str, Any], observability: FakeObservability) -> dict[str, Outcome]:
    """Every alert policy of `stack` against what `observability` received, by condition title."""
    out = {}
    for title, p in policies(stack).items():
        entries = counted(p, observability)
        out[title] = Outcome(p, fires(p, entries), entries)
    return out
