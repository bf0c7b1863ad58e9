"""One test per validation rule: the line it prints names the file, the field, what is wrong and
what is allowed."""

from __future__ import annotations

import pytest
from stack_support import merged

from stacks.experiment import Experiment
from stacks.load import ExperimentError, parse

SRC = "experiments/x.toml"

# (id, overrides, expected line: exactly one line of the error must equal it)
RULES = [
    ("project-id", {"gcp": {"project": "My_Project"}},
     "gcp.project: 'My_Project' is not valid; allowed: 6-30 of a-z 0-9 -, starting with a letter"),
    ("region", {"gcp": {"region": "central"}},
     "gcp.region: 'central' is not valid; allowed: a region name such as \"us-central1\""),
    ("zone-outside-region", {"gcp": {"zones": ["europe-west4-a"]}},
     "gcp.zones[0]: 'europe-west4-a' is not a zone of region 'us-central1'; allowed: "
     "\"us-central1-a\", \"us-central1-b\", ..."),
    ("zones-duplicate", {"gcp": {"zones": ["us-central1-a", "us-central1-a"]},
                         "group": {"placement": "regional"}},
     "gcp.zones: lists a zone twice (['us-central1-a', 'us-central1-a']); allowed: distinct "
     "zones"),
    ("zones-empty", {"gcp": {"zones": []}},
     "gcp.zones: List should have at least 1 item after validation, not 0, got []"),
    ("machine-type-unknown", {"machine": {"machine_type": "g2-standard-6"}},
     "machine.machine_type: unknown machine type 'g2-standard-6'; allowed: g2-standard-12, "
     "g2-standard-16, g2-standard-24, g2-standard-32, g2-standard-4, g2-standard-48, "
     "g2-standard-8, g2-standard-96"),
    ("machine-family-unknown", {"machine": {"machine_type": "e2-standard-4"}},
     "machine.machine_type: unknown machine type 'e2-standard-4'; allowed: families a2, a3, g2, "
     "n1"),
    ("built-in-gpu-type", {"machine": {"gpu_type": "nvidia-tesla-t4"}},
     "machine.gpu_type: g2-standard-8 has nvidia-l4 built in, not 'nvidia-tesla-t4'; allowed: "
     "\"nvidia-l4\""),
    ("built-in-gpu-count", {"machine": {"gpu_count": 2}},
     "machine.gpu_count: g2-standard-8 has 1 GPU(s) built in, not 2; allowed: 1 (pick another "
     "size for more)"),
    ("a2-ultra-needs-80gb", {"machine": {"machine_type": "a2-ultragpu-1g",
                                         "gpu_type": "nvidia-tesla-a100"}},
     "machine.gpu_type: a2-ultragpu-1g has nvidia-a100-80gb built in, not 'nvidia-tesla-a100'; "
     "allowed: \"nvidia-a100-80gb\""),
    ("n1-gpu-type", {"machine": {"machine_type": "n1-standard-8", "gpu_type": "nvidia-l4"}},
     "machine.gpu_type: 'nvidia-l4' cannot be attached to n1-standard-8; allowed on n1: "
     "nvidia-tesla-t4, nvidia-tesla-v100, nvidia-tesla-p100, nvidia-tesla-p4"),
    ("n1-gpu-count", {"machine": {"machine_type": "n1-standard-8",
                                  "gpu_type": "nvidia-tesla-t4", "gpu_count": 8}},
     "machine.gpu_count: 8 x nvidia-tesla-t4 is not a valid count; allowed: 1, 2, 4"),
    ("n1-size-limit", {"machine": {"machine_type": "n1-standard-16",
                                   "gpu_type": "nvidia-tesla-v100", "gpu_count": 1}},
     "machine.machine_type: n1-standard-16 (16 vCPU, 60 GB) is too large for 1 x "
     "nvidia-tesla-v100; allowed: at most 12 vCPU and 78 GB"),
    ("gpu-count-positive", {"machine": {"gpu_count": 0}},
     "machine.gpu_count: Input should be greater than or equal to 1, got 0"),
    ("spot-only-machine", {"machine": {"machine_type": "a3-highgpu-1g",
                                       "gpu_type": "nvidia-h100-80gb", "gpu_count": 1,
                                       "provisioning": "standard", "termination_action": None}},
     "machine.provisioning: a3-highgpu-1g is offered only as Spot (or flex-start); allowed: "
     "\"spot\", or a3-highgpu-8g for standard"),
    ("termination-action-spot-only", {"machine": {"provisioning": "standard"}},
     "machine.termination_action: applies only to provisioning = \"spot\"; allowed: remove it "
     "for \"standard\""),
    ("provisioning-enum", {"machine": {"provisioning": "preemptible"}},
     "machine.provisioning: Input should be 'spot', 'standard' or 'flex-start', got 'preemptible'"),
    ("termination-action-enum", {"machine": {"termination_action": "stop"}},
     "machine.termination_action: Input should be 'STOP' or 'DELETE', got 'stop'"),
    ("pascal-under-the-default-cu129-image", {"machine": {
        "machine_type": "n1-standard-8", "gpu_type": "nvidia-tesla-p100", "gpu_count": 1}},
     "machine.gpu_type: nvidia-tesla-p100 (sm_60) has no kernels in the PyTorch of image family "
     "'pytorch-2-9-cu129-ubuntu-2204-nvidia-580' (built for sm_70 sm_75 sm_80 sm_86 sm_90 "
     "sm_100 sm_120 compute_120): the trainer would fail at its first kernel; allowed: a newer "
     "GPU type, or an image family whose PyTorch includes sm_60 (e.g. a cu126 build, if still "
     "published)"),
    ("p4-under-cu128", {"machine": {
        "machine_type": "n1-standard-8", "gpu_type": "nvidia-tesla-p4", "gpu_count": 1,
        "image_family": "pytorch-2-8-cu128-ubuntu-2204-nvidia-570"}},
     "machine.gpu_type: nvidia-tesla-p4 (sm_61) has no kernels in the PyTorch of image family "
     "'pytorch-2-8-cu128-ubuntu-2204-nvidia-570' (built for sm_70 sm_75 sm_80 sm_86 sm_90 "
     "sm_100 sm_120): the trainer would fail at its first kernel; allowed: a newer GPU type, or "
     "an image family whose PyTorch includes sm_61 (e.g. a cu126 build, if still published)"),
    ("image-family-name", {"machine": {"image_family": "PyTorch Latest"}},
     "machine.image_family: 'PyTorch Latest' is not valid; allowed: lowercase letters, digits "
     "and hyphens"),
    ("boot-disk-size", {"machine": {"boot_disk_gb": 20}},
     "machine.boot_disk_gb: Input should be greater than or equal to 50, got 20"),
    ("checkpoint-disk-min", {"disk": {"checkpoint_disk_gb": 5}},
     "disk.checkpoint_disk_gb: Input should be greater than or equal to 10, got 5"),
    ("checkpoint-disk-max", {"disk": {"checkpoint_disk_gb": 70000}},
     "disk.checkpoint_disk_gb: Input should be less than or equal to 65536, got 70000"),
    ("local-ssd-count", {"disk": {"local_ssd_count": 9}},
     "disk.local_ssd_count: 9 is not valid; allowed: 0, 1, 2, 3, 4, 5, 6, 7, 8, 16, 24"),
    ("local-ssd-family", {"disk": {"local_ssd_count": 1}},
     "disk.local_ssd_count: g2-standard-8 cannot take Local SSDs from this setting (a3 and "
     "a2-ultragpu bring their own; g2 is not supported yet); allowed: 0"),
    ("local-ssd-a2-size", {"machine": {"machine_type": "a2-highgpu-2g",
                                       "gpu_type": "nvidia-tesla-a100", "gpu_count": 2},
                           "disk": {"local_ssd_count": 1}},
     "disk.local_ssd_count: a2-highgpu-2g takes 1 Local SSDs in no configuration; allowed: "
     "0, 2, 4, 8"),
    ("bucket-name-chars", {"bucket": {"name": "My.Bucket"}},
     "bucket.name: 'My.Bucket' is not valid; allowed: 3-63 of a-z 0-9 - _, starting and ending "
     "with a letter or digit"),
    ("bucket-name-google", {"bucket": {"name": "my-google-ckpt"}},
     "bucket.name: 'my-google-ckpt' is not valid; allowed: names without a goog prefix or "
     "'google'"),
    ("bucket-name-length", {"bucket": {"name": "b" * 64}},
     f"bucket.name: '{'b' * 64}' is not valid; allowed: 3-63 of a-z 0-9 - _, starting and "
     "ending with a letter or digit"),
    ("bucket-location", {"bucket": {"bucket_location": "us central"}},
     "bucket.bucket_location: 'us central' is not valid; allowed: a location such as "
     "\"US-CENTRAL1\", \"US\" or \"EU\""),
    ("soft-delete-range", {"bucket": {"soft_delete_days": 91}},
     "bucket.soft_delete_days: Input should be less than or equal to 90, got 91"),
    ("soft-delete-below-gcs-minimum", {"bucket": {"soft_delete_days": 3}},
     "bucket.soft_delete_days: 3 is not valid; allowed: 0 (off) or 7 to 90 (Cloud Storage "
     "refuses 1 to 6)"),
    ("noncurrent-needs-versioning", {"bucket": {"noncurrent_days": 3}},
     "bucket.noncurrent_days: applies only with versioning = true; allowed: remove it"),
    ("existing-network-needs-names", {"network": {"mode": "existing"}},
     "network.network: is required when mode = \"existing\"; allowed: an existing name"),
    ("dedicated-network-rejects-names", {"network": {"subnetwork": "mine"}},
     "network.subnetwork: is set but mode = \"dedicated\"; allowed: set mode = \"existing\""),
    ("shared-vpc-needs-network-user", {"network": {
        "mode": "existing", "network": "vpc", "subnetwork": "sub",
        "subnetwork_project": "host-project-1"}},
     "network.shared_vpc_network_user: is required for a shared VPC (subnetwork 'sub' of host "
     "project 'host-project-1'): the group creates its VMs as project 'my-project-123456''s "
     "Google APIs service agent (PROJECT_NUMBER@cloudservices.gserviceaccount.com), and without "
     "roles/compute.networkUser on that subnetwork it creates no VM at all; allowed: \"grant\" "
     "(the stack grants it) or \"granted\" (your Shared VPC admin did)"),
    ("network-user-only-for-shared-vpc", {"network": {
        "mode": "existing", "network": "vpc", "subnetwork": "sub",
        "shared_vpc_network_user": "grant"}},
     "network.shared_vpc_network_user: applies only to a shared VPC (mode = \"existing\" with "
     "subnetwork_project another project); allowed: remove it"),
    ("subnet-cidr", {"network": {"subnet_cidr": "8.8.8.0/24"}},
     "network.subnet_cidr: '8.8.8.0/24' is not valid; allowed: a private IPv4 range, /8 to /29"),
    ("network-mode-enum", {"network": {"mode": "default"}},
     "network.mode: Input should be 'dedicated' or 'existing', got 'default'"),
    ("zonal-needs-one-zone", {"gcp": {"zones": ["us-central1-a", "us-central1-b"]}},
     "gcp.zones: 2 zones for placement = \"zonal\"; allowed: exactly one, or placement = "
     "\"regional\""),
    ("regional-needs-two-zones", {"group": {"placement": "regional"}},
     "gcp.zones: one zone for placement = \"regional\"; allowed: two or more, or placement = "
     "\"zonal\""),
    ("workers-range", {"group": {"workers": 2}},
     "group.workers: Input should be less than or equal to 1, got 2"),
    ("initial-delay-range", {"group": {"initial_delay_sec": 4000}},
     "group.initial_delay_sec: Input should be less than or equal to 3600, got 4000"),
    ("task-format", {"trainer": {"task": "trainer/tasks/gpt.py"}},
     "trainer.task: 'trainer/tasks/gpt.py' is not valid; allowed: a Python "
     "\"package.module:callable\""),
    ("steps-positive", {"trainer": {"steps": 0}},
     "trainer.steps: Input should be greater than or equal to 1, got 0"),
    ("steps-integer", {"trainer": {"steps": "many"}},
     "trainer.steps: Input should be a valid integer, unable to parse string as an integer, "
     "got 'many'"),
    ("port-range", {"trainer": {"health_port": 80}},
     "trainer.health_port: Input should be greater than or equal to 1024, got 80"),
    ("port-max", {"trainer": {"health_port": 70000}},
     "trainer.health_port: Input should be less than or equal to 65535, got 70000"),
    ("param-count-xor-state-bytes", {"trainer": {"state_bytes": 1000}},
     "trainer.state_bytes: is set together with param_count; allowed: one of the two"),
    ("args-managed-flag", {"trainer": {"args": ["--steps=5"]}},
     "trainer.args[0]: --steps is set by the stack from other fields; allowed: any other flag"),
    ("args-managed-price", {"trainer": {"args": ["--seed", "1", "--on-demand-price-per-hour=9"]}},
     "trainer.args[2]: --on-demand-price-per-hour is set by the stack from other fields; "
     "allowed: any other flag"),
    ("args-control-char", {"trainer": {"args": ["a\nb"]}},
     "trainer.args[0]: contains a control character; allowed: printable text"),
    ("labels", {"labels": {"Team": "ml"}},
     "labels: key 'Team' is not valid; allowed: a-z first, then up to 62 of a-z 0-9 - _"),
    ("label-value", {"labels": {"team": "ML Ops"}},
     "labels: value 'ML Ops' of 'team' is not valid; allowed: up to 63 of a-z 0-9 - _"),
    ("backend-gcs-needs-bucket", {"backend": {"type": "gcs"}},
     "backend.bucket: is required when type = \"gcs\"; allowed: an existing bucket name"),
    ("backend-local-rejects-bucket", {"backend": {"bucket": "state-bucket"}},
     "backend.bucket: is set but type = \"local\"; allowed: set type = \"gcs\""),
    ("backend-not-the-checkpoint-bucket", {"backend": {"type": "gcs",
                                                       "bucket": "my-project-123456-x-ckpt"}},
     "backend.bucket: is the checkpoint bucket this stack creates; allowed: a separate, "
     "existing bucket"),
    ("unknown-key", {"machine": {"gpus": 1}},
     "machine.gpus: unknown key; allowed: machine_type, gpu_type, gpu_count, provisioning, "
     "termination_action, image_family, image_project, boot_disk_gb, python_version"),
    ("unknown-section", {"cluster": {"size": 2}},
     "cluster: unknown key; allowed: labels, gcp, machine, disk, bucket, network, group, "
     "trainer, pool, backend, cost, capacity, data, alerts, budget"),
    ("missing-required", {"trainer": {"steps": None}}, "trainer.steps: is required"),
    ("image-python-unknown", {"machine": {"image_family": "my-own-image"}},
     "machine.image_family: 'my-own-image' names no OS whose Python stacks/gcp_rules.py knows, so "
     "the wheels shipped with the code cannot be resolved for it; allowed: a family naming "
     'ubuntu-2204, ubuntu-2404, debian-12, or set machine.python_version (e.g. "3.10")'),
    ("image-python-version", {"machine": {"python_version": "3"}},
     "machine.python_version: '3' is not valid; allowed: a Python version such as \"3.10\""),
    # [data]
    ("data-source-not-gs", {"data": {"source": "s3://bucket/x"}},
     "data.source: 's3://bucket/x' is not valid; allowed: gs://BUCKET/PREFIX (bucket: 3-222 of "
     "a-z 0-9 - _ ., starting and ending with a letter or digit; prefix: /-separated parts, none "
     'empty, "." or "..")'),
    ("data-source-dotdot", {"data": {"source": "gs://my-data/a/../b"}},
     "data.source: 'gs://my-data/a/../b' is not valid; allowed: gs://BUCKET/PREFIX (bucket: 3-222 "
     "of a-z 0-9 - _ ., starting and ending with a letter or digit; prefix: /-separated parts, none "
     'empty, "." or "..")'),
    ("data-not-the-checkpoint-bucket", {"data": {"source": "gs://my-project-123456-x-ckpt/data"}},
     "data.source: 'my-project-123456-x-ckpt' is the checkpoint bucket this stack creates (and may "
     "destroy with force_destroy; its soft delete and lifecycle apply to everything in it); "
     "allowed: a separate bucket holding your data"),
    ("data-not-the-state-bucket", {"backend": {"type": "gcs", "bucket": "team-state"},
                                   "data": {"source": "gs://team-state/x"}},
     "data.source: 'team-state' is the Terraform state bucket (the VMs would read the state); "
     "allowed: a separate bucket holding your data"),
    ("data-parallel", {"data": {"source": "gs://my-data/x", "parallel": 0}},
     "data.parallel: Input should be greater than or equal to 1, got 0"),
    ("data-source-required", {"data": {"parallel": 4}}, "data.source: is required"),
]


def problems(overrides: dict, name: str = "x") -> list[str]:
    with pytest.raises(ExperimentError) as info:
        parse(merged(overrides), name, SRC)
    return info.value.lines


@pytest.mark.parametrize(("overrides", "line"), [r[1:] for r in RULES], ids=[r[0] for r in RULES])
def test_rule(overrides, line):
    assert f"{SRC}: {line}" in problems(overrides)


@pytest.mark.parametrize("name", ["Example", "9lives", "ends-", "a" * 22, "has_underscore"])
def test_file_name_must_make_a_stack_name(name):
    """The stem prefixes every resource; 21 keeps "<name>-trainer" a valid account id."""
    assert problems({}, name) == [
        f"{SRC}: (file name): {name!r} cannot name a stack; allowed: 1-21 of a-z 0-9 -, "
        "starting with a letter, not ending with -"
    ]


def test_every_problem_is_reported_at_once():
    lines = problems({
        "gcp": {"zones": ["europe-west4-a"]},
        "machine": {"gpu_type": "nvidia-tesla-t4", "bogus": True},
        "trainer": {"steps": -1, "task": "nope"},
        "network": {"subnet_cidr": "1.2.3.4/8"},
    })
    fields = [line.split(": ")[1] for line in lines]
    # machine has an unknown key *and* a cross-field problem: both are reported.
    assert sorted(fields) == sorted([
        "gcp.zones[0]", "machine.bogus", "machine.gpu_type", "trainer.steps", "trainer.task",
        "network.subnet_cidr",
    ])
    assert all(line.startswith(f"{SRC}: ") for line in lines)


def test_default_bucket_name_follows_the_bucket_rules():
    assert problems({}, "google-run") == [
        f"{SRC}: bucket.name: the default name: 'my-project-123456-google-run-ckpt' is not valid; "
        "allowed: names without a goog prefix or 'google'; or set bucket.name"
    ]
    parse(merged({"bucket": {"name": "my-ckpt-bucket"}}), "google-run")  # the way out


def test_longest_names_still_make_a_valid_default_bucket_name():
    exp = parse(merged({"gcp": {"project": "a" * 30}}), "b" * 21)
    assert len(exp.bucket_name("b" * 21)) <= 63


def test_example_is_valid_and_fully_documented():
    exp = parse(merged({}), "example")
    assert exp.trainer.health_port == 8471
    assert exp.trainer.task == "trainer.tasks.gpt:build"

    def undocumented(model) -> list[str]:
        missing = [f for f, info in model.model_fields.items() if not info.description]
        for info in model.model_fields.values():
            ann = info.annotation
            if isinstance(ann, type) and hasattr(ann, "model_fields"):
                missing += undocumented(ann)
        return missing

    assert undocumented(Experiment) == []


def test_issue_keys_exist_under_their_names():
    from stacks.experiment import SECTIONS

    keys = {k for cls in SECTIONS.values() for k in cls.model_fields} | set(
        Experiment.model_fields)
    for key in ["project", "region", "zones", "machine_type", "gpu_type", "gpu_count",
                "provisioning", "termination_action", "workers", "image_family",
                "image_project", "checkpoint_disk_gb", "local_ssd_count", "bucket_location",
                "force_destroy", "health_port", "task", "steps", "labels"]:
        assert key in keys, key


def test_every_gpu_type_has_a_compute_capability_and_the_default_image_is_in_the_table():
    from stacks import gcp_rules as R
    from stacks.experiment import Machine

    for gpu in [*R.N1_GPU_LIMITS, *(s.gpu_type for s in R.MACHINE_TYPES.values() if s.gpu_type)]:
        assert gpu in R.GPU_CAPABILITY, gpu
    assert R.image_arch_list(Machine.model_fields["image_family"].default) is not None
    # Every GPU the other families offer runs under the default image: only Pascal needs cu126.
    ok = parse(merged({}), "x").machine
    assert ok.image_note() is None


def test_an_image_family_outside_the_table_is_unchecked_and_says_so():
    exp = parse(merged({"machine": {"machine_type": "n1-standard-8",
                                    "gpu_type": "nvidia-tesla-p100", "gpu_count": 1,
                                    "image_family": "my-own-pytorch-image",
                                    "python_version": "3.10"}}), "x")
    note = exp.machine.image_note()
    assert note is not None and "unchecked" in note and "nvidia-tesla-p100" in note
