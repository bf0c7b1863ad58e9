"""The synthesized stacks: every resource and property the training environment depends on."""

from __future__ import annotations

import json
import re

import pytest
from stack_support import VARIANTS, Synthesized, unless_stopped, variant

from stacks.boot import DEVICE_NAME

pytestmark = pytest.mark.xdist_group("stacks")

GPU_FAMILIES = {
    # variant: (machine_type, gpu_type, count, attached)
    "a3-h100": ("a3-highgpu-8g", "nvidia-h100-80gb", 8, False),
    "a2-a100-40": ("a2-highgpu-2g", "nvidia-tesla-a100", 2, False),
    "a2-a100-80": ("a2-ultragpu-1g", "nvidia-a100-80gb", 1, False),
    "example": ("g2-standard-8", "nvidia-l4", 1, False),
    "g2-l4x4": ("g2-standard-48", "nvidia-l4", 4, False),
    "n1-t4": ("n1-standard-8", "nvidia-tesla-t4", 1, True),
    "n1-v100": ("n1-highmem-8", "nvidia-tesla-v100", 2, True),
    "n1-p100": ("n1-standard-16", "nvidia-tesla-p100", 1, True),
    "n1-p4": ("n1-standard-4", "nvidia-tesla-p4", 4, True),
}


def ref(s: Synthesized, kind: str) -> str:
    """The Terraform address prefix of the one resource of `kind`, as other resources cite it (of
    the service accounts: the trainer's; the control job's is tests/stacks/test_scale_to_zero.py's)."""
    (key,) = [k for k, r in s.json["resource"][kind].items()
              if kind != "google_service_account" or r["account_id"].endswith("-trainer")]
    return f"${{{kind}.{key}"


# --- identity ------------------------------------------------------------------------------------


def test_dedicated_service_account_with_least_privilege(example):
    accounts = {a["account_id"] for a in example.resources("google_service_account")}
    assert accounts == {"example-trainer", "example-control"}  # the VMs', the control job's
    member = f"serviceAccount:{ref(example, 'google_service_account')}.email}}"
    # Project roles: logs and metrics only (the VM changes no group: tests/stacks/test_scale_to_zero.py).
    roles = {m["role"] for m in example.resources("google_project_iam_member") if m["member"] == member}
    assert roles == {"roles/logging.logWriter", "roles/monitoring.metricWriter"}
    # Object admin on the checkpoint bucket only, as a bucket-level binding.
    (grant,) = [g for g in example.resources("google_storage_bucket_iam_member") if g["member"] == member]
    assert grant["role"] == "roles/storage.objectAdmin"
    assert grant["bucket"] == f"{ref(example, 'google_storage_bucket')}.name}}"
    assert not any("storage" in m["role"] for m in example.resources("google_project_iam_member"))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_no_default_compute_service_account_anywhere(synthesized, name):
    s = synthesized[name]
    text = s.text
    assert "-compute@developer.gserviceaccount.com" not in text
    # Every template (the on-demand fallback adds one) runs as the trainer's own account.
    trainer = [k for k, a in s.json["resource"]["google_service_account"].items()
               if a["account_id"].endswith("-trainer")]
    for template in s.resources("google_compute_instance_template"):
        assert template["service_account"]["email"] == (
            f"${{google_service_account.{trainer[0]}.email}}"
        )


def test_group_waits_for_every_grant(example):
    """Every grant of the trainer's account (its VMs use them from the first boot: a short job may
    finish and start its control job minutes after the deploy), and the APIs."""
    group = example.one("google_compute_instance_group_manager")
    member = f"serviceAccount:{ref(example, 'google_service_account')}.email}}"
    grants = [f"{kind}.{key}" for kind in ("google_project_iam_member",
                                           "google_storage_bucket_iam_member",
                                           "google_secret_manager_secret_iam_member",
                                           "google_cloud_run_v2_job_iam_member",
                                           "google_project_service")
              for key, r in example.json["resource"][kind].items() if r.get("member", member) == member]
    assert sorted(group["depends_on"]) == sorted(grants)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_checkpoint_key_secret_only_the_trainer_can_read(synthesized, name):
    """The key that authenticates checkpoints: a secret without a version (the key never reaches
    Terraform), readable and fillable by the trainer's account on that one secret, named in the
    boot; readable (never fillable) by the control job's account, which verifies stop markers
    with it; no bucket role reaches it."""
    s = synthesized[name]
    secret = s.one("google_secret_manager_secret")
    (trainer, account), = [(k, a) for k, a in s.json["resource"]["google_service_account"].items()
                           if a["account_id"].endswith("-trainer")]
    assert secret["secret_id"] == f"{account['account_id'].removesuffix('-trainer')}-checkpoint-key"
    assert "google_secret_manager_secret_version" not in s.json["resource"]
    member = f"serviceAccount:${{google_service_account.{trainer}.email}}"
    grants = s.resources("google_secret_manager_secret_iam_member")
    assert sorted(g["role"] for g in grants if g["member"] == member) == ["roles/secretmanager.secretAccessor",
                                                                          "roles/secretmanager.secretVersionAdder"]
    controls = [k for k, a in s.json["resource"]["google_service_account"].items()
                if a["account_id"].endswith("-control")]
    assert sorted((g["member"], g["role"]) for g in grants if g["member"] != member) == [
        (f"serviceAccount:${{google_service_account.{c}.email}}", "roles/secretmanager.secretAccessor")
        for c in controls]
    assert all(g["secret_id"] == f"{ref(s, 'google_secret_manager_secret')}.secret_id}}" for g in grants)
    assert not any("secretmanager" in m["role"] for m in s.resources("google_project_iam_member"))
    name_ = f"projects/{secret['project']}/secrets/{secret['secret_id']}"
    startup = s.text
    assert f"KEY_SECRET={name_}" in startup and "--checkpoint-key-file /run/spottrain/checkpoint.key" in startup


def test_the_bucket_and_its_key_are_kept_by_destroy_unless_the_bucket_may_be_destroyed(synthesized):
    """Kept means forgotten by Terraform and left in the project (`deletion_policy = "ABANDON"`),
    never a refusal that leaves the destroy unfinished (tests/stacks/test_deploy.py runs it)."""
    for name, s in synthesized.items():
        bucket, key = s.one("google_storage_bucket"), s.one("google_secret_manager_secret")
        keep = not bucket["force_destroy"]
        assert bucket.get("deletion_policy") == key.get("deletion_policy") == (
            "ABANDON" if keep else None), name
        assert key["deletion_protection"] is False, name


# --- APIs ----------------------------------------------------------------------------------------


def _apis(s: Synthesized) -> dict[str, dict]:
    return {f"google_project_service.{k}": v
            for k, v in s.json["resource"]["google_project_service"].items()}


BASE_APIS = {"compute.googleapis.com", "iam.googleapis.com", "storage.googleapis.com",
             "cloudresourcemanager.googleapis.com", "secretmanager.googleapis.com",
             # the run's log-based metrics, alerts and dashboard (docs/watch.md)
             "logging.googleapis.com", "monitoring.googleapis.com"}
ALL_STACKS = [*VARIANTS, "l4-pool", "a3-regional", "n1-v100-standard", "cnn"]


@pytest.mark.parametrize("name", ALL_STACKS)
def test_every_resource_type_in_the_stack_has_its_api_enabled(synthesized, name):
    """Read from the synthesized JSON, not from the constructs: each resource and data source type
    against the one table of which API serves it (an unknown google_* type fails here too)."""
    from stacks.apis import PREREQUISITE, service_of

    s = synthesized[name]
    enabled = {a["service"] for a in _apis(s).values()} | {PREREQUISITE}
    types = [*s.json["resource"], *(f"data.{t}" for t in s.json.get("data", {}))]
    missing = {t: service_of(t) for t in types if service_of(t) not in enabled}
    assert missing == {}
    assert BASE_APIS <= enabled


#: The control job (stacks/control.py: scale to zero, the fallback's check) and its schedule.
CONTROL_APIS = {"run.googleapis.com", "cloudscheduler.googleapis.com"}


@pytest.mark.parametrize(("name", "more"), [
    ("example", CONTROL_APIS),
    ("l4-pool", {"dns.googleapis.com", *CONTROL_APIS}),  # the pool's private zone and query logging
    ("od-fallback", CONTROL_APIS),
    ("watch", {"pubsub.googleapis.com", "billingbudgets.googleapis.com", *CONTROL_APIS}),  # a topic's grant, the budget
])
def test_the_apis_are_exactly_those_of_the_resources(synthesized, name, more):
    assert {a["service"] for a in _apis(synthesized[name]).values()} == BASE_APIS | more


@pytest.mark.parametrize("name", ALL_STACKS)
def test_preflight_checks_no_api_the_stack_does_not_need(synthesized, name):
    from stacks.preflight import required_apis

    s = synthesized[name]
    assert set(required_apis(s.spec)) <= {a["service"] for a in _apis(s).values()}


def test_a_resource_type_without_an_api_fails_synthesis_and_so_does_one_added_too_late():
    from cdktn import TerraformResource, Testing

    from stacks.stack import TrainingStack

    for kind, message in [
        ("google_pubsub_topic", "google_pubsub_topic: no API known for this Terraform type; add "
                                "it to SERVICE_OF in stacks/apis.py"),
        ("google_dns_policy", "google_dns_policy (example/late) needs dns.googleapis.com, which "
                              "this stack does not enable"),
    ]:
        stack = TrainingStack(Testing.app(), "example", variant({}, "example"))
        TerraformResource(stack, "late", terraform_resource_type=kind)
        with pytest.raises(Exception, match=re.escape(message)):
            Testing.synth(stack)


@pytest.mark.parametrize("name", ["example", "l4-pool", "existing-net", "od-fallback"])
def test_the_stack_enables_the_apis_it_uses_and_everything_waits_for_them(synthesized, name):
    s = synthesized[name]
    apis = _apis(s)
    services = {a["service"] for a in apis.values()}
    assert {"compute.googleapis.com", "iam.googleapis.com", "storage.googleapis.com",
            "secretmanager.googleapis.com"} <= services
    if s.resources("google_cloud_run_v2_job"):  # the control job (stacks/control.py) and its schedule
        assert {"run.googleapis.com", "cloudscheduler.googleapis.com"} <= services
    assert ("dns.googleapis.com" in services) == bool(s.resources("google_dns_managed_zone")
                                                      or s.resources("google_dns_policy"))
    for api in apis.values():
        # Shared by the whole project: a destroy never switches an API off.
        assert api["disable_on_destroy"] is False
        assert api["project"] == "my-project-123456"
    # Every resource and data source waits for every API (so none meets a disabled one).
    blocks = [*s.json["resource"].items(), *s.json.get("data", {}).items()]
    waiting = [(kind, key, r) for kind, rs in blocks if kind != "google_project_service"
               for key, r in rs.items()]
    assert len(waiting) >= 10
    for kind, key, r in waiting:
        assert set(apis) <= set(r.get("depends_on", [])), f"{kind}.{key}"


# --- bucket --------------------------------------------------------------------------------------


def test_checkpoint_bucket_is_private_and_soft_deletes_without_versions(example):
    """Soft delete protects deleted and overwritten checkpoints; versions on top would keep each
    rotated checkpoint twice as long for nothing (every object is create-only)."""
    b = example.one("google_storage_bucket")
    assert b["name"] == "my-project-123456-example-ckpt"
    assert b["location"] == "US-CENTRAL1"
    assert b["uniform_bucket_level_access"] is True
    assert b["public_access_prevention"] == "enforced"
    assert b["versioning"] == {"enabled": False}
    assert b["lifecycle_rule"] == [{"action": {"type": "Delete"}, "condition": {
        "age": 1, "matches_prefix": ["runs/example/.tmp-parts/"]}}]  # only a cut-off upload's parts
    assert b["force_destroy"] is False
    assert b["soft_delete_policy"] == {"retention_duration_seconds": 7 * 86400}
    assert b["labels"] == {"team": "ml", "purpose": "example", "spottrain-experiment": "example"}


def test_versioning_on_request_prunes_noncurrent_versions():
    from cdktn import Testing

    from stacks.stack import TrainingStack

    exp = variant({"bucket": {"versioning": True, "keep_noncurrent_versions": 2,
                              "noncurrent_days": 3}}, "versioned")
    synth = json.loads(Testing.synth(TrainingStack(Testing.app(), "versioned", exp)))
    (b,) = synth["resource"]["google_storage_bucket"].values()
    assert b["versioning"] == {"enabled": True}
    conditions = [r["condition"] for r in b["lifecycle_rule"]]
    assert all(r["action"] == {"type": "Delete"} for r in b["lifecycle_rule"])
    assert {"with_state": "ARCHIVED", "num_newer_versions": 2} in conditions
    assert {"with_state": "ARCHIVED", "days_since_noncurrent_time": 3} in conditions
    # No rule ever touches live (current) checkpoints: only a cut-off upload's parts.
    assert all(c.get("with_state") == "ARCHIVED" or c.get("matches_prefix") == ["runs/versioned/.tmp-parts/"]
               for c in conditions)


def _lifecycle_deletes(rule: dict, name: str, age_days: float) -> bool:
    """Cloud Storage's reading of one Delete rule on a live object (cloud.google.com/storage/docs/
    lifecycle#conditions): every condition holds; `age` in days since creation, `matches_prefix`
    any of the prefixes; a `with_state` of ARCHIVED never matches a live object."""
    c = rule["condition"]
    return (rule["action"]["type"] == "Delete" and c.get("with_state", "ANY") in ("ANY", "LIVE")
            and age_days >= c.get("age", 0)
            and any(name.startswith(p) for p in c.get("matches_prefix", [""]))
            and "num_newer_versions" not in c and "days_since_noncurrent_time" not in c)


@pytest.mark.parametrize("versioning", [False, True])
def test_a_cut_off_uploads_parts_are_deleted_a_day_on_and_nothing_else_live_ever(versioning, tmp_path):
    """An aborted composite upload leaves parts that only a later restore deletes: a run that never
    restarts would be billed for them forever. The names are the trainer's own store's."""
    from cdktn import Testing

    from stacks import bucket
    from stacks.stack import TrainingStack
    from trainer.checkpoint.gcs_streams import PARTS_DIR
    from trainer.checkpoint.stores import GcsStore

    assert bucket.PARTS_DIR == PARTS_DIR
    exp = variant({"bucket": {"versioning": versioning}}, "parts")
    synth = json.loads(Testing.synth(TrainingStack(Testing.app(), "parts", exp)))
    (b,) = synth["resource"]["google_storage_bucket"].values()
    class NoNetwork:  # the store only names objects here
        def bucket(self, name: str) -> object:
            return object()

    store = GcsStore(f"gs://{b['name']}/runs/parts", client=NoNetwork())
    part = store._object(f"{PARTS_DIR}/step-00000120/model.pt.abc/03")
    live = [store._object("step-00000120/model.pt"), store._object("ledger.jsonl"), "runs/parts-big/x"]

    def deleted(name: str, age: float) -> bool:
        return any(_lifecycle_deletes(r, name, age) for r in b.get("lifecycle_rule", []))

    assert deleted(part, 1.0) and not deleted(part, 0.5)
    assert not any(deleted(name, 365.0) for name in live)


def test_force_destroy_only_when_the_experiment_opts_in(synthesized):
    assert synthesized["existing-net"].one("google_storage_bucket")["force_destroy"] is True
    assert synthesized["existing-net"].one("google_storage_bucket")["name"] == (
        "explicit-ckpt-bucket"
    )
    for name in VARIANTS:
        if name != "existing-net":
            assert synthesized[name].one("google_storage_bucket")["force_destroy"] is False


# --- network -------------------------------------------------------------------------------------


def test_dedicated_network_is_private_with_nat(example):
    vpc = example.one("google_compute_network")
    assert vpc["auto_create_subnetworks"] is False
    subnet = example.one("google_compute_subnetwork")
    assert subnet["private_ip_google_access"] is True
    assert subnet["ip_cidr_range"] == "10.20.0.0/24"
    assert subnet["region"] == "us-central1"
    assert subnet["network"] == f"{ref(example, 'google_compute_network')}.id}}"
    router = example.one("google_compute_router")
    nat = example.one("google_compute_router_nat")
    assert nat["router"] == f"{ref(example, 'google_compute_router')}.name}}"
    assert router["network"] == f"{ref(example, 'google_compute_network')}.id}}"
    assert nat["nat_ip_allocate_option"] == "AUTO_ONLY"
    template = example.one("google_compute_instance_template")
    (nic,) = template["network_interface"]
    assert nic["subnetwork"] == f"{ref(example, 'google_compute_subnetwork')}.id}}"


@pytest.mark.parametrize("name", list(VARIANTS))
def test_no_external_ip_and_nothing_open_to_the_world(synthesized, name):
    s = synthesized[name]
    for template in s.resources("google_compute_instance_template"):
        for nic in template["network_interface"]:
            assert "access_config" not in nic
    assert "0.0.0.0/0" not in s.text
    for rule in s.resources("google_compute_firewall"):
        assert rule["direction"] == "INGRESS"
        assert rule["target_tags"] == [f"{name}-trainer"]


def test_firewall_admits_health_checkers_to_the_health_port_and_iap_to_ssh(example):
    rules = {r["name"]: r for r in example.resources("google_compute_firewall")}
    hc = rules["example-allow-health-check"]
    assert hc["source_ranges"] == ["35.191.0.0/16", "130.211.0.0/22"]
    assert hc["allow"] == [{"protocol": "tcp", "ports": ["8471"]}]
    ssh = rules["example-allow-iap-ssh"]
    assert ssh["source_ranges"] == ["35.235.240.0/20"]
    assert ssh["allow"] == [{"protocol": "tcp", "ports": ["22"]}]
    template = example.one("google_compute_instance_template")
    assert template["tags"] == ["example-trainer"]


def test_existing_network_creates_no_network_and_targets_the_host_project(synthesized):
    s = synthesized["existing-net"]
    for kind in ("google_compute_network", "google_compute_subnetwork", "google_compute_router",
                 "google_compute_router_nat"):
        assert s.resources(kind) == []
    (nic,) = s.one("google_compute_instance_template")["network_interface"]
    assert nic == {"subnetwork": "trainers", "subnetwork_project": "host-project-42"}
    (rule,) = s.resources("google_compute_firewall")  # iap_ssh = false: health check only
    assert rule["network"] == "projects/host-project-42/global/networks/shared-vpc"
    assert rule["project"] == "host-project-42"
    assert rule["allow"] == [{"protocol": "tcp", "ports": ["8471"]}]


def test_shared_vpc_grants_network_user_to_the_service_agent_when_asked(synthesized, example):
    """The group creates VMs as the service project's Google APIs service agent; without Network
    User on the host subnetwork it creates none (and says so only in list-errors)."""
    s = synthesized["existing-net"]  # shared_vpc_network_user = "grant"
    grant = s.one("google_compute_subnetwork_iam_member")
    (project_key,) = s.json["data"]["google_project"]
    assert s.json["data"]["google_project"][project_key]["project_id"] == "my-project-123456"
    assert grant["project"] == "host-project-42"
    assert (grant["region"], grant["subnetwork"]) == ("us-central1", "trainers")
    assert grant["role"] == "roles/compute.networkUser"
    assert grant["member"] == (f"serviceAccount:${{data.google_project.{project_key}.number}}"
                               "@cloudservices.gserviceaccount.com")
    (grant_key,) = s.json["resource"]["google_compute_subnetwork_iam_member"]
    group = s.one("google_compute_instance_group_manager")
    assert f"google_compute_subnetwork_iam_member.{grant_key}" in group["depends_on"]
    # "granted": the admin did it; the stack leaves the host project's IAM alone.
    assert synthesized["n1-v100-standard"].resources("google_compute_subnetwork_iam_member") == []
    assert example.resources("google_compute_subnetwork_iam_member") == []
    assert "google_project" not in example.json.get("data", {})


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_stack_says_how_to_see_why_the_group_made_no_vm(synthesized, name):
    s = synthesized[name]
    out = {k: v["value"] for k, v in s.json["output"].items()}
    regional = VARIANTS[name].get("group", {}).get("placement") == "regional"
    where = "--region us-central1" if regional else "--zone us-central1-a"
    assert out["list_errors_command"] == (
        f"gcloud compute instance-groups managed list-errors {name}-group "
        f"--project my-project-123456 {where}")


# --- instance template ---------------------------------------------------------------------------


def test_template_is_replaced_not_edited(example):
    t = example.one("google_compute_instance_template")
    assert t["name_prefix"] == "example-"
    assert "name" not in t
    assert t["lifecycle"] == {"create_before_destroy": True}


def test_spot_scheduling(example):
    assert example.one("google_compute_instance_template")["scheduling"] == {
        "provisioning_model": "SPOT",
        "preemptible": True,
        "automatic_restart": False,
        "on_host_maintenance": "TERMINATE",
        "instance_termination_action": "DELETE",
    }


def test_delete_is_the_default_termination_action_and_stop_reaches_the_template():
    """In a group a preempted VM is recreated whatever the action: DELETE is the honest default."""
    from cdktn import Testing

    from stacks.stack import TrainingStack

    data = {"machine": {"termination_action": None}}
    assert variant(data).machine.termination_action == "DELETE"
    stack = TrainingStack(Testing.app(), "stopping",
                          variant({"machine": {"termination_action": "STOP"}}, "stopping"))
    t = json.loads(Testing.synth(stack))["resource"]["google_compute_instance_template"]
    (template,) = t.values()
    assert template["scheduling"]["instance_termination_action"] == "STOP"


def test_standard_provisioning(synthesized):
    assert synthesized["standard"].one("google_compute_instance_template")["scheduling"] == {
        "provisioning_model": "STANDARD",
        "preemptible": False,
        "automatic_restart": True,
        "on_host_maintenance": "TERMINATE",
    }


@pytest.mark.parametrize("name", list(GPU_FAMILIES))
def test_gpus_attached_only_where_the_family_needs_it(synthesized, name):
    machine_type, gpu_type, count, attached = GPU_FAMILIES[name]
    t = synthesized[name].one("google_compute_instance_template")
    assert t["machine_type"] == machine_type
    if attached:
        assert t["guest_accelerator"] == [{"type": gpu_type, "count": count}]
    else:
        assert "guest_accelerator" not in t
    assert t["scheduling"]["on_host_maintenance"] == "TERMINATE"
    (nic,) = t["network_interface"]
    assert nic.get("nic_type") == ("GVNIC" if machine_type.startswith("a3-") else None)


def test_image_shielded_vm_and_metadata(example):
    t = example.one("google_compute_instance_template")
    boot = next(d for d in t["disk"] if d.get("boot"))
    assert boot["source_image"] == (
        "projects/deeplearning-platform-release/global/images/family/"
        "pytorch-2-9-cu129-ubuntu-2204-nvidia-580"
    )
    assert boot["disk_size_gb"] == 200
    assert t["shielded_instance_config"] == {
        "enable_secure_boot": False, "enable_vtpm": True, "enable_integrity_monitoring": True,
    }
    md = t["metadata"]
    assert md["enable-oslogin"] == "TRUE"
    assert md["block-project-ssh-keys"] == "TRUE"
    assert md["install-nvidia-driver"] == "True"
    assert md["startup-script"].startswith("#!/bin/bash\n")
    assert md["shutdown-script"].startswith("#!/bin/bash\n")
    assert "--gcs-uri gs://my-project-123456-example-ckpt/runs/example" in md["startup-script"]
    assert "serial-port-enable" not in md
    assert t["labels"]["spottrain-experiment"] == "example"


def test_checkpoint_disk_is_pd_ssd_with_the_fixed_device_name(example):
    t = example.one("google_compute_instance_template")
    (disk,) = [d for d in t["disk"] if d.get("device_name") == DEVICE_NAME]
    assert disk["disk_type"] == "pd-ssd"
    assert disk["disk_size_gb"] == 300
    assert disk["type"] == "PERSISTENT"
    assert not disk["boot"]
    # The group's stateful policy decides its deletion; Compute Engine's own deletion of a
    # preempted VM must not take it (a hedge: undocumented for stateful disks).
    assert disk["auto_delete"] is False
    assert f"/dev/disk/by-id/google-{DEVICE_NAME}" in t["metadata"]["startup-script"]


def _template_key(ref: str) -> str:
    """`${google_compute_instance_template.KEY.self_link_unique}` -> KEY."""
    return ref.removeprefix("${google_compute_instance_template.").split(".", 1)[0]


@pytest.mark.parametrize("name", [*VARIANTS, "l4-pool", "a3-regional", "n1-v100-standard"])
def test_no_checkpoint_disk_outlives_its_vm_unnoticed(synthesized, name):
    """A template disk with auto_delete = false is deleted by nothing but a stateful policy: in a
    group that keeps no stateful disk of that device name (flex-start, a zone change on repair),
    every VM the group or Compute Engine deletes would leave a disk Terraform does not know."""
    s = synthesized[name]
    templates = s.json["resource"]["google_compute_instance_template"]
    groups = (s.resources("google_compute_instance_group_manager")
              + s.resources("google_compute_region_instance_group_manager"))
    used = 0
    for group in groups:
        stateful = {d["device_name"] for d in group.get("stateful_disk", [])}
        for version in group["version"]:
            used += 1
            for disk in templates[_template_key(version["instance_template"])]["disk"]:
                if not disk["auto_delete"]:
                    assert disk.get("device_name") in stateful, (name, disk)
    assert used == len(templates)  # every template is some group's


def test_local_ssds_are_optional(example, synthesized):
    def scratch(s):
        return [d for d in s.one("google_compute_instance_template")["disk"]
                if d.get("type") == "SCRATCH"]

    assert scratch(example) == []
    ssds = scratch(synthesized["a2-a100-40"])
    assert len(ssds) == 2
    assert all(d["disk_type"] == "local-ssd" and d["interface"] == "NVME" for d in ssds)
    startup = synthesized["a2-a100-40"].one("google_compute_instance_template")["metadata"][
        "startup-script"]
    assert "--local-dir /mnt/localssd/run" in startup


def test_metadata_is_deterministic(example):
    """An unchanged experiment must plan no diff: a second synthesis is byte-identical."""
    from cdktn import Testing

    from stacks.stack import TrainingStack

    again = Testing.synth(TrainingStack(Testing.app(), "example", example.spec))
    assert again == example.text


# --- health check and group ----------------------------------------------------------------------


def test_tcp_health_check_speaks_the_trainer_protocol(example):
    hc = example.one("google_compute_health_check")
    assert hc["tcp_health_check"] == {"port": 8471, "request": "spottrain-health", "response": "ok"}
    assert (hc["check_interval_sec"], hc["timeout_sec"]) == (10, 5)
    assert (hc["healthy_threshold"], hc["unhealthy_threshold"]) == (2, 6)


def test_zonal_group(example):
    g = example.one("google_compute_instance_group_manager")
    assert example.resources("google_compute_region_instance_group_manager") == []
    assert g["zone"] == "us-central1-a"
    assert unless_stopped(g["target_size"]) == 1
    assert g["version"] == [{
        "name": "trainer",
        "instance_template": f"{ref(example, 'google_compute_instance_template')}"
                             ".self_link_unique}",
    }]
    assert g["auto_healing_policies"] == {
        "health_check": f"{ref(example, 'google_compute_health_check')}.id}}",
        "initial_delay_sec": 900,
    }
    assert g["stateful_disk"] == [
        {"device_name": DEVICE_NAME, "delete_rule": "ON_PERMANENT_INSTANCE_DELETION"}
    ]
    assert g["instance_lifecycle_policy"]["default_action_on_failure"] == "REPAIR"
    assert g["update_policy"] == {
        "type": "PROACTIVE", "minimal_action": "REPLACE", "replacement_method": "RECREATE",
        "max_surge_fixed": 0, "max_unavailable_fixed": 1,
    }
    assert g["named_port"] == [{"name": "health", "port": 8471}]


def test_regional_group_takes_the_stateful_constraints(synthesized):
    s = synthesized["regional"]
    assert s.resources("google_compute_instance_group_manager") == []
    g = s.one("google_compute_region_instance_group_manager")
    assert g["region"] == "us-central1"
    assert g["distribution_policy_zones"] == ["us-central1-a", "us-central1-b", "us-central1-c"]
    # The shape that creates VMs where capacity is (EVEN is for serving); allowed with stateful
    # disks and redistribution NONE.
    assert g["distribution_policy_target_shape"] == "BALANCED"
    assert g["stateful_disk"] == [
        {"device_name": DEVICE_NAME, "delete_rule": "ON_PERMANENT_INSTANCE_DELETION"}
    ]
    assert g["update_policy"] == {
        "type": "PROACTIVE", "minimal_action": "REPLACE", "replacement_method": "RECREATE",
        "instance_redistribution_type": "NONE", "max_surge_fixed": 0, "max_unavailable_fixed": 3,
    }
    assert g["instance_lifecycle_policy"] == {
        "default_action_on_failure": "REPAIR", "force_update_on_repair": "YES",
        "on_repair": {"allow_changing_zone": "NO"},
    }
    assert g["auto_healing_policies"]["initial_delay_sec"] == 900


@pytest.mark.parametrize("name", list(VARIANTS))
def test_stateful_device_name_matches_a_template_disk(synthesized, name):
    s = synthesized[name]
    groups = (s.resources("google_compute_instance_group_manager")
              + s.resources("google_compute_region_instance_group_manager"))
    devices = {d.get("device_name") for t in s.resources("google_compute_instance_template")
               for d in t["disk"]}
    for group in groups:  # groups without a stateful disk: flex-start, zone change
        for stateful in group.get("stateful_disk", []):
            assert stateful["device_name"] in devices


# --- provider, backend, outputs ------------------------------------------------------------------


def test_provider_and_local_backend(example):
    assert example.json["provider"]["google"] == [
        {"project": "my-project-123456", "region": "us-central1"}
    ]
    assert example.json["terraform"]["required_providers"]["google"]["version"] == "8.7.0"
    assert example.json["terraform"]["backend"] == {
        "local": {"path": "../../../terraform.example.tfstate"}
    }


def test_gcs_backend(synthesized):
    assert synthesized["existing-net"].json["terraform"]["backend"] == {
        "gcs": {"bucket": "team-tf-state", "prefix": "spottrain/existing"}
    }


def test_outputs(example, synthesized):
    out = {k: v["value"] for k, v in example.json["output"].items()}
    assert out["bucket"] == f"{ref(example, 'google_storage_bucket')}.name}}"
    assert out["group_name"] == f"{ref(example, 'google_compute_instance_group_manager')}.name}}"
    assert out["group_self_link"].endswith(".self_link}")
    assert out["service_account"] == f"{ref(example, 'google_service_account')}.email}}"
    assert out["checkpoint_uri"] == "gs://my-project-123456-example-ckpt/runs/example"
    assert "journalctl -u spottrain.service" in out["trainer_log_command"]
    assert "--tunnel-through-iap" in out["trainer_log_command"]
    assert "get-serial-port-output" in out["serial_log_command"]
    assert out["scale_to_zero_command"] == (
        "gcloud compute instance-groups managed resize example-group --size 0 "
        "--project my-project-123456 --zone us-central1-a"
    )
    regional = {k: v["value"] for k, v in synthesized["regional"].json["output"].items()}
    assert "--region us-central1" in regional["scale_to_zero_command"]
    assert 'resource.labels.job_name="${google_cloud_run_v2_job.' in out["control_log_command"]


def test_example_snapshot(example, snapshot):
    """The example stack as synthesized: a change to the infrastructure shows up in review.
    After an intended change: `pytest tests/stacks --snapshot-update`, and commit the JSON."""
    from syrupy.extensions.json import JSONSnapshotExtension

    from stack_support import scrub_code_hashes

    assert json.loads(scrub_code_hashes(example.text)) == snapshot.use_extension(JSONSnapshotExtension)
