"""Every numeric and enumerated value a synthesized stack sets, against what the Google APIs
accept there (`gcp_rules.API_FIELDS`, one row per field with its source).

The provider checks few of these ranges (a health check's `unhealthy_threshold`, a bucket's soft
delete retention, a scheduler's deadline...), so a bad value passes synthesis and `plan` and
fails the first `apply`. `problems(stack)` walks the synthesized JSON of one stack and returns one
line per value outside its row, per numeric or enum-like value in a field that has no row (a new
field cannot skip the table), and per broken relation between fields that one row cannot say
(a health check's timeout longer than its interval, a regional group's unavailable count, the
scheduling combinations the API demands).

Expressions (`${...}`) are checked by their literal alternatives (`cond ? 0 : 1` checks 0 and 1);
free text (descriptions, labels, metadata, conditions, container arguments) is not an enum.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from stacks import gcp_rules as R

#: Keys whose values are free text or references to other fields, never an enumeration.
FREE_TEXT = frozenset({"description", "labels", "metadata", "metadata_startup_script", "condition",
                       "command", "env", "title", "depends_on", "lifecycle", "provider", "//",
                       "source", "content", "source_image", "image"})
_ENUM_LIKE = re.compile(r"^[A-Z][A-Z0-9_]*$")
_NUMBER = re.compile(r"^-?[0-9]+(\.[0-9]+)?$")
_DURATION = re.compile(r"^([0-9]+(\.[0-9]+)?)s$")


def _leaves(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for key, inner in value.items():
            if key not in FREE_TEXT:
                yield from _leaves(inner, f"{path}.{key}" if path else key)
    elif isinstance(value, list):
        for inner in value:
            yield from _leaves(inner, path)
    else:
        yield path, value


def _literals(expression: str) -> list[Any]:
    """The literal values an expression can take: the branches of `cond ? A : B`."""
    if " ? " not in expression:
        return []
    branches = expression.rsplit(" ? ", 1)[1].rstrip("}").split(" : ")
    out: list[Any] = []
    for b in branches:
        b = b.strip()
        if _NUMBER.match(b):
            out.append(float(b) if "." in b else int(b))
        elif len(b) >= 2 and b[0] == b[-1] == '"':
            out.append(b[1:-1])
    return out


def _as_rule_value(rule: R.FieldRule, value: Any) -> Any:
    """A string the API reads as a number ("259200", "300s") as that number."""
    if isinstance(value, str) and rule.pattern is None:
        m = _DURATION.match(value) if rule.duration else None
        if m:
            return float(m.group(1)) if m.group(2) else int(m.group(1))
        if not rule.duration and _NUMBER.match(value) and (rule.low is not None or rule.high is not None):
            return float(value) if "." in value else int(value)
    return value


def _field_problems(kind: str, key: str, resource: dict[str, Any]) -> Iterator[str]:
    rules = R.API_FIELDS.get(kind, {})
    for path, value in _leaves(resource):
        where = f"{kind}.{key}.{path}"
        rule = rules.get(path)
        if isinstance(value, bool) or value is None:
            continue
        values = _literals(value) if isinstance(value, str) and value.startswith("${") else [value]
        if rule is None:
            for v in values:
                if isinstance(v, (int, float)) or (isinstance(v, str) and (
                        _ENUM_LIKE.match(v) or _NUMBER.match(v) or _DURATION.match(v))):
                    yield (f"{where} = {v!r}: no row in gcp_rules.API_FIELDS says what the API "
                           "accepts there; add one with its source")
            continue
        for v in values:
            if not rule.accepts(_as_rule_value(rule, v)):
                yield f"{where} = {v!r}: the API accepts {rule.allowed()} ({rule.source})"


def _relation_problems(kind: str, key: str, r: dict[str, Any]) -> Iterator[str]:
    where = f"{kind}.{key}"
    if kind == "google_monitoring_alert_policy":
        yield from _alert_problems(where, r)
    if kind == "google_compute_health_check":
        if r.get("timeout_sec", 0) > r.get("check_interval_sec", 5):
            yield (f"{where}: timeout_sec {r['timeout_sec']} is longer than check_interval_sec "
                   f"{r['check_interval_sec']}; the API refuses it")
    if kind == "google_compute_region_instance_group_manager":
        unavailable = r.get("update_policy", {}).get("max_unavailable_fixed")
        zones = len(r.get("distribution_policy_zones", []))
        if unavailable not in (None, 0) and unavailable < zones:
            yield (f"{where}: update_policy.max_unavailable_fixed {unavailable} is neither 0 nor "
                   f"at least the {zones} zones; the API refuses it")
    if kind in ("google_compute_instance_template", "google_compute_instance"):
        s = r.get("scheduling", {})
        model = s.get("provisioning_model")
        if model == "SPOT" and (s.get("preemptible") is not True or s.get("automatic_restart") is not False):
            yield f"{where}: SPOT needs preemptible = true and automatic_restart = false"
        if model == "FLEX_START" and (s.get("instance_termination_action") != "DELETE"
                                      or "max_run_duration" not in s
                                      or s.get("automatic_restart") is not False):
            yield (f"{where}: FLEX_START needs instance_termination_action = DELETE, a "
                   "max_run_duration and automatic_restart = false")
        if model != "FLEX_START" and "max_run_duration" in s:
            yield f"{where}: max_run_duration is set here only for FLEX_START"
        gpus = r.get("guest_accelerator") or kind == "google_compute_instance_template"
        if gpus and s.get("on_host_maintenance") not in (None, "TERMINATE"):
            yield f"{where}: a GPU VM needs on_host_maintenance = TERMINATE"
        for disk in r.get("disk", []):
            if disk.get("type") == "SCRATCH" and (disk.get("disk_size_gb") != R.LOCAL_SSD_GB
                                                  or disk.get("disk_type") != "local-ssd"):
                yield f"{where}: a SCRATCH disk is a {R.LOCAL_SSD_GB} GB local-ssd"


def _alert_problems(where: str, r: dict[str, Any]) -> Iterator[str]:
    """An alert condition's duration is a whole number of minutes (projects.alertPolicies)."""
    for c in r.get("conditions", []):
        duration = c.get("condition_threshold", {}).get("duration")
        m = _DURATION.match(duration) if isinstance(duration, str) else None
        if m and float(m.group(1)) % 60:
            yield f"{where}: condition duration {duration} is not a multiple of 60 s; the API refuses it"


def problems(stack: dict[str, Any]) -> list[str]:
    """One line per value of the synthesized `stack` (its JSON) that the APIs would refuse, or
    that the table does not cover."""
    out: list[str] = []
    for kind, resources in sorted(stack.get("resource", {}).items()):
        for key, resource in sorted(resources.items()):
            out += _field_problems(kind, key, resource)
            out += _relation_problems(kind, key, resource)
    return out
