"""One VM spec: the group's template, the on-demand fallback's and a pool's coordinator are the same
VM, and differ only where their own props say."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.xdist_group("stacks")


def _without(d: dict, *keys: str) -> dict:
    return {k: v for k, v in d.items() if k not in keys}


def test_the_fallback_template_is_the_spot_vm_on_demand(synthesized):
    s = synthesized["od-fallback"]
    templates = {t["name_prefix"]: t for t in s.resources("google_compute_instance_template")}
    spot, od = templates["od-fallback-"], templates["od-fallback-od-"]
    assert od["scheduling"] == {"provisioning_model": "STANDARD", "preemptible": False,
                                "automatic_restart": True, "on_host_maintenance": "TERMINATE"}
    assert od["metadata"] == {**spot["metadata"], "spottrain-provisioning": "STANDARD"}
    assert _without(od, "name_prefix", "scheduling", "metadata") == \
        _without(spot, "name_prefix", "scheduling", "metadata")


def test_the_coordinator_is_the_workers_vm(synthesized):
    s = synthesized["l4-pool"]
    template = s.one("google_compute_instance_template")
    vm = s.one("google_compute_instance")
    boot, ckpt = template["disk"][0], template["disk"][1]
    assert vm["boot_disk"]["initialize_params"] == {
        "image": boot["source_image"], "size": boot["disk_size_gb"], "type": boot["disk_type"],
        "labels": boot["labels"]}
    assert vm["attached_disk"][0]["device_name"] == ckpt["device_name"]
    for key in ("machine_type", "labels", "tags", "service_account", "shielded_instance_config"):
        assert vm[key] == template[key], key
    assert vm["network_interface"][0]["subnetwork"] == template["network_interface"][0]["subnetwork"]
    assert vm["metadata_startup_script"] == template["metadata"]["startup-script"]
    # The metadata every VM carries; each its own role and provisioning (the coordinator is on
    # demand: its shutdown window is a standard VM's).
    assert _without(vm["metadata"], "spottrain-role", "spottrain-provisioning") == _without(
        template["metadata"], "startup-script", "spottrain-role", "spottrain-provisioning")
    assert (vm["metadata"]["spottrain-provisioning"], template["metadata"]["spottrain-provisioning"]) == \
        ("STANDARD", "SPOT")
    assert (vm["metadata"]["spottrain-role"], template["metadata"]["spottrain-role"]) == \
        ("coordinator", "worker")


def test_on_machine_takes_the_new_types_gpus_and_interface():
    from stack_support import VARIANTS, variant

    from stacks.boot import BootScripts
    from stacks.vm_spec import vm_spec

    exp = variant(VARIANTS["n1-v100"], "n1")
    vm = vm_spec("n1", exp, service_account_email="sa", subnetwork="net", subnetwork_project=None,
                 network_tag="n1-trainer", scripts=BootScripts("up", "down", "", ""), labels={})
    assert (vm.attach_gpus, vm.gvnic) == (True, False)
    a3 = vm.on_machine("a3-highgpu-8g")
    assert (a3.machine_type, a3.attach_gpus, a3.gvnic) == ("a3-highgpu-8g", False, True)
    assert a3.image == vm.image and a3.scripts == vm.scripts
    od = vm.on_demand()
    assert (od.provisioning, od.flex_max_run_s, vm.provisioning) == ("standard", None, "spot")
    assert vm.metadata(role=None, gpus=False) == {
        "shutdown-script": "down", "enable-oslogin": "TRUE", "block-project-ssh-keys": "TRUE",
        "enable-guest-attributes": "TRUE"}
