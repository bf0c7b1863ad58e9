"""Google Cloud facts the provider does not check and the API enforces only at deploy time.

Machine families and their GPUs, N1 attachment limits, naming rules, the Spot shutdown window and
PD-SSD throughput. Sources: the GCE GPU, machine-family, Spot VM and persistent-disk performance
pages (see shared/NOTES.md). Pure data and small lookups; the messages built from it live in
`experiment.py`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# --- names ---------------------------------------------------------------------------------------

#: RFC 1035 label, the shape of most Compute Engine resource names.
GCP_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
PROJECT_ID = re.compile(r"^[a-z][-a-z0-9]{4,28}[a-z0-9]$")
REGION = re.compile(r"^[a-z]+-[a-z]+[0-9]+$")
#: Bucket names without dots (dotted names need domain verification).
BUCKET_NAME = re.compile(r"^[a-z0-9][-_a-z0-9]{1,61}[a-z0-9]$")
LABEL_KEY = re.compile(r"^[a-z][-_a-z0-9]{0,62}$")
LABEL_VALUE = re.compile(r"^[-_a-z0-9]{0,63}$")
MAX_LABELS = 64
#: Experiment names are suffixed into resource names; the service account id ("<name>-trainer",
#: 6-30 characters) is the tightest fit.
MAX_EXPERIMENT_NAME = 21
SA_SUFFIX = "-trainer"

# --- GPUs ----------------------------------------------------------------------------------------

T4, V100, P100, P4 = "nvidia-tesla-t4", "nvidia-tesla-v100", "nvidia-tesla-p100", "nvidia-tesla-p4"
L4 = "nvidia-l4"
A100_40, A100_80 = "nvidia-tesla-a100", "nvidia-a100-80gb"
H100, H100_MEGA = "nvidia-h100-80gb", "nvidia-h100-mega-80gb"


@dataclass(frozen=True)
class MachineShape:
    """One predefined machine type: size and, for accelerator-optimized families, its GPUs."""

    vcpus: int
    memory_gb: float
    gpu_type: str | None = None  # built-in GPU; None for N1, which takes attached GPUs
    gpu_count: int = 0
    bundled_local_ssd: bool = False  # the family attaches its own Local SSD
    spot_or_flex_only: bool = False  # not offered with standard provisioning
    local_ssd_counts: tuple[int, ...] | None = None  # None: the N1 rule (LOCAL_SSD_COUNTS)
    gvnic_required: bool = False  # the family boots only with the gVNIC network interface


def _accelerator_optimized() -> dict[str, MachineShape]:
    shapes: dict[str, MachineShape] = {}
    for n, vcpu, mem in [(1, 26, 234), (2, 52, 468), (4, 104, 936), (8, 208, 1872)]:
        shapes[f"a3-highgpu-{n}g"] = MachineShape(
            vcpu, mem, H100, n, bundled_local_ssd=True, spot_or_flex_only=n < 8,
            gvnic_required=True,
        )
    shapes["a3-megagpu-8g"] = MachineShape(
        208, 1872, H100_MEGA, 8, bundled_local_ssd=True, gvnic_required=True
    )
    a2_ssds = {1: (1, 2, 4, 8), 2: (2, 4, 8), 4: (4, 8), 8: (8,)}
    for n, vcpu, mem in [(1, 12, 85), (2, 24, 170), (4, 48, 340), (8, 96, 680)]:
        shapes[f"a2-highgpu-{n}g"] = MachineShape(
            vcpu, mem, A100_40, n, local_ssd_counts=(0, *a2_ssds[n])
        )
    shapes["a2-megagpu-16g"] = MachineShape(96, 1360, A100_40, 16, local_ssd_counts=(0, 8))
    for n, vcpu, mem in [(1, 12, 170), (2, 24, 340), (4, 48, 680), (8, 96, 1360)]:
        shapes[f"a2-ultragpu-{n}g"] = MachineShape(vcpu, mem, A100_80, n, bundled_local_ssd=True)
    for vcpu, mem, n in [
        (4, 16, 1), (8, 32, 1), (12, 48, 1), (16, 64, 1), (24, 96, 2), (32, 128, 1),
        (48, 192, 4), (96, 384, 8),
    ]:  # fmt: skip
        shapes[f"g2-standard-{vcpu}"] = MachineShape(vcpu, mem, L4, n)
    return shapes


def _n1() -> dict[str, MachineShape]:
    shapes: dict[str, MachineShape] = {}
    per_vcpu = {"standard": 3.75, "highmem": 6.5, "highcpu": 0.9}
    for kind, gb in per_vcpu.items():
        for vcpu in (1, 2, 4, 8, 16, 32, 64, 96):
            if kind != "standard" and vcpu == 1:
                continue
            shapes[f"n1-{kind}-{vcpu}"] = MachineShape(vcpu, vcpu * gb)
    return shapes


MACHINE_TYPES: dict[str, MachineShape] = {**_accelerator_optimized(), **_n1()}
FAMILIES = ("a2", "a3", "g2", "n1")


def _e2() -> dict[str, MachineShape]:
    return {f"e2-standard-{vcpu}": MachineShape(vcpu, vcpu * 4.0) for vcpu in (2, 4, 8, 16, 32)}



@dataclass(frozen=True)
class AttachLimit:
    """What an N1 VM may look like with this many attached GPUs of one type."""

    max_vcpus: int
    max_memory_gb: float


#: N1 attached GPUs: allowed counts and, per count, the largest VM they may be attached to.
N1_GPU_LIMITS: dict[str, dict[int, AttachLimit]] = {
    T4: {1: AttachLimit(48, 312), 2: AttachLimit(48, 312), 4: AttachLimit(96, 624)},
    V100: {
        1: AttachLimit(12, 78), 2: AttachLimit(24, 156), 4: AttachLimit(48, 312),
        8: AttachLimit(96, 624),
    },  # fmt: skip
    P100: {1: AttachLimit(16, 104), 2: AttachLimit(32, 208), 4: AttachLimit(64, 208)},
    P4: {1: AttachLimit(24, 156), 2: AttachLimit(48, 312), 4: AttachLimit(96, 624)},
}

#: Compute capability of each GPU type, as (major, minor) (developer.nvidia.com/cuda-gpus).
GPU_CAPABILITY: dict[str, tuple[int, int]] = {
    P100: (6, 0), P4: (6, 1), V100: (7, 0), T4: (7, 5), A100_40: (8, 0), A100_80: (8, 0),
    L4: (8, 9), H100: (9, 0), H100_MEGA: (9, 0),
}

# What `torch.cuda.get_arch_list()` says in the PyTorch of a Deep Learning VM image family, by
# the family's "pytorch-<major>-<minor>-cu<NNN>" prefix. Source: the x86_64 wheel builds of
# pytorch/pytorch, .ci/manywheel/build_cuda.sh on the 2.8 and 2.9 release branches
# (TORCH_CUDA_ARCH_LIST: CUDA 12.6 "5.0;6.0;7.0;7.5;8.0;8.6;9.0", 12.8
# "7.0;7.5;8.0;8.6;9.0;10.0;12.0", 12.9 the same with "12.0+PTX"); the images ship those
# wheels. A family not listed here is unchecked before deploying; the trainer checks the GPU
# against its own build at start either way (trainer/gpu.py).
_CU126 = ("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90")
_CU128 = ("sm_70", "sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120")
_CU129 = (*_CU128, "compute_120")
IMAGE_ARCH_LISTS: dict[str, tuple[str, ...]] = {
    f"pytorch-2-{minor}-{cu}": arches
    for minor in (8, 9)
    for cu, arches in (("cu126", _CU126), ("cu128", _CU128), ("cu129", _CU129))
}


def image_arch_list(image_family: str) -> tuple[str, ...] | None:
    """The arch list of the family's PyTorch, or None when the table does not know it."""
    for prefix, arches in IMAGE_ARCH_LISTS.items():
        if image_family == prefix or image_family.startswith(prefix + "-"):
            return arches
    return None


@dataclass(frozen=True)
class ImagePython:
    """The Python of an image family, for resolving wheels at deploy time (stacks/wheels.py)."""

    version: str  # "3.10": the interpreter with torch that the startup script finds
    glibc: tuple[int, int]  # the OS's glibc: manylinux wheels up to this version run
    torch: str | None  # the image's torch version (kept out of the shipped wheels), if known


# The Python and glibc of a Deep Learning VM image family, by the OS named in the family
# ("...-ubuntu-2204-..."), and its torch from the "pytorch-<major>-<minor>-" prefix. Sources:
# Ubuntu 22.04 (jammy) ships python3 3.10 and libc6 2.35, Ubuntu 24.04 (noble) python3 3.12 and
# libc6 2.39, Debian 12 (bookworm) python3 3.11 and libc6 2.36 (packages.ubuntu.com,
# packages.debian.org); the Deep Learning VM PyTorch images train with that interpreter. This is
# checked where it matters: the startup script compares the image's Python with the one the
# wheels were locked for and stops with a clear message on a mismatch. A family whose OS is not
# named here needs `machine.python_version`.
IMAGE_OS_PYTHON: dict[str, tuple[str, tuple[int, int]]] = {
    "ubuntu-2204": ("3.10", (2, 35)),
    "ubuntu-2404": ("3.12", (2, 39)),
    "debian-12": ("3.11", (2, 36)),
}
_TORCH_FAMILY = re.compile(r"^pytorch-(\d+)-(\d+)-")
#: The oldest glibc every manylinux wheel supports (manylinux2014): what an image of unknown OS gets.
MANYLINUX2014_GLIBC = (2, 17)


def image_python(image_family: str, python_version: str | None = None) -> ImagePython | None:
    """The family's Python (``python_version`` overrides the table), or None when unknown."""
    os_found = next((v for k, v in IMAGE_OS_PYTHON.items() if f"-{k}" in image_family), None)
    version = python_version or (os_found[0] if os_found else None)
    if version is None:
        return None
    m = _TORCH_FAMILY.match(image_family)
    torch = f"{m.group(1)}.{m.group(2)}.0" if m else None
    return ImagePython(version, os_found[1] if os_found else MANYLINUX2014_GLIBC, torch)


#: Local SSD counts a VM may take through the template (375 GB NVMe each).
LOCAL_SSD_COUNTS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 16, 24)
LOCAL_SSD_GB = 375


def family(machine_type: str) -> str:
    return machine_type.split("-", 1)[0]


#: Machine types without GPUs a pool's coordinator may use when it does not train (it only
#: hosts the rendezvous store): e2-standard and the n1 types (no GPU attached).
CPU_MACHINE_TYPES: dict[str, MachineShape] = {
    **_e2(), **{t: s for t, s in MACHINE_TYPES.items() if family(t) == "n1"}}
#: The coordinator's default machine type when it does not train.
DEFAULT_CPU_COORDINATOR = "e2-standard-4"


# --- Cloud Storage --------------------------------------------------------------------------------

#: Soft delete retention: 0 (off) or 7 to 90 days; the API answers 400 to anything else and the
#: provider does not check it (cloud.google.com/storage/docs/soft-delete).
SOFT_DELETE_MIN_DAYS, SOFT_DELETE_MAX_DAYS = 7, 90


# --- disks, windows, health checks ---------------------------------------------------------------

PD_SSD_MIN_GB, PD_SSD_MAX_GB = 10, 65536
BOOT_DISK_MIN_GB = 50  # the Deep Learning VM images are ~50 GB
PD_SSD_WRITE_MB_S_PER_GB = 0.48


def pd_ssd_vm_write_cap_mb_s(vcpus: int) -> float:
    """Per-VM PD-SSD write throughput cap (approximate, by vCPU count)."""
    if vcpus < 8:
        return 240.0
    if vcpus < 16:
        return 800.0
    if vcpus < 32:
        return 1000.0
    return 1200.0


def vm_egress_mb_s(vcpus: int) -> float:
    """A VM's network egress cap, MB/s: 2 Gbps per vCPU up to 32 Gbps (the general rule;
    accelerator-optimized types are allowed more, so this errs slow). Persistent Disk writes
    count against it, as do uploads to Cloud Storage (compute/docs/disks/performance)."""
    return min(2.0 * vcpus, 32.0) * 1000 / 8


#: Local NVMe SSD write throughput per 375 GB device, MB/s (compute/docs/disks/local-ssd-performance).
LOCAL_SSD_WRITE_MB_S_PER_DEVICE = 350.0

#: What one GPU copies to pinned host memory in practice, GB/s, by its PCIe link: 3.0 x16 (P4,
#: P100, T4, V100) ~12, 4.0 x16 (A100, L4) ~24, 5.0 x16 (H100) ~48. Approximate, like the rest.
GPU_HOST_COPY_GB_S: dict[str, float] = {
    P4: 12.0, P100: 12.0, T4: 12.0, V100: 12.0, A100_40: 24.0, A100_80: 24.0, L4: 24.0, H100: 48.0,
    H100_MEGA: 48.0,
}


# The shutdown window by provisioning, and how it is shared out: `trainer.shutdown_window`.

# --- flex-start (Dynamic Workload Scheduler) -----------------------------------------------------

#: Machine families flex-start offers that this project supports (GPU VMs; compute/docs/instances/
#: about-flex-start-vms). N1 with attached GPUs is not among them.
FLEX_START_FAMILIES = ("a2", "a3", "g2")
#: A flex-start VM runs at most 7 days (resize requests accept 10 minutes to 7 days).
FLEX_START_MAX_RUN_S = 7 * 24 * 3600
FLEX_START_MIN_RUN_S = 10 * 60

HEALTH_CHECK_RANGES = ("35.191.0.0/16", "130.211.0.0/22")
#: What a health check accepts: healthy/unhealthy thresholds 1-10, check interval and timeout
#: 1-300 s with the timeout no longer than the interval (the provider checks none of it; see
#: `API_FIELDS`).
HEALTH_THRESHOLD_MIN, HEALTH_THRESHOLD_MAX = 1, 10
HEALTH_INTERVAL_MIN_S, HEALTH_INTERVAL_MAX_S = 1, 300
#: torchrun's default c10d rendezvous port.
RENDEZVOUS_PORT = 29400
#: The private DNS domain under which a pool's coordinator gets its stable name.
POOL_DOMAIN = "spottrain.internal"
IAP_RANGE = "35.235.240.0/20"


# --- what the APIs accept in every numeric and enumerated field the stacks set -------------------
#
# One row per (Terraform type, attribute path without list indexes). `stacks.api_fields` walks a
# synthesized stack against it: a numeric or enum-like value in a field without a row fails, so a
# new field cannot skip this table. Each row names the page that states the limit (found through
# the Google Cloud documentation and the provider's own schema descriptions); a row whose range the
# page did not state pins the one value we set (`note`).

_REST = "https://cloud.google.com/compute/docs/reference/rest/v1/"
_HC_CONCEPTS = "https://cloud.google.com/load-balancing/docs/health-check-concepts"
_IGM = _REST + "instanceGroupManagers"
_SHAPE = "https://cloud.google.com/compute/docs/instance-groups/regional-mig-distribution-shape"
_STATEFUL = "https://cloud.google.com/compute/docs/instance-groups/configuring-stateful-disks-in-migs"
_FLEXIBILITY = "https://cloud.google.com/compute/docs/instance-groups/about-instance-flexibility"
_MIG_LIMITS = "https://cloud.google.com/compute/docs/instance-groups"
_SCHEDULING = _REST + "instances"  # the Scheduling object of instances and templates
_FLEX = "https://cloud.google.com/compute/docs/instances/about-flex-start-vms"
_RESIZE = "https://cloud.google.com/compute/docs/instance-groups/about-resize-requests-mig"
_RESERVATIONS = "https://cloud.google.com/compute/docs/instances/reservations-prevent-consumption"
_PD = "https://cloud.google.com/compute/docs/disks/persistent-disks"
_LOCAL_SSD = "https://cloud.google.com/compute/docs/disks/local-ssd"
_GPUS = "https://cloud.google.com/compute/docs/gpus"
_GVNIC = "https://cloud.google.com/compute/docs/networking/using-gvnic"
_SCOPES = "https://cloud.google.com/compute/docs/access/service-accounts#accesscopesiam"
_SOFT_DELETE = "https://cloud.google.com/storage/docs/soft-delete"
_LIFECYCLE = "https://cloud.google.com/storage/docs/lifecycle"
_BUCKETS = "https://cloud.google.com/storage/docs/json_api/v1/buckets"
_PAP = "https://cloud.google.com/storage/docs/public-access-prevention"
_SECRET_TTL = "https://cloud.google.com/secret-manager/docs/delay-destruction-of-secret-versions"
_RUN_RETRIES = "https://cloud.google.com/run/docs/configuring/max-retries"
_RUN_TIMEOUT = "https://cloud.google.com/run/docs/configuring/task-timeout"
_RUN_JOBS = "https://cloud.google.com/run/docs/reference/rest/v2/projects.locations.jobs"
_SCHEDULER = "https://cloud.google.com/scheduler/docs/reference/rest/v1/projects.locations.jobs"
_CRON = "https://cloud.google.com/scheduler/docs/configuring/cron-job-schedules"
_FIREWALLS = _REST + "firewalls"
_FLOW_LOGS = "https://cloud.google.com/vpc/docs/flow-logs"
_ROUTERS = _REST + "routers"
_DNS_ZONES = "https://cloud.google.com/dns/docs/reference/rest/v1/managedZones"
_DNS_RECORDS = "https://cloud.google.com/dns/docs/reference/rest/v1/resourceRecordSets"
_TF_INSTANCE = ("https://registry.terraform.io/providers/hashicorp/google/8.7.0/docs/resources/"
                "compute_instance#desired_status")
_DELETION_POLICY = ("https://registry.terraform.io/providers/hashicorp/google/8.7.0/docs/resources/"
                    "storage_bucket#deletion_policy")
_LOG_METRICS = "https://cloud.google.com/logging/docs/reference/v2/rest/v2/projects.metrics"
_TF_LOG_METRIC = "https://registry.terraform.io/providers/hashicorp/google/8.7.0/docs/resources/logging_metric"
_BUCKETS = "https://cloud.google.com/monitoring/api/ref_v3/rest/v3/TypedValue#exponential"
_UCUM = "https://cloud.google.com/monitoring/api/ref_v3/rest/v3/projects.metricDescriptors#MetricDescriptor"
_ALERTS = "https://cloud.google.com/monitoring/api/ref_v3/rest/v3/projects.alertPolicies"
_AGGREGATION = "https://cloud.google.com/monitoring/api/ref_v3/rest/v3/projects.alertPolicies#Aggregation"
_LOG_ALERTS = "https://cloud.google.com/logging/docs/alerting/log-based-alerts"
_CHANNELS = "https://cloud.google.com/monitoring/support/notification-options"
_BUDGETS = "https://cloud.google.com/billing/docs/reference/budget/rest/v1/billingAccounts.budgets"


@dataclass(frozen=True)
class FieldRule:
    """What one field accepts: an inclusive numeric range, a set of values, or both (a value in
    `values` or in the range passes), or a pattern. `duration`: the field is a "<seconds>s"
    string, checked as its seconds."""

    source: str
    low: float | None = None
    high: float | None = None
    values: tuple[object, ...] = ()
    duration: bool = False
    pattern: str | None = None
    note: str = ""

    def accepts(self, value: object) -> bool:
        if self.pattern is not None:
            return isinstance(value, str) and re.fullmatch(self.pattern, value) is not None
        if value in self.values:
            return True
        if isinstance(value, (int, float)) and not isinstance(value, bool) and (
                self.low is not None or self.high is not None):
            return ((self.low is None or value >= self.low)
                    and (self.high is None or value <= self.high))
        return False

    def allowed(self) -> str:
        parts = [repr(v) for v in self.values]
        if self.low is not None or self.high is not None:
            parts.append(f"{self.low if self.low is not None else '...'} to "
                         f"{self.high if self.high is not None else '...'}")
        if self.pattern is not None:
            parts.append(f"matching {self.pattern}")
        return " or ".join(parts)


def _enum(source: str, *values: str) -> FieldRule:
    return FieldRule(source, values=values)


def _range(source: str, low: float | None, high: float | None, **kw: object) -> FieldRule:
    return FieldRule(source, low=low, high=high, **kw)  # type: ignore[arg-type]


_PORT = _range(_REST + "instanceGroupManagers#NamedPort", 1, 65535)
_PD_TYPES = ("pd-standard", "pd-balanced", "pd-ssd")
_GROUP: dict[str, FieldRule] = {
    "target_size": _range(_MIG_LIMITS, 0, 1000, note="a zonal group holds at most 1,000 VMs"),
    "auto_healing_policies.initial_delay_sec": _range(_IGM, 0, 3600),
    "named_port.port": _PORT,
    "update_policy.type": _enum(_IGM, "PROACTIVE", "OPPORTUNISTIC"),
    "update_policy.minimal_action": _enum(_IGM, "NONE", "REFRESH", "RESTART", "REPLACE"),
    "update_policy.replacement_method": _enum(_IGM, "SUBSTITUTE", "RECREATE"),
    "update_policy.instance_redistribution_type": _enum(_IGM, "PROACTIVE", "NONE"),
    "update_policy.max_surge_fixed": _range(_IGM, 0, 1000),
    "update_policy.max_unavailable_fixed": _range(_IGM, 0, 1000),
    "instance_lifecycle_policy.default_action_on_failure": _enum(_IGM, "REPAIR", "DO_NOTHING"),
    "instance_lifecycle_policy.force_update_on_repair": _enum(_IGM, "YES", "NO"),
    "instance_lifecycle_policy.on_repair.allow_changing_zone": _enum(_IGM, "YES", "NO"),
    "stateful_disk.delete_rule": _enum(_STATEFUL, "NEVER", "ON_PERMANENT_INSTANCE_DELETION"),
    "distribution_policy_target_shape": _enum(_SHAPE, "EVEN", "BALANCED", "ANY", "ANY_SINGLE_ZONE"),
    "instance_flexibility_policy.instance_selections.rank": _range(_FLEXIBILITY, 0, None),
}
_SCHEDULING_RULES: dict[str, FieldRule] = {
    "scheduling.provisioning_model": _enum(_SCHEDULING, "STANDARD", "SPOT", "FLEX_START"),
    "scheduling.instance_termination_action": _enum(_SCHEDULING, "STOP", "DELETE"),
    "scheduling.on_host_maintenance": _enum(_SCHEDULING, "MIGRATE", "TERMINATE"),
    # Set only for flex-start here, whose run is 10 minutes to 7 days.
    "scheduling.max_run_duration.seconds": _range(_FLEX, FLEX_START_MIN_RUN_S, FLEX_START_MAX_RUN_S),
    "reservation_affinity.type": _enum(_RESERVATIONS, "ANY_RESERVATION", "NO_RESERVATION",
                                       "SPECIFIC_RESERVATION"),
    "guest_accelerator.count": FieldRule(_GPUS, values=(1, 2, 4, 8)),
    "guest_accelerator.type": FieldRule(_GPUS, values=(T4, V100, P100, P4)),
    "network_interface.nic_type": _enum(_GVNIC, "GVNIC", "VIRTIO_NET"),
    "service_account.scopes": _enum(_SCOPES, "cloud-platform"),
}
_RUN_DURATION = _range(_RESIZE, FLEX_START_MIN_RUN_S, FLEX_START_MAX_RUN_S)
_CHECKPOINT_KEY_TTL_S = 30 * 86400

#: (Terraform type) -> (attribute path) -> what the API accepts there.
API_FIELDS: dict[str, dict[str, FieldRule]] = {
    "google_compute_health_check": {
        "check_interval_sec": _range(_HC_CONCEPTS, HEALTH_INTERVAL_MIN_S, HEALTH_INTERVAL_MAX_S),
        "timeout_sec": _range(_HC_CONCEPTS, HEALTH_INTERVAL_MIN_S, HEALTH_INTERVAL_MAX_S,
                              note="and no longer than check_interval_sec"),
        "healthy_threshold": _range(_HC_CONCEPTS, HEALTH_THRESHOLD_MIN, HEALTH_THRESHOLD_MAX),
        "unhealthy_threshold": _range(_HC_CONCEPTS, HEALTH_THRESHOLD_MIN, HEALTH_THRESHOLD_MAX),
        "tcp_health_check.port": _PORT,
    },
    "google_compute_instance_group_manager": _GROUP,
    "google_compute_region_instance_group_manager": _GROUP,
    "google_compute_instance_template": {
        **_SCHEDULING_RULES,
        "disk.disk_size_gb": _range(_PD, PD_SSD_MIN_GB, PD_SSD_MAX_GB, values=(LOCAL_SSD_GB,)),
        "disk.disk_type": FieldRule(_PD, values=(*_PD_TYPES, "local-ssd")),
        "disk.type": _enum(_LOCAL_SSD, "PERSISTENT", "SCRATCH"),
        "disk.interface": _enum(_LOCAL_SSD, "SCSI", "NVME"),
        "disk.mode": _enum(_PD, "READ_WRITE", "READ_ONLY"),
    },
    "google_compute_instance": {
        **_SCHEDULING_RULES,
        "desired_status": _enum(_TF_INSTANCE, "RUNNING", "SUSPENDED", "TERMINATED"),
        "boot_disk.initialize_params.size": _range(_PD, PD_SSD_MIN_GB, PD_SSD_MAX_GB),
        "boot_disk.initialize_params.type": FieldRule(_PD, values=_PD_TYPES),
        "attached_disk.mode": _enum(_PD, "READ_WRITE", "READ_ONLY"),
        "scratch_disk.interface": _enum(_LOCAL_SSD, "SCSI", "NVME"),
    },
    "google_compute_disk": {
        "size": _range(_PD, PD_SSD_MIN_GB, PD_SSD_MAX_GB),
        "type": FieldRule(_PD, values=_PD_TYPES),
    },
    "google_compute_resize_request": {
        "resize_by": _range(_RESIZE, 1, None),
        "requested_run_duration.seconds": _RUN_DURATION,
    },
    "google_compute_region_resize_request": {
        "resize_by": _range(_RESIZE, 1, None),
        "requested_run_duration.seconds": _RUN_DURATION,
    },
    "google_storage_bucket": {
        "soft_delete_policy.retention_duration_seconds": _range(
            _SOFT_DELETE, SOFT_DELETE_MIN_DAYS * 86400, SOFT_DELETE_MAX_DAYS * 86400, values=(0,)),
        "storage_class": _enum(_BUCKETS, "STANDARD", "NEARLINE", "COLDLINE", "ARCHIVE"),
        "public_access_prevention": _enum(_PAP, "enforced", "inherited"),
        "lifecycle_rule.action.type": _enum(_LIFECYCLE, "Delete", "SetStorageClass",
                                            "AbortIncompleteMultipartUpload"),
        "lifecycle_rule.condition.with_state": _enum(_LIFECYCLE, "LIVE", "ARCHIVED", "ANY"),
        "lifecycle_rule.condition.num_newer_versions": _range(_LIFECYCLE, 0, None),
        "lifecycle_rule.condition.days_since_noncurrent_time": _range(_LIFECYCLE, 0, None),
        "deletion_policy": _enum(_DELETION_POLICY, "DELETE", "ABANDON", "PREVENT"),
    },
    "google_secret_manager_secret": {
        "version_destroy_ttl": FieldRule(
            _SECRET_TTL, values=(_CHECKPOINT_KEY_TTL_S,), duration=True,
            note="the page read states no range: only the value the stack sets is accepted"),
        "deletion_policy": _enum(_DELETION_POLICY, "DELETE", "ABANDON", "PREVENT"),
    },
    "google_cloud_run_v2_job": {
        "template.task_count": _range(_RUN_JOBS, 1, None),
        "template.template.max_retries": _range(_RUN_RETRIES, 0, 10),
        "template.template.timeout": _range(_RUN_TIMEOUT, 1, 168 * 3600, duration=True),
    },
    "google_cloud_scheduler_job": {
        "attempt_deadline": _range(_SCHEDULER, 15, 30 * 60, duration=True),
        "http_target.http_method": _enum(_SCHEDULER, "POST", "GET", "HEAD", "PUT", "DELETE",
                                         "PATCH", "OPTIONS"),
        # Every N minutes (N 1-59), or hourly: the two shapes the fallback writes.
        "schedule": FieldRule(_CRON, pattern=r"\*/([1-9]|[1-5][0-9]) \* \* \* \*|0 \* \* \* \*"),
    },
    "google_compute_firewall": {
        "direction": _enum(_FIREWALLS, "INGRESS", "EGRESS"),
        "allow.protocol": _enum(_FIREWALLS, "tcp", "udp", "icmp", "esp", "ah", "sctp", "ipip", "all"),
        "allow.ports": _range(_FIREWALLS, 0, 65535),
        "log_config.metadata": _enum(_FIREWALLS, "INCLUDE_ALL_METADATA", "EXCLUDE_ALL_METADATA"),
    },
    "google_compute_subnetwork": {
        "log_config.aggregation_interval": _enum(
            _FLOW_LOGS, "INTERVAL_5_SEC", "INTERVAL_30_SEC", "INTERVAL_1_MIN", "INTERVAL_5_MIN",
            "INTERVAL_10_MIN", "INTERVAL_15_MIN"),
        "log_config.flow_sampling": _range(_FLOW_LOGS, 0, 1),
        "log_config.metadata": _enum(_FLOW_LOGS, "INCLUDE_ALL_METADATA", "EXCLUDE_ALL_METADATA",
                                     "CUSTOM_METADATA"),
    },
    "google_compute_router_nat": {
        "nat_ip_allocate_option": _enum(_ROUTERS, "AUTO_ONLY", "MANUAL_ONLY"),
        "source_subnetwork_ip_ranges_to_nat": _enum(
            _ROUTERS, "ALL_SUBNETWORKS_ALL_IP_RANGES", "ALL_SUBNETWORKS_ALL_PRIMARY_IP_RANGES",
            "LIST_OF_SUBNETWORKS"),
        "log_config.filter": _enum(_ROUTERS, "ERRORS_ONLY", "TRANSLATIONS_ONLY", "ALL"),
    },
    # Watching the run (stacks/alerts.py, stacks/dashboard.py, stacks/billing_budget.py).
    "google_logging_metric": {
        # "For counter metrics, set this to DELTA"; distributions of a logs-based metric too.
        "metric_descriptor.metric_kind": _enum(_TF_LOG_METRIC, "DELTA"),
        "metric_descriptor.value_type": _enum(_LOG_METRICS, "INT64", "DISTRIBUTION", "BOOL"),
        "metric_descriptor.labels.value_type": _enum(_LOG_METRICS, "STRING", "BOOL", "INT64"),
        "metric_descriptor.unit": FieldRule(_UCUM, values=("1", "1/s"),
                                            note="UCUM units; only the two the stack sets"),
        "bucket_options.exponential_buckets.num_finite_buckets": _range(_BUCKETS, 1, None),
        "bucket_options.exponential_buckets.growth_factor": _range(_BUCKETS, 1.000001, None,
                                                                   note="greater than 1"),
        "bucket_options.exponential_buckets.scale": _range(_BUCKETS, 1e-9, None, note="greater than 0"),
    },
    "google_monitoring_alert_policy": {
        "combiner": _enum(_ALERTS, "AND", "OR", "AND_WITH_MATCHING_RESOURCE"),
        "severity": _enum(_ALERTS, "CRITICAL", "ERROR", "WARNING"),
        "conditions.condition_threshold.comparison": _enum(
            _ALERTS, "COMPARISON_GT", "COMPARISON_GE", "COMPARISON_LT", "COMPARISON_LE", "COMPARISON_EQ",
            "COMPARISON_NE"),
        "conditions.condition_threshold.threshold_value": _range(_ALERTS, 0, None,
                                                                 note="ours are counts, never negative"),
        # "only values that are a multiple of a minute" (checked with the relations below).
        "conditions.condition_threshold.duration": _range(_ALERTS, 0, 86400, duration=True,
                                                          note="a multiple of 60 s; at most our day"),
        "conditions.condition_threshold.trigger.count": _range(_ALERTS, 1, None),
        "conditions.condition_threshold.aggregations.alignment_period": _range(
            _AGGREGATION, 60, 86400, duration=True, note="at least 60 s; at most our day"),
        "conditions.condition_threshold.aggregations.per_series_aligner": _enum(
            _AGGREGATION, "ALIGN_NONE", "ALIGN_DELTA", "ALIGN_RATE", "ALIGN_SUM", "ALIGN_COUNT", "ALIGN_MEAN",
            "ALIGN_MAX", "ALIGN_MIN"),
        "conditions.condition_threshold.aggregations.cross_series_reducer": _enum(
            _AGGREGATION, "REDUCE_NONE", "REDUCE_SUM", "REDUCE_MEAN", "REDUCE_MAX", "REDUCE_MIN", "REDUCE_COUNT"),
        "alert_strategy.auto_close": FieldRule(_ALERTS, values=(1800,), duration=True,
                                               note="the page read states no range: only the value we set"),
        # Required on a log-match policy; "the minimum time between notifications" is 5 minutes.
        "alert_strategy.notification_rate_limit.period": _range(
            _LOG_ALERTS, 300, 86400, duration=True, note="log-match policies: at least 5 minutes; at most our day"),
    },
    "google_monitoring_notification_channel": {
        "type": _enum(_CHANNELS, "email", "webhook_tokenauth", "pubsub"),
    },
    "google_billing_budget": {
        "amount.specified_amount.currency_code": FieldRule(_BUDGETS, pattern=r"[A-Z]{3}"),
        "amount.specified_amount.units": _range(_BUDGETS, 1, 2**63 - 1),
        "budget_filter.calendar_period": _enum(_BUDGETS, "MONTH", "QUARTER", "YEAR"),
        "budget_filter.credit_types_treatment": _enum(_BUDGETS, "INCLUDE_ALL_CREDITS", "EXCLUDE_ALL_CREDITS",
                                                      "INCLUDE_SPECIFIED_CREDITS"),
        "threshold_rules.threshold_percent": _range(_BUDGETS, 0, None),
        "threshold_rules.spend_basis": _enum(_BUDGETS, "CURRENT_SPEND", "FORECASTED_SPEND"),
    },
    "google_compute_network": {"routing_mode": _enum(_REST + "networks", "REGIONAL", "GLOBAL")},
    "google_compute_address": {"address_type": _enum(_REST + "addresses", "INTERNAL", "EXTERNAL")},
    "google_dns_managed_zone": {"visibility": _enum(_DNS_ZONES, "public", "private")},
    "google_dns_record_set": {
        "ttl": _range(_DNS_RECORDS, 0, 2**31 - 1),
        "type": _enum(_DNS_RECORDS, "A", "AAAA", "CNAME", "TXT", "PTR", "SRV", "MX", "NS", "SOA"),
    },
}
