"""Scale to zero in the synthesized stack: who may resize the groups (the control job, never the
VM), the stop markers that keep the next deploy at zero, the pool's coordinator, the opt-out, and
the VM-side pieces the boot scripts install. The grants are read back the way the fakes enforce
them (`drill.iam.Policy.from_stack`), so a grant Google would not honour fails here."""

from __future__ import annotations

import re

import pytest
from stack_support import VARIANTS, unless_stopped, variant

from drill.iam import Policy, Resource
from stacks.boot import boot_props, render
from stacks.control import COORDINATOR_PERMISSIONS, GROUP_PERMISSIONS, LIST_PERMISSIONS
from trainer.cloud import scale

pytestmark = pytest.mark.xdist_group("stacks")
P = "my-project-123456"


def sa(name: str) -> str:
    return f"serviceAccount:{name}@{P}.iam.gserviceaccount.com"


def group(name: str, location: str = "zones/us-central1-a") -> Resource:
    kind = "RegionInstanceGroupManager" if location.startswith("regions/") else "InstanceGroupManager"
    return Resource("compute.googleapis.com", f"compute.googleapis.com/{kind}",
                    f"projects/{P}/{location}/instanceGroupManagers/{name}", (f"projects/{P}",))


def instance(name: str) -> Resource:
    return Resource("compute.googleapis.com", "compute.googleapis.com/Instance",
                    f"projects/{P}/zones/us-central1-a/instances/{name}", (f"projects/{P}",))


def job(name: str) -> Resource:
    return Resource("run.googleapis.com", "run.googleapis.com/Job",
                    f"projects/{P}/locations/us-central1/jobs/{name}", (f"projects/{P}",))


OPERATION = Resource("compute.googleapis.com", "compute.googleapis.com/Operation",
                     f"projects/{P}/zones/us-central1-a/operations/operation-1", (f"projects/{P}",))


@pytest.mark.parametrize("name", ["example", "regional", "l4-pool", "flex-start", "od-fallback"])
def test_the_vm_may_start_its_control_job_and_touch_no_group_or_vm(synthesized, name):
    s = synthesized[name]
    policy, vm = Policy.from_stack(s.json), sa(f"{name}-trainer")
    assert policy.allows(vm, "run.jobs.run", job(f"{name}-control"))
    assert not policy.allows(vm, "run.jobs.run", job("someone-else-control"))
    where = "regions/us-central1" if name == "regional" else "zones/us-central1-a"
    for permission in GROUP_PERMISSIONS:
        assert not policy.allows(vm, permission, group(f"{name}-group", where))
    for permission in COORDINATOR_PERMISSIONS:
        assert not policy.allows(vm, permission, instance(f"{name}-coordinator"))
    assert not policy.allows(vm, "compute.zoneOperations.get", OPERATION)


@pytest.mark.parametrize("name, where", [("example", "zones/us-central1-a"), ("regional", "regions/us-central1")])
def test_the_control_job_resizes_its_groups_with_a_grant_google_honours(synthesized, name, where):
    s = synthesized[name]
    policy, control = Policy.from_stack(s.json), sa(f"{name}-control")
    for permission in GROUP_PERMISSIONS:
        assert policy.allows(control, permission, group(f"{name}-group", where))
    # No condition: none can name a group (it would never grant), so none pretends to.
    (binding,) = [m for m in s.resources("google_project_iam_member") if m["role"].startswith("${")]
    assert "condition" not in binding
    roles = {r["role_id"]: sorted(r["permissions"]) for r in s.resources("google_project_iam_custom_role")}
    assert roles == {f"spottrain_{name}_control": sorted(GROUP_PERMISSIONS),
                     f"spottrain_{name}_control_list": sorted(LIST_PERMISSIONS)}
    # ...and it cannot wait on operations, read or stop VMs: it confirms from the group itself.
    assert not policy.allows(control, "compute.zoneOperations.get", OPERATION)
    assert not policy.allows(control, "compute.instances.stop", instance(f"{name}-group-abcd"))


def test_a_pools_control_job_may_stop_its_coordinator_and_no_other_vm(synthesized):
    pooled = synthesized["l4-pool"]
    policy, control = Policy.from_stack(pooled.json), sa("l4-pool-control")
    for permission in COORDINATOR_PERMISSIONS:
        assert policy.allows(control, permission, instance("l4-pool-coordinator"))
        assert not policy.allows(control, permission, instance("l4-pool-group-abcd"))
    (inst,) = pooled.resources("google_compute_instance_iam_member")
    assert inst["instance_name"].startswith("${google_compute_instance.")
    vm = pooled.one("google_compute_instance")
    assert unless_stopped(vm["desired_status"]) == "RUNNING"
    assert '"TERMINATED"' in vm["desired_status"]  # once the job has stopped itself


def test_the_control_job_reads_markers_and_code_and_writes_only_its_own_objects(synthesized):
    """Its own objects, the markers, and what verifies a marker: the checkpoints' manifests and
    the bucket's listing (names and sizes; the only permission its list role holds), never
    another object's content, never a write outside `control/`."""
    s = synthesized["example"]
    policy, control = Policy.from_stack(s.json), sa("example-control")
    bucket = "my-project-123456-example-ckpt"

    def obj(name: str) -> Resource:
        return Resource("storage.googleapis.com", "storage.googleapis.com/Object",
                        f"projects/_/buckets/{bucket}/objects/{name}", (f"projects/{P}", f"projects/_/buckets/{bucket}"))

    assert policy.allows(control, "storage.objects.get", obj("runs/example/stop/finished-steps-20000.json"))
    assert policy.allows(control, "storage.objects.get", obj("code/trainer-0123456789abcdef.tar.gz"))
    for permission in ("storage.objects.get", "storage.objects.create", "storage.objects.delete"):
        assert policy.allows(control, permission, obj("runs/example/control/outcome.json"))
    assert policy.allows(control, "storage.objects.get", obj("runs/example/step-00000100/manifest.json"))
    bucket_resource = Resource("storage.googleapis.com", "storage.googleapis.com/Bucket",
                               f"projects/_/buckets/{bucket}", (f"projects/{P}",))
    assert policy.allows(control, "storage.objects.list", bucket_resource)
    for other in ("runs/example/lease.json", "runs/example/goodput/s/events.jsonl", "runs/other/stop/x.json"):
        assert not policy.allows(control, "storage.objects.get", obj(other))
    assert not policy.allows(control, "storage.objects.create", obj("runs/example/step-00000100/manifest.json"))
    assert not policy.allows(control, "storage.objects.create", obj("runs/example/stop/finished-steps-20000.json"))
    assert not policy.allows(control, "storage.objects.create", obj("code/trainer-0123456789abcdef.tar.gz"))


def test_the_next_deploy_keeps_a_stopped_job_at_zero(example):
    data = example.json["data"]["google_storage_bucket_objects"]
    prefixes = sorted(d["prefix"] for d in data.values())
    startup = example.one("google_compute_instance_template")["metadata"]["startup-script"]
    assert prefixes == sorted(scale.markers("runs/example", 20000, scale.digest(startup)).values())
    buckets = [f"google_storage_bucket.{k}" for k in example.json["resource"]["google_storage_bucket"]]
    assert all(set(buckets) <= set(d["depends_on"]) for d in data.values())
    size = example.one("google_compute_instance_group_manager")["target_size"]
    keys = [f"length(data.google_storage_bucket_objects.{k}.bucket_objects)" for k in data]
    assert all(k in size for k in keys) and size.endswith("> 0) ? 0 : 1}")
    assert unless_stopped(size) == 1


def test_workers_zero_needs_no_marker_and_stays_a_plain_zero():
    from stack_support import Synthesized

    s = Synthesized("paused", variant({"group": {"workers": 0}}, "paused"))
    assert s.one("google_compute_instance_group_manager")["target_size"] == 0


def test_opting_out_creates_no_control_job_and_the_vm_only_says_so(synthesized):
    s = synthesized["no-stop"]
    assert s.resources("google_project_iam_custom_role") == []
    assert s.resources("google_cloud_run_v2_job") == [] and s.resources("google_cloud_scheduler_job") == []
    assert "data" not in s.json
    assert s.one("google_compute_instance_group_manager")["target_size"] == 1
    scripts = render(boot_props("no-stop", variant(VARIANTS["no-stop"], "no-stop")))
    assert scripts.scale_settings == ""
    assert "stop_when_done = false" in scripts.stop_paying and "trainer.cloud.scale" not in scripts.stop_paying
    assert "trainer.cloud.scale --config /etc/spottrain/scale.json honour" not in scripts.startup


def test_the_vm_gets_its_settings_the_wrapper_and_the_exit_0_hook(example, tmp_path):
    scripts = render(boot_props("example", example.spec))
    path = tmp_path / "scale.json"
    path.write_text(scripts.scale_settings)
    settings = scale.Settings.load(path)  # what the VM's call reads
    assert settings.job == f"projects/{P}/locations/us-central1/jobs/example-control"
    assert (settings.prefix, settings.steps, settings.bucket) == ("runs/example", 20000,
                                                                   "my-project-123456-example-ckpt")
    assert "/etc/spottrain/stop_paying.sh finished" in scripts.trainer_sh
    assert re.search(r"write_if_changed /etc/spottrain/stop_paying.sh 0755 ", scripts.startup)
    assert re.search(r"write_if_changed /etc/spottrain/scale.json 0644 ", scripts.startup)
    # A finished run found on the disk stops again, before any wait for the GPU driver.
    finished = scripts.startup.index('if [[ -f "$FINISHED" ]]')
    assert finished < scripts.startup.index("until nvidia-smi")
    assert scripts.startup.index("stop_paying.sh finished", finished) < scripts.startup.index("until nvidia-smi")


def test_outputs_name_the_stop_markers(example):
    out = example.json["output"]["stop_markers"]["value"]
    assert out.startswith("gs://my-project-123456-example-ckpt/runs/example/stop/finished-steps-20000.json ")
