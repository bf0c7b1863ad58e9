"""Capacity options, synthesized and validated: flex-start, ranked machine types, zone change on
repair, and the on-demand fallback (docs/capacity.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from stack_support import VARIANTS, merged, unless_stopped, variant

from stacks.boot import boot_props, render
from stacks.load import ExperimentError, parse

pytestmark = pytest.mark.xdist_group("stacks")
REPO = Path(__file__).resolve().parents[2]


def problems(overrides: dict) -> list[str]:
    try:
        parse(merged(overrides), "x", "experiments/x.toml")
    except ExperimentError as e:
        return e.lines
    return []


# --- flex-start ------------------------------------------------------------------------------------


def test_flex_start_template_and_group(synthesized):
    s = synthesized["flex-start"]
    sched = s.one("google_compute_instance_template")["scheduling"]
    assert sched == {"provisioning_model": "FLEX_START", "preemptible": False, "automatic_restart": False,
                     "on_host_maintenance": "TERMINATE", "instance_termination_action": "DELETE",
                     "max_run_duration": {"seconds": 72 * 3600}}
    g = s.one("google_compute_instance_group_manager")
    assert g["target_size"] == 0 and g["lifecycle"]["ignore_changes"] == ["target_size"]
    assert g["instance_lifecycle_policy"] == {"default_action_on_failure": "DO_NOTHING"}
    assert "stateful_disk" not in g and "auto_healing_policies" not in g
    assert g["update_policy"]["type"] == "OPPORTUNISTIC"
    req = s.one("google_compute_resize_request")
    assert (req["name"], req["resize_by"], req["zone"]) == ("flex-start-flex", 1, "us-central1-a")
    assert req["requested_run_duration"] == {"seconds": str(72 * 3600)}
    assert req["instance_group_manager"] == "${google_compute_instance_group_manager.group_group_3C84F8A7.name}" \
        or req["instance_group_manager"].endswith(".name}")
    assert s.one("google_compute_instance_template")["metadata"]["spottrain-provisioning"] == "FLEX_START"


def test_flex_start_regional_keeps_one_zone(synthesized):
    s = synthesized["flex-regional"]
    g = s.one("google_compute_region_instance_group_manager")
    assert g["distribution_policy_target_shape"] == "ANY_SINGLE_ZONE"
    assert s.one("google_compute_region_resize_request")["region"] == "us-central1"


def test_a_flex_start_vm_stops_before_its_end_and_asks_for_a_successor():
    scripts = render(boot_props("flex-start", variant(VARIANTS["flex-start"], "flex-start")))
    settings = json.loads(scripts.scale_settings)
    assert settings["run_duration_s"] == 72 * 3600 and settings["stop_before_s"] == 600
    assert "spottrain-deadline.service" in scripts.startup
    assert "trainer.cloud.scale --config /etc/spottrain/scale.json deadline" in scripts.startup
    plain = render(boot_props("example", variant({}, "example")))
    assert "spottrain-deadline" not in plain.startup


FLEX = {"flex-start": "google_compute_resize_request",
        "flex-regional": "google_compute_region_resize_request"}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_flex_start_templates_consume_no_reservation(synthesized, name):
    """As Google's resize-request examples: flex-start capacity comes from Dynamic Workload
    Scheduler; the default affinity (ANY_RESERVATION) would let a matching reservation be used."""
    for t in synthesized[name].resources("google_compute_instance_template"):
        flex = t["scheduling"]["provisioning_model"] == "FLEX_START"
        assert t.get("reservation_affinity") == ({"type": "NO_RESERVATION"} if flex else None)


@pytest.mark.parametrize("name", list(FLEX))
def test_each_flex_vm_ends_when_its_deadline_expects_whichever_duration_the_group_applies(
        synthesized, name):
    """The template's max_run_duration, the first request's run duration and the duration the
    VM's deadline unit (and so every successor request) uses are one number."""
    s = synthesized[name]
    template = s.one("google_compute_instance_template")["scheduling"]["max_run_duration"]["seconds"]
    request = int(s.one(FLEX[name])["requested_run_duration"]["seconds"])
    vm = json.loads(render(boot_props(name, s.spec)).scale_settings)["run_duration_s"]
    assert template == request == vm == s.spec.capacity.flex_max_run_hours * 3600


@pytest.mark.parametrize("name", list(FLEX))
def test_a_changed_run_duration_never_replaces_the_running_request(synthesized, name):
    """A resize request cannot be updated: Terraform would replace it, cancelling a queued VM or
    adding a second one beside the running VM. Every argument a new flex_max_run_hours changes is
    one Terraform ignores on the request."""
    before = synthesized[name].one(FLEX[name])
    hours = {"capacity": {"flex_max_run_hours": 96}}
    after_spec = variant({**VARIANTS[name], **hours,
                          "capacity": {**VARIANTS[name].get("capacity", {}), **hours["capacity"]}},
                         name)
    from stack_support import Synthesized

    after = Synthesized(name, after_spec).one(FLEX[name])
    changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
    assert changed == {"requested_run_duration"}
    assert changed <= set(after["lifecycle"]["ignore_changes"])


@pytest.mark.parametrize("overrides, line", [
    ({"machine": {"provisioning": "flex-start", "machine_type": "n1-standard-8",
                  "gpu_type": "nvidia-tesla-t4", "termination_action": None}},
     "machine.provisioning: flex-start does not offer n1-standard-8; allowed: a machine type of family a2, a3, g2"),
    ({"machine": {"provisioning": "flex-start"}},
     'machine.termination_action: applies only to provisioning = "spot"; allowed: remove it for "flex-start"'),
    ({"machine": {"provisioning": "flex-start", "termination_action": None}, "capacity": {"flex_max_run_hours": 200}},
     "capacity.flex_max_run_hours: Input should be less than or equal to 168, got 200"),
])
def test_flex_start_validation(overrides, line):
    assert f"experiments/x.toml: {line}" in problems(overrides)


# --- ranked machine types ----------------------------------------------------------------------------


def test_ranked_machine_types_become_instance_flexibility(synthesized):
    g = synthesized["ranked-types"].one("google_compute_region_instance_group_manager")
    assert g["instance_flexibility_policy"]["instance_selections"] == [
        {"name": "rank-0", "rank": 0, "machine_types": ["g2-standard-8"]},
        {"name": "rank-1", "rank": 1, "machine_types": ["g2-standard-12"]},
        {"name": "rank-2", "rank": 2, "machine_types": ["g2-standard-16"]},
    ]
    assert g["distribution_policy_target_shape"] == "BALANCED"


@pytest.mark.parametrize("overrides, line", [
    ({"capacity": {"machine_types": ["g2-standard-12"]}},
     'capacity.machine_types: ranked machine types need placement = "regional"'),
    ({"gcp": {"zones": ["us-central1-a", "us-central1-b"]}, "group": {"placement": "regional"},
      "capacity": {"machine_types": ["g2-standard-24"]}},
     "capacity.machine_types[0]: g2-standard-24 cannot take the group's 1 x nvidia-l4: g2-standard-24 has 2 "
     "GPU(s) built in, not 1"),
    ({"gcp": {"zones": ["us-central1-a", "us-central1-b"]}, "group": {"placement": "regional"},
      "machine": {"machine_type": "n1-standard-8", "gpu_type": "nvidia-tesla-t4"},
      "capacity": {"machine_types": ["g2-standard-8"]}},
     "capacity.machine_types[0]: g2-standard-8 cannot take the group's 1 x nvidia-tesla-t4"),
    ({"gcp": {"zones": ["us-central1-a", "us-central1-b"]}, "group": {"placement": "regional"},
      "machine": {"machine_type": "n1-standard-8", "gpu_type": "nvidia-tesla-t4"},
      "capacity": {"machine_types": ["n1-standard-96"]}},
     "capacity.machine_types[0]: n1-standard-96 cannot take the group's 1 x nvidia-tesla-t4: n1-standard-96 "
     "(96 vCPU, 360 GB) is too large for 1 x nvidia-tesla-t4"),
])
def test_ranked_machine_types_follow_the_gpu_rules(overrides, line):
    assert any(p.startswith(f"experiments/x.toml: {line}") for p in problems(overrides)), problems(overrides)


# --- zone change on repair ------------------------------------------------------------------------


def test_zone_change_drops_the_stateful_disk_and_lets_repair_move_zones(synthesized):
    g = synthesized["zone-change"].one("google_compute_region_instance_group_manager")
    assert "stateful_disk" not in g
    assert g["instance_lifecycle_policy"]["on_repair"] == {"allow_changing_zone": "YES"}
    assert g["distribution_policy_target_shape"] == "BALANCED"
    regional = synthesized["regional"].one("google_compute_region_instance_group_manager")
    assert regional["instance_lifecycle_policy"]["on_repair"] == {"allow_changing_zone": "NO"}
    assert regional["stateful_disk"]


def test_zone_change_needs_a_regional_group():
    assert "experiments/x.toml: capacity.zone_change_on_repair: needs placement = \"regional\" (a zonal " \
           "group has one zone); allowed: false" in problems({"capacity": {"zone_change_on_repair": True}})


# --- on-demand fallback -------------------------------------------------------------------------------


def test_fallback_adds_an_on_demand_group_owned_by_the_check(synthesized):
    s = synthesized["od-fallback"]
    groups = {g["name"]: g for g in s.resources("google_compute_instance_group_manager")}
    assert set(groups) == {"od-fallback-group", "od-fallback-od-group"}
    assert unless_stopped(groups["od-fallback-group"]["target_size"]) == 1
    assert groups["od-fallback-od-group"]["target_size"] == 0
    assert all(g["lifecycle"]["ignore_changes"] == ["target_size"] for g in groups.values())
    templates = {t["name_prefix"]: t for t in s.resources("google_compute_instance_template")}
    assert templates["od-fallback-"]["scheduling"]["provisioning_model"] == "SPOT"
    assert templates["od-fallback-od-"]["scheduling"]["provisioning_model"] == "STANDARD"
    assert templates["od-fallback-od-"]["metadata"]["spottrain-provisioning"] == "STANDARD"
    assert {h["name"] for h in s.resources("google_compute_health_check")} == {
        "od-fallback-health", "od-fallback-od-health"}
    # A VM of either group stops both when the job is done: the control job resizes both.
    settings = json.loads(control_env(s)["SPOTTRAIN_CONTROL"])
    assert settings["groups"] == ["od-fallback-group", "od-fallback-od-group"]


def control_env(s) -> dict[str, str]:
    job = s.one("google_cloud_run_v2_job")
    return {e["name"]: e["value"] for e in job["template"]["template"]["containers"][0]["env"]}


def test_fallback_check_runs_in_the_scheduled_control_job_with_least_privilege(synthesized):
    s = synthesized["od-fallback"]
    job = s.one("google_cloud_run_v2_job")
    assert (job["name"], job["location"], job["deletion_protection"]) == (
        "od-fallback-control", "us-central1", False)
    env = control_env(s)
    settings = json.loads(env["SPOTTRAIN_CONTROL"])["capacity"]
    assert settings["fallback_after_s"] == 1800 and settings["od_group"] == "od-fallback-od-group"
    assert settings["state_object"] == "runs/od-fallback/control/capacity.json"
    assert env["SPOTTRAIN_CODE_OBJECT"].startswith("code/trainer-") and len(env["SPOTTRAIN_CODE_SHA256"]) == 64
    sched = s.one("google_cloud_scheduler_job")
    assert sched["schedule"] == "*/5 * * * *"
    assert sched["http_target"]["uri"] == ("https://run.googleapis.com/v2/projects/my-project-123456/"
                                           "locations/us-central1/jobs/od-fallback-control:run")
    assert sched["http_target"]["oauth_token"]["service_account_email"].startswith("${google_service_account.")
    accounts = {a["account_id"] for a in s.resources("google_service_account")}
    assert accounts == {"od-fallback-trainer", "od-fallback-control"}
    bucket_grants = {g["role"]: g for g in s.resources("google_storage_bucket_iam_member") if "condition" in g}
    assert "/objects/runs/od-fallback/control/" in bucket_grants["roles/storage.objectUser"]["condition"]["expression"]
    # Cloud Scheduler starts it as the job's own account; the trainer's VMs may start it too.
    invokers = s.resources("google_cloud_run_v2_job_iam_member")
    assert {m["role"] for m in invokers} == {"roles/run.invoker"}
    assert sorted(m["member"].split(".")[1].split("_")[0] for m in invokers) == ["control", "identity"]


def test_the_control_job_bootstrap_runs_the_delivered_trainer(tmp_path, gcs_env, synthesized):
    """The container's program, as Cloud Run runs it, as its own service account with what the
    stack grants it: it fetches the archive this stack uploads, refuses a wrong sha256, and runs
    one check against the fakes."""
    from drill.fake_gcp import FakeGcp
    from drill.iam import Policy
    from drill.metadata_server import MetadataServer
    from stacks.control import BOOTSTRAP
    from stacks.delivery import trainer_archive

    archive = trainer_archive(out_dir=tmp_path)
    bucket = gcs_env["bucket"]
    bucket.blob(archive.release.object_name).upload_from_string(archive.path.read_bytes())
    s = synthesized["od-fallback"]
    settings = json.loads(control_env(s)["SPOTTRAIN_CONTROL"])
    settings = {**settings, "bucket": bucket.name, "capacity": {**settings["capacity"], "bucket": bucket.name}}
    with MetadataServer(token="control-token") as md, \
            FakeGcp("my-project-123456", policy=Policy.from_stack(s.json)) as gcp:
        gcp.add_identity("control-token", "serviceAccount:od-fallback-control@my-project-123456.iam.gserviceaccount.com")
        gcp.add_group("od-fallback-group", zone="us-central1-a", auto=True)
        gcp.add_group("od-fallback-od-group", zone="us-central1-a", target_size=0, auto=True)
        run_env = {**os.environ, "GCE_METADATA_HOST": md.host, "SPOTTRAIN_COMPUTE_API": gcp.compute_api,
                   "STORAGE_EMULATOR_HOST": gcs_env["host"], "SPOTTRAIN_BUCKET": bucket.name,
                   "SPOTTRAIN_CODE_OBJECT": archive.release.object_name,
                   "SPOTTRAIN_CODE_SHA256": archive.release.sha256, "SPOTTRAIN_CONTROL": json.dumps(settings),
                   "PYTHONPATH": ""}
        ok = subprocess.run([sys.executable, "-I", "-c", BOOTSTRAP], env=run_env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
        assert ok.returncode == 0, ok.stderr
        assert '"event": "capacity_check"' in ok.stderr and '"mode": "spot"' in ok.stderr
        assert bucket.get_blob("runs/od-fallback/control/capacity.json") is not None
        assert gcp.refusals == []
        bad = subprocess.run([sys.executable, "-I", "-c", BOOTSTRAP],
                             env={**run_env, "SPOTTRAIN_CODE_SHA256": "0" * 64}, cwd=tmp_path,
                             capture_output=True, text=True, timeout=120)
        assert bad.returncode != 0 and "sha256 mismatch" in bad.stderr


@pytest.mark.parametrize("overrides, line", [
    ({"machine": {"provisioning": "standard", "termination_action": None},
      "capacity": {"on_demand_fallback_minutes": 30}},
     'capacity.on_demand_fallback_minutes: falls back from Spot, but provisioning = "standard"'),
    ({"machine": {"machine_type": "a3-highgpu-1g", "gpu_type": "nvidia-h100-80gb"},
      "capacity": {"on_demand_fallback_minutes": 30}},
     "capacity.on_demand_fallback_minutes: a3-highgpu-1g is not offered on demand"),
    ({"capacity": {"on_demand_fallback_minutes": 2}},
     "capacity.on_demand_fallback_minutes: Input should be greater than or equal to 5, got 2"),
])
def test_fallback_validation(overrides, line):
    assert any(p.startswith(f"experiments/x.toml: {line}") for p in problems(overrides)), problems(overrides)


@pytest.fixture
def gcs_env():
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    from drill.gcs_emulator import StorageEmulator

    with StorageEmulator("capacity-test", quiet=True) as emu:
        client = storage.Client(project="p", credentials=AnonymousCredentials(),
                                client_options={"api_endpoint": emu.host})
        yield {"host": emu.host, "bucket": client.bucket("capacity-test")}
