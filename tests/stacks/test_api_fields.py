"""Every numeric and enumerated value of every synthesized stack, against what the Google APIs
accept (`stacks.gcp_rules.API_FIELDS`, walked by `stacks.api_fields`)."""

from __future__ import annotations

import pytest
from stack_support import EXPERIMENTS, FIXTURES, VARIANTS

from stacks import api_fields
from stacks import gcp_rules as R

pytestmark = pytest.mark.xdist_group("stacks")

ALL = [*VARIANTS, *(p.stem for p in sorted(FIXTURES.glob("*.toml"))),
       *(p.stem for p in sorted(EXPERIMENTS.glob("*.toml")) if p.stem not in VARIANTS)]


@pytest.mark.parametrize("name", ALL)
def test_every_value_a_stack_sets_is_one_the_api_accepts(synthesized, name):
    assert api_fields.problems(synthesized[name].json) == []


def _stack(kind: str, **fields: object) -> dict:
    return {"resource": {kind: {"x": fields}}}


def test_a_numeric_or_enum_like_field_without_a_row_fails():
    found = api_fields.problems(_stack("google_compute_health_check", check_interval_sec=10,
                                       new_knob=3, new_mode="FAST", new_wait="30s", name="ok-name"))
    assert [p.split(":")[0] for p in found] == [
        "google_compute_health_check.x.new_knob = 3",
        "google_compute_health_check.x.new_mode = 'FAST'",
        "google_compute_health_check.x.new_wait = '30s'",
    ]
    assert all("no row in gcp_rules.API_FIELDS" in p for p in found)
    # A resource type the table does not know at all is no exception.
    assert api_fields.problems(_stack("google_new_thing", size=5))


@pytest.mark.parametrize(("kind", "fields", "bad"), [
    ("google_compute_health_check", {"unhealthy_threshold": 11}, "unhealthy_threshold = 11"),
    ("google_compute_health_check", {"check_interval_sec": 301}, "check_interval_sec = 301"),
    ("google_storage_bucket", {"soft_delete_policy": {"retention_duration_seconds": 86400}},
     "soft_delete_policy.retention_duration_seconds = 86400"),
    ("google_cloud_scheduler_job", {"attempt_deadline": "10s"}, "attempt_deadline = '10s'"),
    ("google_cloud_scheduler_job", {"schedule": "*/60 * * * *"}, "schedule = '*/60 * * * *'"),
    ("google_cloud_run_v2_job", {"template": {"template": {"max_retries": 11}}},
     "template.template.max_retries = 11"),
    ("google_compute_resize_request", {"requested_run_duration": {"seconds": "604801"}},
     "requested_run_duration.seconds = '604801'"),
    ("google_compute_instance_group_manager", {"target_size": "${x > 0 ? 0 : 2000}"},
     "target_size = 2000"),
    ("google_compute_instance", {"desired_status": '${x ? "STOPPED" : "RUNNING"}'},
     "desired_status = 'STOPPED'"),
    ("google_compute_instance_template", {"disk": [{"disk_size_gb": 5}]}, "disk.disk_size_gb = 5"),
    ("google_compute_region_instance_group_manager", {"distribution_policy_target_shape": "SPREAD"},
     "distribution_policy_target_shape = 'SPREAD'"),
])
def test_a_value_outside_its_row_fails(kind, fields, bad):
    (problem,) = api_fields.problems(_stack(kind, **fields))
    assert problem.startswith(f"{kind}.x.{bad}: the API accepts ")
    assert "https://" in problem


def test_relations_one_row_cannot_say():
    assert api_fields.problems(_stack("google_compute_health_check", check_interval_sec=5,
                                      timeout_sec=6)) == [
        "google_compute_health_check.x: timeout_sec 6 is longer than check_interval_sec 5; the "
        "API refuses it"]
    assert api_fields.problems(_stack(
        "google_compute_region_instance_group_manager", distribution_policy_zones=["a", "b", "c"],
        update_policy={"max_unavailable_fixed": 2}))
    assert api_fields.problems(_stack("google_compute_instance_template", scheduling={
        "provisioning_model": "FLEX_START", "instance_termination_action": "STOP",
        "automatic_restart": False, "max_run_duration": {"seconds": 3600}}))


def test_every_row_names_its_source():
    for kind, rows in R.API_FIELDS.items():
        for path, rule in rows.items():
            assert rule.source.startswith("https://"), (kind, path)
            assert rule.values or rule.low is not None or rule.high is not None or rule.pattern


def _bounds(model: type, field: str) -> tuple[float | None, float | None]:
    low = high = None
    for m in model.model_fields[field].metadata:
        low = getattr(m, "ge", low)
        high = getattr(m, "le", high)
    return low, high


def test_validation_accepts_nothing_the_api_refuses():
    """Where a file's number becomes an API field unchanged (or times a constant), the file's
    bounds lie within the API's row: a value validation accepts synthesizes a value the API takes."""
    from stacks.experiment import Bucket, Capacity, Disk, Group, Machine, Trainer

    rows = R.API_FIELDS
    group = rows["google_compute_instance_group_manager"]
    template = rows["google_compute_instance_template"]
    pairs = [
        (_bounds(Group, "initial_delay_sec"), group["auto_healing_policies.initial_delay_sec"], 1),
        (_bounds(Disk, "checkpoint_disk_gb"), template["disk.disk_size_gb"], 1),
        (_bounds(Machine, "boot_disk_gb"), template["disk.disk_size_gb"], 1),
        (_bounds(Trainer, "health_port"), group["named_port.port"], 1),
        (_bounds(Capacity, "flex_max_run_hours"),
         rows["google_compute_resize_request"]["requested_run_duration.seconds"], 3600),
        (_bounds(Bucket, "soft_delete_days"),
         rows["google_storage_bucket"]["soft_delete_policy.retention_duration_seconds"], 86400),
    ]
    for (low, high), rule, scale in pairs:
        assert low is not None and high is not None
        for value in (low, high):
            # soft delete: 1-6 days are refused by the field's own validator (tested elsewhere)
            assert rule.accepts(value * scale), (rule.source, value)
    low, high = _bounds(Capacity, "fallback_check_minutes")
    for minutes in range(low, high + 1):  # the schedule stacks.fallback writes for each
        schedule = f"*/{minutes} * * * *" if minutes < 60 else "0 * * * *"
        assert rows["google_cloud_scheduler_job"]["schedule"].accepts(schedule)
