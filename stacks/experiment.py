"""The experiment file: a typed, documented pydantic model of one `experiments/*.toml`.

Field-level rules (types, ranges, patterns, enums) are pydantic validators; rules that relate
fields (GPU against machine type, zones against region, Spot combinations) are `problems()`
methods that return every violation at once instead of stopping at the first. `load.py` runs both
and is the only way in: constructs receive a model that has passed every rule.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from stacks import gcp_rules as R
from stacks import health, task_check, trainer_config
from trainer.gpu import runs_on, sm

Problem = tuple[str, str]  # (dotted field path, "what is wrong and what is allowed")

TASK = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")
GCS_PREFIX = re.compile(r"^[A-Za-z0-9][-_.A-Za-z0-9/]{0,254}$")
#: A pool's node that trains without global rank 0 logs ``event=heartbeat`` every
#: ``trainer.config.heartbeat_every_s``; at least this many fit in the stall window, so that a long
#: step between two of them is never a stall.
HEARTBEATS_PER_STALL_WINDOW = 3
#: Flags the stack sets itself from other fields; repeating them in `args` would contradict those.
MANAGED_FLAGS = ("--run-dir", "--steps", "--gcs-uri", "--task", "--health-port", "--local-dir",
                 # `trainer.script`, `trainer.script_args`
                 "--script", "--script-arg",
                 # the prices of `[cost]` / the catalog (`stacks.pricing.trainer_price_args`)
                 "--price-per-hour", "--on-demand-price-per-hour",
                 # `trainer.parallelism`
                 "--parallelism",
                 # `[data]`: where the startup script staged the dataset, or what the trainer streams
                 "--data-dir", "--data-url",
                 # the experiment's checkpoint key (`stacks.checkpoint_key`)
                 "--checkpoint-key-file",
                 # `group.initial_delay_sec`: a restart in place gets a new VM's grace
                 "--startup-grace-s")
REPO = Path(__file__).resolve().parent.parent


def code_path(code_dir: str) -> Path:
    """`trainer.code_dir` as a path: relative paths start at the repository root."""
    return REPO / code_dir  # an absolute code_dir replaces REPO


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    def problems(self) -> Iterator[Problem]:
        """Rules across this section's fields; paths are relative to the section."""
        return iter(())


def _pattern(value: str, pattern: re.Pattern[str], allowed: str) -> str:
    if not pattern.match(value):
        raise ValueError(f"{value!r} is not valid; allowed: {allowed}")
    return value


class Gcp(Section):
    """Where the experiment runs."""

    project: str
    """Google Cloud project id (6-30 characters: lowercase letters, digits, hyphens)."""
    region: str
    """Region of the network, the group and the checkpoint disks, e.g. "us-central1"."""
    zones: list[str] = Field(min_length=1)
    """Zones inside `region` the VMs may run in: one for a zonal group, two or more for a
    regional group. A VM's checkpoint disk pins it to the zone it was first created in."""

    @field_validator("project")
    @classmethod
    def _project(cls, v: str) -> str:
        return _pattern(v, R.PROJECT_ID, "6-30 of a-z 0-9 -, starting with a letter")

    @field_validator("region")
    @classmethod
    def _region(cls, v: str) -> str:
        return _pattern(v, R.REGION, 'a region name such as "us-central1"')

    def problems(self) -> Iterator[Problem]:
        if len(set(self.zones)) != len(self.zones):
            yield "zones", f"lists a zone twice ({self.zones}); allowed: distinct zones"
        for i, zone in enumerate(self.zones):
            if not re.fullmatch(re.escape(self.region) + r"-[a-z]", zone):
                yield (
                    f"zones[{i}]",
                    f"{zone!r} is not a zone of region {self.region!r}; "
                    f'allowed: "{self.region}-a", "{self.region}-b", ...',
                )


class Machine(Section):
    """The VM: machine type, GPUs, provisioning and image."""

    machine_type: str
    """Predefined machine type of family a2, a3, g2 (GPUs built in) or n1 (GPUs attached)."""
    gpu_type: str
    """GPU model, e.g. "nvidia-l4". Must be the built-in GPU on a2/a3/g2; on n1 one of
    nvidia-tesla-t4, -v100, -p100, -p4."""
    gpu_count: int = Field(ge=1)
    """GPUs per VM: the built-in count on a2/a3/g2; 1, 2, 4 (or 8 for V100) on n1."""
    provisioning: Literal["spot", "standard", "flex-start"] = "spot"
    """"spot" (cheap, preemptible with a 30 s notice), "standard" (on-demand) or "flex-start"
    (Dynamic Workload Scheduler: queued until capacity exists, discounted, never preempted, deleted
    after `capacity.flex_max_run_hours`; the job continues on the next flex-start VM, see
    docs/capacity.md)."""
    termination_action: Literal["STOP", "DELETE"] = "DELETE"
    """What Compute Engine does to a preempted Spot VM: "DELETE" (default) or "STOP". In the
    managed instance group it makes no difference to the trainer: the group counts a preempted VM
    as failed and repairs it by recreating it from the template, so the boot disk is rebuilt
    (driver and dependencies installed again) either way, while the stateful checkpoint disk is
    kept and reattached. Spot only."""
    image_family: str = "pytorch-2-9-cu129-ubuntu-2204-nvidia-580"
    """Deep Learning VM image family (it must exist today; older families have been removed)."""
    image_project: str = "deeplearning-platform-release"
    """Project that publishes `image_family`."""
    boot_disk_gb: int = Field(default=200, ge=R.BOOT_DISK_MIN_GB, le=R.PD_SSD_MAX_GB)
    """Boot disk size in GB (pd-balanced); the Deep Learning VM images need about 50 GB."""
    python_version: str | None = None
    """The image's Python as "X.Y": the wheels the VM installs are those of the lock for this
    Python (`make lock`, docs/dependencies.md). Default: from `image_family` (stacks/gcp_rules.py
    names the Python of ubuntu-2204, ubuntu-2404 and debian-12 families); required for a family
    that names none."""

    @field_validator("python_version")
    @classmethod
    def _python(cls, v: str | None) -> str | None:
        return v if v is None else _pattern(v, re.compile(r"^3\.[0-9]{1,2}$"), 'a Python version such as "3.10"')

    @field_validator("image_family", "image_project")
    @classmethod
    def _name(cls, v: str) -> str:
        return _pattern(v, R.GCP_NAME, "lowercase letters, digits and hyphens")

    @property
    def shape(self) -> R.MachineShape:
        return R.MACHINE_TYPES[self.machine_type]

    def problems(self) -> Iterator[Problem]:
        shape = R.MACHINE_TYPES.get(self.machine_type)
        if shape is None:
            fam = R.family(self.machine_type)
            known = sorted(t for t in R.MACHINE_TYPES if R.family(t) == fam)
            allowed = ", ".join(known) if known else "families " + ", ".join(R.FAMILIES)
            yield "machine_type", f"unknown machine type {self.machine_type!r}; allowed: {allowed}"
            return
        if shape.gpu_type is not None:
            if self.gpu_type != shape.gpu_type:
                yield (
                    "gpu_type",
                    f"{self.machine_type} has {shape.gpu_type} built in, not {self.gpu_type!r}; "
                    f'allowed: "{shape.gpu_type}"',
                )
            if self.gpu_count != shape.gpu_count:
                yield (
                    "gpu_count",
                    f"{self.machine_type} has {shape.gpu_count} GPU(s) built in, not "
                    f"{self.gpu_count}; allowed: {shape.gpu_count} (pick another size for more)",
                )
        else:
            limits = R.N1_GPU_LIMITS.get(self.gpu_type)
            if limits is None:
                yield (
                    "gpu_type",
                    f"{self.gpu_type!r} cannot be attached to {self.machine_type}; allowed on n1: "
                    + ", ".join(R.N1_GPU_LIMITS),
                )
            elif self.gpu_count not in limits:
                yield (
                    "gpu_count",
                    f"{self.gpu_count} x {self.gpu_type} is not a valid count; allowed: "
                    + ", ".join(map(str, limits)),
                )
            else:
                lim = limits[self.gpu_count]
                if shape.vcpus > lim.max_vcpus or shape.memory_gb > lim.max_memory_gb:
                    yield (
                        "machine_type",
                        f"{self.machine_type} ({shape.vcpus} vCPU, {shape.memory_gb:g} GB) is too "
                        f"large for {self.gpu_count} x {self.gpu_type}; allowed: at most "
                        f"{lim.max_vcpus} vCPU and {lim.max_memory_gb:g} GB",
                    )
        yield from self._gpu_against_image()
        if R.image_python(self.image_family, self.python_version) is None:
            yield ("image_family", f"{self.image_family!r} names no OS whose Python stacks/gcp_rules.py "
                   "knows, so the wheels shipped with the code cannot be resolved for it; allowed: "
                   "a family naming " + ", ".join(R.IMAGE_OS_PYTHON) + ', or set machine.python_version '
                   '(e.g. "3.10")')
        if self.provisioning == "standard" and shape.spot_or_flex_only:
            yield (
                "provisioning",
                f"{self.machine_type} is offered only as Spot (or flex-start); allowed: "
                '"spot", or a3-highgpu-8g for standard',
            )
        if self.provisioning != "spot" and "termination_action" in self.model_fields_set:
            yield (
                "termination_action",
                f'applies only to provisioning = "spot"; allowed: remove it for "{self.provisioning}"',
            )
        if self.provisioning == "flex-start" and R.family(self.machine_type) not in R.FLEX_START_FAMILIES:
            yield (
                "provisioning",
                f"flex-start does not offer {self.machine_type}; allowed: a machine type of family "
                + ", ".join(R.FLEX_START_FAMILIES),
            )


    def _gpu_against_image(self) -> Iterator[Problem]:
        """A GPU whose compute capability the image's PyTorch has no kernels for would pass
        `import torch` and fail at its first kernel, on every restart, at GPU prices."""
        capability = R.GPU_CAPABILITY.get(self.gpu_type)
        arches = R.image_arch_list(self.image_family)
        if capability is None or arches is None or runs_on(capability, arches):
            return
        yield (
            "gpu_type",
            f"{self.gpu_type} ({sm(capability)}) has no kernels in the PyTorch of image family "
            f"{self.image_family!r} (built for {' '.join(arches)}): the trainer would fail at "
            f"its first kernel; allowed: a newer GPU type, or an image family whose PyTorch "
            f"includes {sm(capability)} (e.g. a cu126 build, if still published)",
        )

    def image_note(self) -> str | None:
        """A line for the user when the GPU cannot be checked against the image before deploy."""
        if R.image_arch_list(self.image_family) is not None:
            return None
        return (f"note: machine.image_family {self.image_family!r} is not in the table of "
                "stacks/gcp_rules.py, so whether its PyTorch has kernels for "
                f"{self.gpu_type} is unchecked here; the trainer checks it at start (exit 2 if "
                "not)")


class Disk(Section):
    """Checkpoint storage attached to each VM."""

    checkpoint_disk_gb: int = Field(default=200, ge=R.PD_SSD_MIN_GB, le=R.PD_SSD_MAX_GB)
    """Size of the pd-ssd checkpoint disk (stateful: kept across repair and preemption). Write
    throughput grows with size (~0.48 MB/s per GB), which bounds the emergency save."""
    local_ssd_count: int = 0
    """Local NVMe SSDs (375 GB each) for the fastest checkpoint tier; lost on preemption.
    0-8, 16 or 24 on n1; on a2-highgpu/megagpu the counts each size allows (e.g. 1, 2, 4, 8 on
    a2-highgpu-1g); a3 and a2-ultragpu bring their own."""

    @field_validator("local_ssd_count")
    @classmethod
    def _ssd(cls, v: int) -> int:
        if v not in R.LOCAL_SSD_COUNTS:
            raise ValueError(
                f"{v} is not valid; allowed: " + ", ".join(map(str, R.LOCAL_SSD_COUNTS))
            )
        return v


class Bucket(Section):
    """The GCS bucket that holds the durable checkpoint tier."""

    name: str | None = None
    """Bucket name (globally unique, 3-63 of a-z 0-9 - _, no dots). Default:
    "<project>-<experiment>-ckpt"."""
    bucket_location: str = "US-CENTRAL1"
    """Bucket location; keep it the region of the VMs to avoid egress charges."""
    force_destroy: bool = False
    """Let `destroy` delete the bucket with every checkpoint in it. Off by default: a destroy
    then fails on a non-empty bucket instead of deleting checkpoints silently."""
    soft_delete_days: int = Field(default=7, ge=0, le=R.SOFT_DELETE_MAX_DAYS)
    """Deleted or overwritten objects stay restorable this many days: 0 (off) or 7 to 90, the
    only values Cloud Storage accepts. Every checkpoint the trainer rotates out is kept (and
    billed) this long: `make cost` shows how much that is."""
    versioning: bool = False
    """Object versioning. Off: the trainer writes every object once, under a new name (but for
    the growing part of a TensorBoard event file, at most 1 MiB, replaced at each upload), and
    deletes only rotated checkpoints, so versions would keep only deleted checkpoints, which
    soft delete keeps already; with both on, each rotated checkpoint is kept `noncurrent_days`
    and then `soft_delete_days` more. Cloud Storage recommends soft delete instead."""
    keep_noncurrent_versions: int = Field(default=3, ge=1, le=100)
    """With versioning: overwritten or deleted objects keep this many older versions."""
    noncurrent_days: int = Field(default=7, ge=1, le=3650)
    """With versioning: older versions are deleted this many days after they stopped being
    current."""

    @field_validator("name")
    @classmethod
    def _bucket_name(cls, v: str | None) -> str | None:
        if v is None:
            return v
        return _check_bucket_name(v)

    def problems(self) -> Iterator[Problem]:
        if not self.versioning:
            for key in ("keep_noncurrent_versions", "noncurrent_days"):
                if key in self.model_fields_set:
                    yield key, "applies only with versioning = true; allowed: remove it"

    @field_validator("soft_delete_days")
    @classmethod
    def _soft_delete(cls, v: int) -> int:
        if 0 < v < R.SOFT_DELETE_MIN_DAYS:
            raise ValueError(f"{v} is not valid; allowed: 0 (off) or {R.SOFT_DELETE_MIN_DAYS} "
                             f"to {R.SOFT_DELETE_MAX_DAYS} (Cloud Storage refuses 1 to 6)")
        return v

    @field_validator("bucket_location")
    @classmethod
    def _location(cls, v: str) -> str:
        return _pattern(v, re.compile(r"^[A-Za-z][-A-Za-z0-9]{1,40}$"),
                        'a location such as "US-CENTRAL1", "US" or "EU"')


def _check_bucket_name(v: str) -> str:
    _pattern(v, R.BUCKET_NAME, "3-63 of a-z 0-9 - _, starting and ending with a letter or digit")
    if v.startswith("goog") or "google" in v:
        raise ValueError(f"{v!r} is not valid; allowed: names without a goog prefix or 'google'")
    return v


class Network(Section):
    """The network the VMs live in. They never get external IPs."""

    mode: Literal["dedicated", "existing"] = "dedicated"
    """"dedicated": a new VPC and subnet with Private Google Access and Cloud NAT. "existing":
    `network` and `subnetwork` name one you already have (it needs Private Google Access, and a
    NAT if the VMs must reach the internet)."""
    network: str | None = None
    """Existing VPC network name (mode = "existing" only)."""
    subnetwork: str | None = None
    """Existing subnetwork name in `gcp.region` (mode = "existing" only)."""
    subnetwork_project: str | None = None
    """Host project of a shared-VPC subnetwork (mode = "existing" only; default: `gcp.project`)."""
    shared_vpc_network_user: Literal["grant", "granted"] | None = None
    """Shared VPC only (`subnetwork_project` is another project), and then required. The group
    creates its VMs as this project's Google APIs service agent
    (PROJECT_NUMBER@cloudservices.gserviceaccount.com), which needs roles/compute.networkUser on
    the host subnetwork; without it the group creates no VM and says so only in `list-errors`.
    "grant": the stack grants it on the subnetwork (your account must be allowed to set IAM on
    that subnetwork in the host project); "granted": the Shared VPC admin has granted it (on the
    subnetwork or the host project) and the stack leaves it alone."""
    subnet_cidr: str = "10.20.0.0/24"
    """Primary range of the dedicated subnet (a private IPv4 range, /8 to /29)."""
    iap_ssh: bool = True
    """Open port 22 to Identity-Aware Proxy only (35.235.240.0/20) for `gcloud compute ssh
    --tunnel-through-iap`. Nothing is ever open to 0.0.0.0/0."""
    dns_query_logging: bool | None = None
    """Log every DNS query the VMs make to Cloud Logging (a Cloud DNS policy on the network).
    Default: on for a `[pool]` on a dedicated network (its nodes look up the coordinator's
    private name there; a few entries per boot and rendezvous), off otherwise: a network takes
    only one DNS policy, and an existing network may have one already (the deploy would fail)."""

    @field_validator("network", "subnetwork")
    @classmethod
    def _names(cls, v: str | None) -> str | None:
        return v if v is None else _pattern(v, R.GCP_NAME, "a network or subnetwork name")

    @field_validator("subnetwork_project")
    @classmethod
    def _subproject(cls, v: str | None) -> str | None:
        return v if v is None else _pattern(v, R.PROJECT_ID, "a project id")

    @field_validator("subnet_cidr")
    @classmethod
    def _cidr(cls, v: str) -> str:
        try:
            net = ipaddress.IPv4Network(v, strict=True)
        except ValueError as e:
            raise ValueError(f"{v!r} is not an IPv4 network ({e}); allowed: e.g. 10.20.0.0/24")
        if not net.is_private or not 8 <= net.prefixlen <= 29:
            raise ValueError(f"{v!r} is not valid; allowed: a private IPv4 range, /8 to /29")
        return v

    def problems(self) -> Iterator[Problem]:
        if self.mode == "existing":
            for key in ("network", "subnetwork"):
                if getattr(self, key) is None:
                    yield key, 'is required when mode = "existing"; allowed: an existing name'
        else:
            for key in ("network", "subnetwork", "subnetwork_project"):
                if getattr(self, key) is not None:
                    yield key, 'is set but mode = "dedicated"; allowed: set mode = "existing"'


class Group(Section):
    """The managed instance group that keeps the trainer running."""

    workers: int = Field(default=1, ge=0, le=1)
    """1 to train, 0 to stop. At 0 the VM and its checkpoint disk are deleted (permanent
    deletion); the bucket keeps the checkpoints to resume from. Several VMs training one job:
    declare a `[pool]`; then 1 runs the pool as declared and 0 stops all of it (the Spot group's
    target size becomes 0 and the on-demand coordinator is stopped, keeping its disks and IP)."""
    placement: Literal["zonal", "regional"] = "zonal"
    """"zonal": one zone (`gcp.zones` has one). "regional": the group spreads over two or more
    zones of `gcp.zones`; its stateful constraints apply (no redistribution, no surge)."""
    initial_delay_sec: int = Field(default=900, ge=0, le=3600)
    """Seconds after a VM starts before autohealing judges it: driver install plus checkpoint
    restore must fit. A trainer restarted in place on a running VM (which this delay does not
    cover) gets the same grace: its health answers `ok starting` this long."""
    stop_when_done: bool = True
    """Stop paying by itself: once the final checkpoint is in the bucket (or the job stopped on
    bad input and the bucket holds its newest checkpoint), the VM writes a stop marker and starts
    the experiment's control job, which scales the group to zero (and stops a pool's
    coordinator). The next deploy keeps it at zero; see docs/capacity.md. false: the VM idles
    ("ok finished") until you scale to zero, and the stack has no control job unless flex-start
    or the on-demand fallback needs one."""


class Trainer(Section):
    """What the VM runs: `python3 -m trainer run ...`."""

    task: str = "trainer.tasks.gpt:build"
    """The training task as `module:callable`. Leave it out when `script` is set."""
    script: str | None = None
    """Or your own training script, which keeps its own loop and iterates `trainer.run`'s steps
    (docs/bring-your-own-model.md): a `.py` file, relative to `code_dir` (which must be set), e.g.
    "train.py". The VM still runs `python -m trainer run`, which runs the script as `__main__`
    from the code directory. Exclusive with `task`."""
    script_args: list[str] = []
    """The script's command line (its `sys.argv[1:]`), e.g. ["--batch-size", "64"], each passed as
    one word. Part of the resume fingerprint: a change is refused by the run's checkpoints."""
    steps: int = Field(ge=1)
    """Total optimizer steps of the run."""
    health_port: int = Field(default=8471, ge=1024, le=65535)
    """TCP port of the trainer's health answer (1024-65535: unprivileged, never SSH)."""
    param_count: int | None = Field(default=None, ge=1)
    """The model's parameter count, for the emergency-save budget (16 bytes per parameter)."""
    state_bytes: int | None = Field(default=None, ge=1)
    """Or the checkpoint size in bytes, when you know it better than the parameter count."""
    args: list[str] = []
    """Extra arguments for `python -m trainer run`, e.g. ["--checkpoint-every-steps", "200"].
    Passed verbatim, each shell-quoted; the flags the stack sets itself are refused."""
    parallelism: Literal["ddp", "fsdp"] = "ddp"
    """How a `[pool]` spreads the model over its ranks, passed as `--parallelism`: "ddp" (every
    rank holds the whole state; global rank 0 writes checkpoints) or "fsdp" (the state is
    sharded over the ranks; each writes its shard). Without a pool it is passed only when set."""
    code_dir: str | None = None
    """Your own code: a directory (absolute, or relative to the repository root) shipped to the
    VM next to the trainer and put on its PYTHONPATH, so that `task` can name a module in it,
    e.g. "mycode" holding mymodel/task.py with task = "mymodel.task:build". Packed like the
    trainer (no __pycache__, tests or hidden entries); a change in it rolls the group."""
    config: dict[str, Any] = {}
    """The trainer's own settings, as in its config file (`python -m trainer run --config`): any
    setting of docs/reference/trainer.md with the same name and type, tables included
    (`[trainer.config.task_args]`, `[trainer.config.tiers.gcs]`), e.g. `batch_size = 32`,
    `precision = "bf16"`. Checked by the trainer's own model before anything is deployed, and
    written to /etc/spottrain/trainer.toml on the VM. The settings the stack sets from other
    fields (run_dir, local_dir, data_dir, gcs_uri, steps, task, health_port, health_host,
    health_request, parallelism, the prices, sinks.monitoring) are refused here, and so is a setting that `args` passes as a flag
    too. A change that alters the resume fingerprint (seed, task_args, batch_size...) is refused
    by the running job's checkpoints: `make review` says which."""

    @field_validator("task")
    @classmethod
    def _task(cls, v: str) -> str:
        return _pattern(v, TASK, 'a Python "package.module:callable"')

    @field_validator("code_dir")
    @classmethod
    def _code_dir(cls, v: str | None) -> str | None:
        if v is not None and not code_path(v).is_dir():
            raise ValueError(f"{v!r} is not a directory (relative paths start at {REPO}); "
                             "allowed: a directory with your Python code")
        return v

    def problems(self) -> Iterator[Problem]:
        if self.param_count is not None and self.state_bytes is not None:
            yield "state_bytes", "is set together with param_count; allowed: one of the two"
        # With the local tier assumed present: `cross_section_problems` checks it against the disk.
        yield from trainer_config.problems(self.config, steps=self.steps, task=self.task,
                                           local_ssd=True, args=self.args)
        user_code = code_path(self.code_dir) if self.code_dir is not None else None
        if self.script is None:
            if self.script_args:
                yield "script_args", "is set without trainer.script; allowed: set script, or remove script_args"
            yield from task_check.problems(self.task, user_code, self.config.get("task_args", {}))
        else:
            if "task" in self.model_fields_set:
                yield ("task", "is set together with trainer.script; allowed: one of the two (a script keeps "
                       "its own loop, a task is built by the trainer's)")
            if "task_args" in self.config:
                yield ("config.task_args", "is set with trainer.script, which takes no task arguments; "
                       "allowed: trainer.script_args")
            yield from task_check.script_problems(self.script, user_code)
        for i, arg in enumerate(self.script_args):
            if any(ord(c) < 32 or ord(c) == 127 for c in arg):
                yield f"script_args[{i}]", "contains a control character; allowed: printable text"
        for i, arg in enumerate(self.args):
            if any(ord(c) < 32 or ord(c) == 127 for c in arg):
                yield f"args[{i}]", "contains a control character; allowed: printable text"
            flag = arg.split("=", 1)[0]
            if flag in MANAGED_FLAGS:
                yield (
                    f"args[{i}]",
                    f"{flag} is set by the stack from other fields; allowed: any other flag",
                )


class Backend(Section):
    """Where Terraform keeps this stack's state."""

    type: Literal["local", "gcs"] = "local"
    """"local": terraform.<experiment>.tfstate in the repository root. "gcs": a bucket you created
    beforehand (versioned), shared by the team."""
    bucket: str | None = None
    """State bucket (type = "gcs" only)."""
    prefix: str | None = None
    """Object prefix inside the state bucket (type = "gcs"; default "spottrain/<experiment>")."""

    @field_validator("bucket")
    @classmethod
    def _bucket(cls, v: str | None) -> str | None:
        return v if v is None else _check_bucket_name(v)

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, v: str | None) -> str | None:
        return v if v is None else _pattern(v, GCS_PREFIX, "a/b/c of letters, digits, - _ .")

    def problems(self) -> Iterator[Problem]:
        if self.type == "gcs" and self.bucket is None:
            yield "bucket", 'is required when type = "gcs"; allowed: an existing bucket name'
        if self.type == "local":
            for key in ("bucket", "prefix"):
                if getattr(self, key) is not None:
                    yield key, 'is set but type = "local"; allowed: set type = "gcs"'


class Cost(Section):
    """Assumptions for the cost estimate (`python -m stacks.cost`); nothing here is deployed."""

    steps_per_second: float = Field(default=1.0, gt=0)
    """Assumed training throughput in optimizer steps per second while the trainer runs (a
    stated assumption, not a measurement: replace it with the rate you measured)."""
    expected_goodput: float = Field(default=0.9, gt=0, le=1)
    """Assumed fraction of Spot VM time that is productive training (the rest: preemptions,
    restarts, restores, lost steps). Replace it with the goodput `trainer status` reports."""
    on_demand_goodput: float = Field(default=1.0, gt=0, le=1)
    """The same fraction on demand (no preemptions), for the comparison."""
    spot_per_hour: float | None = Field(default=None, gt=0)
    """All-in Spot price of one VM in $/hour (machine, GPUs, disks), overriding the catalog in
    `stacks/pricing.py`, e.g. a negotiated rate or a price checked today."""
    on_demand_per_hour: float | None = Field(default=None, gt=0)
    """All-in on-demand price of one VM in $/hour, overriding the catalog."""
    checkpoint_interval_s: float | None = Field(default=None, gt=0)
    """Assumed seconds between checkpoints that reach the bucket, for the storage estimate.
    Default: from `--checkpoint-every-seconds` / `--checkpoint-every-steps` in `trainer.args`,
    else 300 s (the trainer picks the automatic interval at run time and logs it as
    "checkpoint interval for gcs: ...": put that figure here)."""
    flex_start_per_hour: float | None = Field(default=None, gt=0)
    """All-in flex-start price of one VM in $/hour (default: on demand less the documented
    best-case discount; see stacks/policy_cost.py)."""
    restart_minutes: float = Field(default=10.0, ge=0, le=240)
    """Assumed minutes from a new VM to training again (boot, driver, restore): what each
    flex-start VM after the first, and each fallback switch, costs."""


class Capacity(Section):
    """Ways to get GPUs when Spot runs dry, and what they trade away (docs/capacity.md)."""

    machine_types: list[str] = []
    """More machine types the group may create, ranked after `machine.machine_type` (instance
    flexibility: the group takes the first one with capacity). Each must carry the same GPUs
    (`machine.gpu_type` x `gpu_count`). Regional placement only, no `[pool]`, not flex-start."""
    zone_change_on_repair: bool = False
    """Regional placement: a VM recreated after a preemption may come back in another zone of
    `gcp.zones` (where there is capacity). Its checkpoint disk then cannot follow it, so the disk
    is not stateful: every new VM restores from the bucket (the disk tier still serves restarts
    on the same VM)."""
    on_demand_fallback_minutes: int | None = Field(default=None, ge=5, le=1440)
    """Switch to an on-demand VM after this many minutes without a Spot VM, and back to Spot once
    the Compute API's capacity advice says Spot is obtainable again (a scheduled Cloud Run job;
    nothing always-on). Unset: off. Spot provisioning only, no `[pool]`."""
    fallback_check_minutes: int = Field(default=5, ge=1, le=60)
    """How often the fallback check runs (Cloud Scheduler)."""
    back_to_spot_obtainability: float = Field(default=0.7, gt=0, le=1)
    """Capacity-advice obtainability score (0-1) at or above which the job goes back to Spot."""
    min_on_demand_minutes: int = Field(default=30, ge=0, le=1440)
    """Stay on demand at least this long before going back to Spot (each switch costs a save and a
    restore)."""
    flex_max_run_hours: int = Field(default=168, ge=1, le=R.FLEX_START_MAX_RUN_S // 3600)
    """flex-start: how long each VM may run (at most 7 days); the job continues on the next one."""
    flex_stop_before_minutes: int = Field(default=10, ge=2, le=120)
    """flex-start: stop the trainer this long before the VM's end, so that its save reaches the
    bucket before Compute Engine deletes the VM."""

    @field_validator("machine_types")
    @classmethod
    def _types(cls, v: list[str]) -> list[str]:
        for t in v:
            _pattern(t, R.GCP_NAME, "a machine type name")
        return v


class Pool(Section):
    """Several VMs training one job with torchrun's elastic engine (c10d rendezvous): Spot
    workers from the group plus an on-demand coordinator that is never preempted, hosts the
    rendezvous under a stable internal DNS name and, by default, trains too."""

    min_nodes: int = Field(ge=1, le=256)
    """Fewest nodes that train (the coordinator counted when it trains): torchrun starts, and
    keeps training after a preemption, once this many have joined."""
    max_nodes: int = Field(ge=1, le=256)
    """Most nodes that train (the coordinator counted when it trains). The Spot group's target
    size is max_nodes, less one when the coordinator trains."""
    coordinator: bool = True
    """An on-demand (standard-provisioned) coordinator VM `<experiment>-coordinator` hosts the
    rendezvous. Required for now (true): the rendezvous needs a host that is never preempted."""
    coordinator_trains: bool = True
    """The coordinator trains as one of the nodes (same GPUs as the workers). false: it only
    hosts the rendezvous store (`python3 -m trainer rendezvous`) on a small CPU machine, and the
    workers join `<experiment>-EPOCH`, a new epoch after a rendezvous closed (a join timed out in
    a stockout, ranks that kept failing)."""
    coordinator_machine_type: str | None = None
    """The coordinator's machine type. Default: `machine.machine_type` when it trains (it must
    then take the workers' GPU type and count), else "e2-standard-4" (e2-standard-* and n1-*
    without GPUs are allowed)."""
    rendezvous_port: int = Field(default=R.RENDEZVOUS_PORT, ge=1024, le=65535)
    """TCP port of the rendezvous store on the coordinator (1024-65535, not the health port)."""
    max_restarts: int = Field(default=100, ge=0, le=100000)
    """How often torchrun restarts the job (a node lost or joined, a rank failed) before it
    gives up; each restart resumes from the newest checkpoint. A node that gives up closes its
    rendezvous; its unit restarts it into a new one (docs/pools.md, "A closed rendezvous")."""
    rendezvous_last_call_s: int = Field(default=10, ge=0)
    """Seconds the rendezvous waits for more nodes once min_nodes have joined. Every survivor
    idles this long after each node loss (the lost node comes back minutes later, if at all), so
    keep it short: a node that joins late costs only a coordinated save and a restart. At most
    2937: the workers' health check must tolerate it plus 63 s of failed probes, and it can
    tolerate at most 10 probes 300 s apart (docs/pools.md)."""

    @field_validator("coordinator_machine_type")
    @classmethod
    def _machine(cls, v: str | None) -> str | None:
        return v if v is None else _pattern(v, R.GCP_NAME, "a machine type name")

    def problems(self) -> Iterator[Problem]:
        if self.min_nodes > self.max_nodes:
            yield (
                "min_nodes",
                f"{self.min_nodes} is more than max_nodes ({self.max_nodes}); allowed: "
                f"1 to {self.max_nodes}",
            )
        if self.rendezvous_last_call_s > health.MAX_LAST_CALL_S:
            yield (
                "rendezvous_last_call_s",
                f"{self.rendezvous_last_call_s} s cannot be tolerated by the workers' health check "
                f"(the last call plus {health.REJOIN_OVERHEAD_S} s of failed probes; the Compute API "
                f"takes at most {R.HEALTH_THRESHOLD_MAX} probes {R.HEALTH_INTERVAL_MAX_S} s apart); "
                f"allowed: 0 to {health.MAX_LAST_CALL_S}",
            )
        if not self.coordinator:
            yield (
                "coordinator",
                "false is not supported: the rendezvous needs a host that is never preempted; "
                "allowed: true (with coordinator_trains = false for a small CPU-only host)",
            )

    def coordinator_type(self, machine: Machine) -> str:
        """The coordinator's machine type, defaults applied."""
        if self.coordinator_machine_type is not None:
            return self.coordinator_machine_type
        return machine.machine_type if self.coordinator_trains else R.DEFAULT_CPU_COORDINATOR


# --- [data]: a dataset staged onto each VM before training (docs/data.md) -----------
#: gs://BUCKET[/PREFIX]: a readable bucket's name (dots allowed: it is not created here) and an
#: object prefix of printable characters without empty, "." or ".." parts.
DATA_SOURCE = re.compile(r"^gs://([a-z0-9][-_.a-z0-9]{1,220}[a-z0-9])(/[^\x00-\x1f\x7f]*)?$")


class Data(Section):
    """Your dataset: every object under a `gs://` prefix, staged onto each VM before the trainer
    starts (local SSDs when the VM has them, else the checkpoint disk), verified and resumable,
    and handed to the task as `ctx.data_dir`; or, with `stream = true`, read from the bucket as the
    task trains (`ctx.data_url`). The VMs' service account gets read access on that bucket only
    (roles/storage.objectViewer). See docs/data.md."""

    source: str
    """REQUIRED. gs://BUCKET/PREFIX of the dataset, e.g. "gs://my-datasets/openwebtext". A bucket
    of yours other than the checkpoint bucket; every object under the prefix is staged, keeping
    its path below the prefix (gs://b/p/train/0.bin becomes DATA_DIR/train/0.bin). With
    `stream = true`, what the task reads (e.g. "gs://my-datasets/train/shard-{000000..000999}.tar")."""
    parallel: int = Field(default=16, ge=1, le=64)
    """Downloads at once while staging (large objects are fetched in 32 MiB slices)."""
    stream: bool = False
    """true: nothing is staged; the trainer gets `source` as `--data-url` (the task's
    `ctx.data_url`) and reads the data from the bucket as it trains (data larger than the disk).
    `source` is then what the task reads, e.g. webdataset shards
    "gs://my-datasets/train/shard-{000000..000999}.tar" (trainer/data/bucket_shards.py). The same
    read grant on the bucket either way."""

    @field_validator("source")
    @classmethod
    def _source(cls, v: str) -> str:
        m = DATA_SOURCE.match(v)
        allowed = ('allowed: gs://BUCKET/PREFIX (bucket: 3-222 of a-z 0-9 - _ ., starting and '
                   'ending with a letter or digit; prefix: /-separated parts, none empty, "." or "..")')
        if not m:
            raise ValueError(f"{v!r} is not valid; {allowed}")
        bucket, prefix = m.group(1), (m.group(2) or "").strip("/")
        if any(len(part) > 63 for part in bucket.split(".")) or ".." in bucket:
            raise ValueError(f"{v!r} is not valid; {allowed}")
        if bucket.startswith("goog") or "google" in bucket:
            raise ValueError(f"{v!r} is not valid; allowed: a bucket without a goog prefix or 'google'")
        if prefix and any(p in ("", ".", "..") for p in prefix.split("/")):
            raise ValueError(f"{v!r} is not valid; {allowed}")
        return v

    @property
    def bucket(self) -> str:
        return self.source.removeprefix("gs://").split("/", 1)[0]


def data_problems(exp: "Experiment", name: str) -> Iterator[Problem]:
    """The data bucket against the buckets the stack owns."""
    if exp.data is None:
        return
    if exp.data.bucket == exp.bucket_name(name):
        yield ("data.source", f"{exp.data.bucket!r} is the checkpoint bucket this stack creates (and "
               "may destroy with force_destroy; its soft delete and lifecycle apply to everything in "
               "it); allowed: a separate bucket holding your data")
    if exp.backend.bucket is not None and exp.data.bucket == exp.backend.bucket:
        yield ("data.source", f"{exp.data.bucket!r} is the Terraform state bucket (the VMs would read "
               "the state); allowed: a separate bucket holding your data")
# --- end [data] ---------------------------------------------------------------------------------


EMAIL = re.compile(r"^[^@\s\x00-\x1f\x7f\"']{1,64}@[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)+$")
#: An HTTPS URL without blanks, quotes or control characters (Cloud Monitoring posts to it).
WEBHOOK = re.compile(r"^https://[A-Za-z0-9.-]+(:[0-9]{1,5})?(/[^\s\x00-\x1f\x7f\"'<>\\]*)?$")
PUBSUB_TOPIC = re.compile(r"^projects/([a-z][-a-z0-9]{4,28}[a-z0-9])/topics/[A-Za-z][-A-Za-z0-9._~%+]{2,254}$")
#: A Cloud Billing account id: three groups of six hexadecimal digits, e.g. 012345-6789AB-CDEF01.
BILLING_ACCOUNT = re.compile(r"^[0-9A-F]{6}-[0-9A-F]{6}-[0-9A-F]{6}$")
CURRENCY = re.compile(r"^[A-Z]{3}$")


class Alerts(Section):
    """Who hears about the run, and when: the notification channels of the stack's alert policies
    and their thresholds (docs/watch.md). With no channel the alerts exist (each is an incident in
    Cloud Monitoring) and notify nobody; synthesis says so."""

    enabled: bool = True
    """The alert policies (Cloud Monitoring charges $1.50 a month for each one's condition;
    `make cost` shows it). false: none; the logs, the metrics and the dashboard stay."""
    email: list[str] = []
    """Email addresses to notify (one Cloud Monitoring email channel each)."""
    webhook_url: str | None = None
    """An https:// URL that receives every incident as JSON (a webhook channel with token
    authentication: a token in the URL is kept in the channel and in the Terraform state)."""
    pubsub_topic: str | None = None
    """An existing Pub/Sub topic, "projects/P/topics/T", that receives every incident; the stack
    lets Cloud Monitoring's notification service agent publish to it."""
    stall_minutes: int = Field(default=30, ge=5, le=1440)
    """The stall alert: no training step for this long while the trainer runs on a VM (start-up
    and restore count: keep it above the longest of those and of a logging interval)."""
    preemptions_per_hour: int = Field(default=3, ge=1, le=100)
    """The preemption alert: more Spot preemptions than this within an hour."""
    repairs_per_hour: int = Field(default=2, ge=1, le=100)
    """The repair-loop alert: more VM boots within an hour than preemptions explain (a VM the
    health check keeps recreating, a boot that keeps failing) than this."""
    capacity_wait_minutes: int = Field(default=120, ge=10, le=1440)
    """The capacity alert: the group has failed to create a VM for lack of capacity (a stockout)
    for this long."""
    notify_finished: bool = True
    """Also say when the run has finished (an incident that closes itself)."""

    @field_validator("email")
    @classmethod
    def _email(cls, v: list[str]) -> list[str]:
        for address in v:
            _pattern(address, EMAIL, "an email address such as \"me@example.com\"")
        if len(set(v)) != len(v):
            raise ValueError(f"lists an address twice ({v}); allowed: distinct addresses")
        return v

    @field_validator("webhook_url")
    @classmethod
    def _webhook(cls, v: str | None) -> str | None:
        return v if v is None else _pattern(v, WEBHOOK, "an https:// URL without blanks or quotes")

    @field_validator("pubsub_topic")
    @classmethod
    def _topic(cls, v: str | None) -> str | None:
        return v if v is None else _pattern(v, PUBSUB_TOPIC, '"projects/PROJECT/topics/TOPIC"')

    @property
    def channels(self) -> int:
        return len(self.email) + (self.webhook_url is not None) + (self.pubsub_topic is not None)


class Budget(Section):
    """A Cloud Billing budget on what this experiment's resources cost (their
    `spottrain-experiment` label), with alert thresholds; absent: none. Creating it needs Billing
    Account Administrator or Costs Manager on the account (docs/watch.md)."""

    billing_account: str
    """REQUIRED in [budget]. The Cloud Billing account id, e.g. "012345-6789AB-CDEF01"
    (`gcloud billing accounts list`)."""
    amount_usd: int = Field(ge=1, le=10_000_000)
    """REQUIRED in [budget]. The budget per period, in whole units of the billing account's
    currency (US dollars for a USD account)."""
    currency_code: str | None = None
    """The billing account's currency (ISO 4217, "EUR"), if you want it stated. Absent: the budget
    takes the account's own; set, the Budget API refuses any currency but the account's."""
    period: Literal["month", "quarter", "year"] = "month"
    """The budget's calendar period: spend counts from its start (Pacific time)."""
    thresholds: list[float] = [0.5, 0.9, 1.0]
    """Fractions of the amount at which the budget alerts (0.5 = 50%), each above 0 and at most 5."""
    forecast: bool = False
    """Also alert when the period's forecast spend reaches the amount (before it is spent)."""

    @field_validator("billing_account")
    @classmethod
    def _account(cls, v: str) -> str:
        return _pattern(v, BILLING_ACCOUNT, "18 characters, three groups of six uppercase hexadecimal "
                        "digits joined by dashes, e.g. \"012345-6789AB-CDEF01\"")

    @field_validator("currency_code")
    @classmethod
    def _currency(cls, v: str | None) -> str | None:
        return v if v is None else _pattern(v, CURRENCY, 'three uppercase letters (ISO 4217), e.g. "EUR"')

    @field_validator("thresholds")
    @classmethod
    def _thresholds(cls, v: list[float]) -> list[float]:
        if not v or len(v) > 10:
            raise ValueError(f"{len(v)} thresholds; allowed: 1 to 10")
        for t in v:
            if not 0 < t <= 5:
                raise ValueError(f"{t} is not a threshold; allowed: a fraction above 0 and at most 5")
        if sorted(set(v)) != v:
            raise ValueError(f"{v} is not increasing; allowed: distinct fractions in increasing order")
        return v


SECTIONS: dict[str, type[Section]] = {
    "gcp": Gcp, "machine": Machine, "disk": Disk, "bucket": Bucket, "network": Network,
    "group": Group, "trainer": Trainer, "pool": Pool, "backend": Backend, "cost": Cost,
    "capacity": Capacity, "data": Data, "alerts": Alerts, "budget": Budget,
}  # fmt: skip


class Experiment(BaseModel):
    """One training experiment; the file stem names it and its stack."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    labels: dict[str, str] = {}
    """Labels on every resource (keys: a-z first, then a-z 0-9 - _; values: a-z 0-9 - _)."""
    gcp: Gcp
    """Project, region and zones."""
    machine: Machine
    """Machine type, GPUs, provisioning, image."""
    disk: Disk = Disk()
    """Checkpoint disk and local SSDs."""
    bucket: Bucket = Bucket()
    """The durable checkpoint bucket."""
    network: Network = Network()
    """Dedicated or existing network."""
    group: Group = Group()
    """The managed instance group."""
    trainer: Trainer
    """The training run."""
    pool: Pool | None = None
    """Multi-node training: Spot workers plus an on-demand coordinator (absent: one VM)."""
    backend: Backend = Backend()
    """Terraform state backend."""
    cost: Cost = Cost()
    """Assumptions and price overrides for the cost estimate."""
    capacity: Capacity = Capacity()
    """Capacity options: ranked machine types, zone change, on-demand fallback, flex-start."""
    data: Data | None = None
    """A dataset in a bucket, staged onto each VM before training (absent: none)."""
    alerts: Alerts = Alerts()
    """Who is notified and when: channels and alert thresholds (docs/watch.md)."""
    budget: Budget | None = None
    """A Cloud Billing budget on the experiment's spending (absent: none)."""

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        if len(v) > R.MAX_LABELS - 1:  # one is ours: spottrain-experiment
            raise ValueError(f"{len(v)} labels; allowed: at most {R.MAX_LABELS - 1}")
        for key, value in v.items():
            if not R.LABEL_KEY.match(key):
                raise ValueError(
                    f"key {key!r} is not valid; allowed: a-z first, then up to 62 of a-z 0-9 - _"
                )
            if not R.LABEL_VALUE.match(value):
                raise ValueError(
                    f"value {value!r} of {key!r} is not valid; allowed: up to 63 of a-z 0-9 - _"
                )
        return v

    def problems(self, name: str) -> Iterator[Problem]:
        """Every cross-field rule, section rules included; `name` is the experiment name."""
        for key in SECTIONS:
            section = getattr(self, key)
            if section is None:  # an optional section left out
                continue
            for path, msg in section.problems():
                yield f"{key}.{path}", msg
        yield from cross_section_problems(self, name)

    @property
    def dns_query_logging(self) -> bool:
        """`network.dns_query_logging` with its default applied."""
        if self.network.dns_query_logging is not None:
            return self.network.dns_query_logging
        return self.pool is not None and self.network.mode == "dedicated"

    def bucket_name(self, name: str) -> str:
        # At most 30 + 1 + 21 + 5 = 57 characters: within the 63 allowed.
        return self.bucket.name or f"{self.gcp.project}-{name}-ckpt"


def shared_vpc_problems(exp: Experiment) -> Iterator[Problem]:
    """The service agent's Network User on a shared VPC's subnetwork: said how, or refused."""
    net = exp.network
    shared = net.mode == "existing" and net.subnetwork_project not in (None, exp.gcp.project)
    if shared and net.shared_vpc_network_user is None:
        yield (
            "network.shared_vpc_network_user",
            f"is required for a shared VPC (subnetwork {net.subnetwork!r} of host project "
            f"{net.subnetwork_project!r}): the group creates its VMs as project "
            f"{exp.gcp.project!r}'s Google APIs service agent "
            "(PROJECT_NUMBER@cloudservices.gserviceaccount.com), and without "
            "roles/compute.networkUser on that subnetwork it creates no VM at all; allowed: "
            '"grant" (the stack grants it) or "granted" (your Shared VPC admin did)',
        )
    if not shared and net.shared_vpc_network_user is not None:
        yield (
            "network.shared_vpc_network_user",
            "applies only to a shared VPC (mode = \"existing\" with subnetwork_project another "
            "project); allowed: remove it",
        )


def cross_section_problems(exp: Experiment, name: str) -> Iterator[Problem]:
    yield from shared_vpc_problems(exp)
    tiers = exp.trainer.config.get("tiers")
    if isinstance(tiers, dict) and "local" in tiers and exp.disk.local_ssd_count == 0:
        yield ("trainer.config.tiers.local",
               "sets the local SSD tier, but disk.local_ssd_count = 0 (there is none); allowed: "
               "remove it, or add local SSDs")
    zones = len(exp.gcp.zones)
    if exp.group.placement == "zonal" and zones != 1:
        yield (
            "gcp.zones",
            f'{zones} zones for placement = "zonal"; allowed: exactly one, or '
            'placement = "regional"',
        )
    if exp.group.placement == "regional" and zones < 2:
        yield (
            "gcp.zones",
            'one zone for placement = "regional"; allowed: two or more, or placement = "zonal"',
        )
    shape = R.MACHINE_TYPES.get(exp.machine.machine_type)
    if shape is not None and exp.disk.local_ssd_count:
        fam = R.family(exp.machine.machine_type)
        if shape.bundled_local_ssd or fam == "g2":
            yield (
                "disk.local_ssd_count",
                f"{exp.machine.machine_type} cannot take Local SSDs from this setting "
                f"(a3 and a2-ultragpu bring their own; g2 is not supported yet); allowed: 0",
            )
        elif shape.local_ssd_counts and exp.disk.local_ssd_count not in shape.local_ssd_counts:
            yield (
                "disk.local_ssd_count",
                f"{exp.machine.machine_type} takes {exp.disk.local_ssd_count} Local SSDs in no "
                f"configuration; allowed: " + ", ".join(map(str, shape.local_ssd_counts)),
            )
    if exp.bucket.name is None and not any(check_name(name)):  # a bad name is reported once
        try:
            _check_bucket_name(exp.bucket_name(name))
        except ValueError as err:
            yield "bucket.name", f"the default name: {err}; or set bucket.name"
    beat = exp.trainer.config.get("heartbeat_every_s")
    window_s = exp.alerts.stall_minutes * 60
    if isinstance(beat, (int, float)) and beat * HEARTBEATS_PER_STALL_WINDOW > window_s:
        yield ("trainer.config.heartbeat_every_s",
               f"{beat} s is not well under alerts.stall_minutes ({window_s} s): a pool's healthy nodes would "
               f"raise the stall alert between heartbeats; allowed: at most {window_s / HEARTBEATS_PER_STALL_WINDOW:g} s")
    if exp.pool is not None:
        yield from pool_problems(exp)
    yield from capacity_problems(exp)
    yield from data_problems(exp, name)
    if exp.backend.bucket is not None and exp.backend.bucket == exp.bucket_name(name):
        yield (
            "backend.bucket",
            "is the checkpoint bucket this stack creates; allowed: a separate, existing bucket",
        )


def capacity_problems(exp: Experiment) -> Iterator[Problem]:
    """The `[capacity]` options against placement, provisioning and the pool."""
    c, m = exp.capacity, exp.machine
    regional = exp.group.placement == "regional"
    if c.machine_types:
        if not regional:
            yield ("capacity.machine_types", 'ranked machine types need placement = "regional" (the '
                   'provider offers instance flexibility on regional groups only); allowed: [] or a '
                   'regional group')
        if exp.pool is not None or m.provisioning == "flex-start":
            yield ("capacity.machine_types", "is not supported with a [pool] or flex-start; allowed: []")
        for i, t in enumerate(c.machine_types):
            if t == m.machine_type or t in c.machine_types[:i]:
                yield f"capacity.machine_types[{i}]", f"{t} is listed twice; allowed: distinct types"
                continue
            as_machine = m.model_copy(update={"machine_type": t})
            for path, msg in as_machine.problems():
                if path in ("machine_type", "gpu_type", "gpu_count", "provisioning"):
                    yield (f"capacity.machine_types[{i}]",
                           f"{t} cannot take the group's {m.gpu_count} x {m.gpu_type}: {msg}")
            base = R.MACHINE_TYPES.get(m.machine_type)
            if base is not None and t in R.MACHINE_TYPES and base.gpu_type is None \
                    and R.MACHINE_TYPES[t].gpu_type is not None:
                yield (f"capacity.machine_types[{i}]",
                       f"{t} has GPUs built in and {m.machine_type} takes attached ones: one template "
                       "cannot serve both; allowed: machine types of the same family")
    if c.zone_change_on_repair and not regional:
        yield ("capacity.zone_change_on_repair", 'needs placement = "regional" (a zonal group has one '
               'zone); allowed: false')
    if c.on_demand_fallback_minutes is not None:
        if m.provisioning != "spot":
            yield ("capacity.on_demand_fallback_minutes", f'falls back from Spot, but provisioning = '
                   f'"{m.provisioning}"; allowed: unset, or provisioning = "spot"')
        if exp.pool is not None:
            yield ("capacity.on_demand_fallback_minutes", "is not supported with a [pool] (its "
                   "coordinator is on demand already); allowed: unset")
        shape = R.MACHINE_TYPES.get(m.machine_type)
        if shape is not None and shape.spot_or_flex_only:
            yield ("capacity.on_demand_fallback_minutes", f"{m.machine_type} is not offered on demand; "
                   "allowed: unset, or a machine type offered on demand")
    if m.provisioning == "flex-start" and exp.pool is not None:
        yield ("machine.provisioning", 'flex-start is not supported with a [pool] yet; allowed: "spot" '
               'or "standard"')


def pool_problems(exp: Experiment) -> Iterator[Problem]:
    """The pool against the rest: the coordinator's machine and the ports. (The durable tier
    every node restores from, the bucket, always exists: the stack sets --gcs-uri itself and
    `MANAGED_FLAGS` keeps it out of `trainer.args`.)"""
    pool, m = exp.pool, exp.machine
    assert pool is not None
    if pool.rendezvous_port == exp.trainer.health_port:
        yield (
            "pool.rendezvous_port",
            f"{pool.rendezvous_port} is also trainer.health_port; allowed: another port in "
            "1024-65535",
        )
    yield from coordinator_problems(pool, m)
    yield from global_batch_problems(exp)


def global_batch_problems(exp: Experiment) -> Iterator[Problem]:
    """`global_batch_size` in `[trainer.config]` or `--global-batch-size G` in `trainer.args`:
    every world size the pool can take (gpu_count x min_nodes .. max_nodes) must divide G, or the
    trainer would refuse to start after a node is lost (it also needs G / world size to be a
    multiple of its batch_size, which only the trainer knows)."""
    pool, args = exp.pool, exp.trainer.args
    assert pool is not None
    found: tuple[str, object] | None = None
    configured = exp.trainer.config.get("global_batch_size")
    if isinstance(configured, int) and not isinstance(configured, bool):
        found = "trainer.config.global_batch_size", configured  # args cannot set it too (refused)
    for i, arg in enumerate(args):
        flag, eq, given = arg.partition("=")
        if found is not None or flag != "--global-batch-size":
            continue
        found = f"trainer.args[{i}]", given if eq else (args[i + 1] if i + 1 < len(args) else "")
    if found is None:
        return
    path, value = found
    try:
        g = int(value)  # type: ignore[call-overload]
    except ValueError:
        yield path, f"--global-batch-size needs a whole number, got {value!r}"
        return
    sizes = [exp.machine.gpu_count * n for n in range(pool.min_nodes, pool.max_nodes + 1)]
    bad = [w for w in sizes if w <= 0 or g % w]
    if bad:
        ok = [w for w in sizes if w > 0 and not g % w]
        yield (
            path,
            f"{'global_batch_size' if path.startswith('trainer.config') else '--global-batch-size'}"
            f" {g} is not divisible by the world size(s) {bad} this pool can "
            f"run at (gpu_count x {pool.min_nodes}..{pool.max_nodes} nodes; divisible: "
            f"{ok or 'none'}); allowed: a multiple of {_lcm(sizes)}",
        )


def _lcm(values: list[int]) -> int:
    import math

    out = 1
    for v in values:
        out = out * v // math.gcd(out, v) if v > 0 else out
    return out


def coordinator_problems(pool: Pool, m: Machine) -> Iterator[Problem]:
    key = "pool.coordinator_machine_type"
    ctype = pool.coordinator_type(m)
    if not pool.coordinator_trains:
        if ctype not in R.CPU_MACHINE_TYPES:
            yield (
                key,
                f"{ctype!r} is not a machine type without GPUs, which a coordinator that does "
                "not train needs; allowed: e2-standard-2, -4, -8, -16, -32 or an n1 type, "
                'e.g. "e2-standard-4"',
            )
        return
    # It trains: the workers' GPUs, on a machine that takes them with standard provisioning.
    as_standard = Machine(machine_type=ctype, gpu_type=m.gpu_type, gpu_count=m.gpu_count,
                          provisioning="standard")
    for _, msg in as_standard.problems():
        yield (
            key,
            f"the coordinator trains with the workers' {m.gpu_count} x {m.gpu_type} on demand: "
            f"{msg}",
        )


def check_name(name: str) -> Iterator[Problem]:
    if not R.GCP_NAME.match(name) or len(name) > R.MAX_EXPERIMENT_NAME:
        yield (
            "(file name)",
            f"{name!r} cannot name a stack; allowed: 1-{R.MAX_EXPERIMENT_NAME} of a-z 0-9 -, "
            "starting with a letter, not ending with -",
        )
