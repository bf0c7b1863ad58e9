"""Scale to zero in the synthesized stack: the custom role, its condition, the stop markers that
keep the next deploy at zero, the pool's coordinator, the opt-out, and the VM-side pieces the boot
scripts install."""

from __future__ import annotations

import re

import pytest
from stack_support import VARIANTS, unless_stopped, variant

from stacks.boot import boot_props, render
from trainer import scale

pytestmark = pytest.mark.xdist_group("stacks")


def role(s) -> dict:
    return s.one("google_project_iam_custom_role")


def conditional(s) -> dict:
    (binding,) = [m for m in s.resources("google_project_iam_member") if "condition" in m]
    return binding


def test_the_role_holds_only_the_verbs_the_vm_needs(example, synthesized):
    assert role(example)["role_id"] == "spottrain_example_scale"
    assert sorted(role(example)["permissions"]) == ["compute.instanceGroupManagers.get",
                                                    "compute.instanceGroupManagers.update"]
    pooled = role(synthesized["l4-pool"])
    assert sorted(pooled["permissions"]) == ["compute.instanceGroupManagers.get",
                                             "compute.instanceGroupManagers.update",
                                             "compute.instances.get", "compute.instances.stop"]


def test_the_binding_is_conditioned_on_the_one_group(example, synthesized):
    b = conditional(example)
    assert b["role"].startswith("${google_project_iam_custom_role.")
    assert b["member"].startswith("serviceAccount:${google_service_account.")
    assert b["condition"]["expression"] == (
        'resource.name == "projects/my-project-123456/zones/us-central1-a/instanceGroupManagers/example-group"')
    regional = conditional(synthesized["regional"])["condition"]["expression"]
    assert regional == ('resource.name == "projects/my-project-123456/regions/us-central1/'
                        'instanceGroupManagers/regional-group"')


def test_a_pool_may_stop_its_coordinator_and_no_other_vm(synthesized):
    pooled = synthesized["l4-pool"]
    (inst,) = pooled.resources("google_compute_instance_iam_member")
    assert inst["instance_name"].startswith("${google_compute_instance.")
    assert inst["zone"] == "us-central1-a" and inst["role"].startswith("${google_project_iam_custom_role.")
    vm = pooled.one("google_compute_instance")
    assert unless_stopped(vm["desired_status"]) == "RUNNING"
    assert '"TERMINATED"' in vm["desired_status"]  # once the job has stopped itself


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


def test_opting_out_creates_no_role_and_the_vm_only_says_so(synthesized):
    s = synthesized["no-stop"]
    assert s.resources("google_project_iam_custom_role") == []
    assert "data" not in s.json
    assert s.one("google_compute_instance_group_manager")["target_size"] == 1
    scripts = render(boot_props("no-stop", variant(VARIANTS["no-stop"], "no-stop")))
    assert scripts.scale_settings == ""
    assert "stop_when_done = false" in scripts.stop_paying and "trainer.scale" not in scripts.stop_paying
    assert "trainer.scale --config /etc/spottrain/scale.json honour" not in scripts.startup


def test_the_vm_gets_its_settings_the_wrapper_and_the_exit_0_hook(example, tmp_path):
    scripts = render(boot_props("example", example.spec))
    path = tmp_path / "scale.json"
    path.write_text(scripts.scale_settings)
    settings = scale.Settings.load(path)  # what the VM's call reads
    assert settings.groups == ("example-group",) and settings.location == "zones/us-central1-a"
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
