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


#: Seconds between the ACPI soft-off and the hard power-off. A flex-start VM deleted at the end
#: of its run duration is given no documented window: plan as for Spot (its trainer saves before
#: the end anyway, `capacity.flex_stop_before_minutes`).
SHUTDOWN_WINDOW_S = {"spot": 30, "standard": 120, "flex-start": 30}

# --- flex-start (Dynamic Workload Scheduler) -----------------------------------------------------

#: Machine families flex-start offers that this project supports (GPU VMs; compute/docs/instances/
#: about-flex-start-vms). N1 with attached GPUs is not among them.
FLEX_START_FAMILIES = ("a2", "a3", "g2")
#: A flex-start VM runs at most 7 days (resize requests accept 10 minutes to 7 days).
FLEX_START_MAX_RUN_S = 7 * 24 * 3600
FLEX_START_MIN_RUN_S = 10 * 60
#: Seconds of the window not available to the save: the shutdown script starting, the trainer
#: noticing, fsync and unit teardown.
SHUTDOWN_MARGIN_S = 10

HEALTH_CHECK_RANGES = ("35.191.0.0/16", "130.211.0.0/22")
#: torchrun's default c10d rendezvous port.
RENDEZVOUS_PORT = 29400
#: The private DNS domain under which a pool's coordinator gets its stable name.
POOL_DOMAIN = "spottrain.internal"
IAP_RANGE = "35.235.240.0/20"
