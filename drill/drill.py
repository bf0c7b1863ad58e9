"""The preemption drill: the real boot scripts and the real trainer, preempted K times on a laptop.

1. Render the experiment's real startup/shutdown scripts (`stacks.boot.render`), with the step
   count, checkpoint cadence and health port overridden so that the run is short and
   parallel-safe. The trainer (a snapshot of `trainer/`, and the experiment's `code_dir`) is
   packed by `stacks.delivery` and uploaded to the emulated bucket, as `cdktn deploy` would:
   the startup script fetches, verifies and installs it. (A stack without delivery gets the
   snapshot preinstalled on the VM image instead.)
2. Reference: one VM (`drill.sandbox`) with a blank disk, its own gcp-storage-emulator and fake
   metadata server, trains from start to finish uninterrupted; its final model digest is kept.
3. Drill: the same on fresh fakes, but each round's VM is preempted the way GCE does it once the
   trainer has passed a seeded random step (plus a seeded random fraction of a logging interval):
   the metadata `preempted` flag turns TRUE, the shutdown script runs (ACPI soft-off), and what is
   still alive when the window closes is killed with the VM. Optionally the disk is replaced by
   a blank one between rounds (the VM was recreated in another zone: restore from GCS). After K
   preemptions a last VM trains to the end.
4. The final digest (`python -m trainer status --json`) must equal the reference's; the report
   shows goodput, its badput parts, work lost per preemption and each emergency save's time
   against the window.

The drill waits on events (journal lines, unit state changes, a process exit), never on sleeps;
the timeouts are failure guards.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from drill.fake_gcp import FakeGcp
from drill.fake_observability import FakeObservability
from drill.gcs_emulator import StorageEmulator
from drill.net import free_port
from drill.metadata_server import MetadataServer
from drill.sandbox import REPO, Disk, Sandbox, disk_status
from stacks.lock import this_python
from trainer import shutdown_window

DEVICE_NAME = "spottrain-checkpoints"
MOUNT_DIR = "/mnt/spottrain"
UNIT = "spottrain.service"
STEP_RE = re.compile(r"\bevent=step step=(\d+)/(\d+)\b.*?steps_per_s=([\d.]+)")
RESTORE_RE = re.compile(r"\bevent=restore step=(\d+)(?: tier=(\S+))?")
# The trainer's emergency-save line; fields are found by name, so that one added between them
# (as local_ok was) cannot silently drop the measured seconds.
PREEMPTED_RE = re.compile(r"\bevent=preempted step=(\d+)(?:[^\n]*? persistent_ok=(\d))?(?:[^\n]*? gcs_ok=(\S+))?"
                          r"(?:[^\n]*? seconds=([\d.]+))?")
#: A preempted line without a save: its detail says why (a notice during start-up, nothing trained).
NO_SAVE_RE = re.compile(r"\bevent=preempted step=(?:\d+|none) detail=([^;\n]*)")
EXIT_PREEMPTED = 75
#: The access token the VMs' fake metadata server hands out: the fake Google APIs know it as the
#: trainer's service account, with exactly the grants of the experiment's synthesized stack.
DRILL_TOKEN = "drill-fake-token"
#: The operator's (the deployer's, a project Owner): `trainer status` reading the checkpoint key.
OPERATOR_TOKEN = "drill-operator-token"
MIN_STEPS_PER_ROUND = 30


#: The environment variable naming `DrillConfig.reference_cache`'s default.
REFERENCE_CACHE_ENV = "SPOTTRAIN_DRILL_REFERENCE_CACHE"


def _env_path(name: str) -> Path | None:
    value = os.environ.get(name)
    return Path(value) if value else None


class DrillFailure(Exception):
    """The drill could not run to the end (a VM failed, a guard timed out)."""


@dataclass(frozen=True)
class DrillConfig:
    """One drill. Defaults are `make demo`'s short run."""

    experiment: Path = REPO / "experiments" / "example.toml"
    steps: int = 300
    """Total optimizer steps (overrides the experiment's)."""
    preemptions: int = 2
    wipe_disk_after: tuple[int, ...] = ()
    """1-based preemptions after which the next VM gets a blank disk (restore from GCS)."""
    seed: int = 0
    """Seeds the preemption moments (the trainer's own seed stays the experiment's)."""
    window_s: float = float(shutdown_window.window_s("spot"))
    """Seconds from the preemption notice to the hard power-off (`trainer.shutdown_window`: 30
    for Spot)."""
    checkpoint_every_steps: int | None = None
    """Periodic save cadence in the drill (default: steps // 6); replaces the experiment's."""
    disk_mb: int = 128
    guard_s: float = 600.0
    """Failure guard for any single wait (a VM that never trains, a save that never ends)."""
    workdir: Path | None = None
    """Where VM state, disks and logs go (default: a temp dir, removed unless keep)."""
    keep: bool = False
    trainer_source: Path = REPO / "trainer"
    """The trainer package the VMs get (snapshotted once per drill)."""
    nodes: int = 1
    """Training VMs: 1 is the single-VM drill; N >= 2 a pool (`drill.pool_drill`): an on-demand
    coordinator that trains and N - 1 Spot workers, the workers preempted in turn."""
    reference: bool = True
    """Run the uninterrupted reference first and require the same final model. Off only where the
    question is another one (the lifecycle drill's variants: what a deploy leaves behind)."""
    reference_cache: Path | None = field(default_factory=lambda: _env_path(REFERENCE_CACHE_ENV))
    """A folder of reference results, each under the digest of everything that determines it
    (`reference_key`): a drill whose reference is there takes it instead of running it again.
    Default: $SPOTTRAIN_DRILL_REFERENCE_CACHE (the test suite sets build/drill-reference); none
    for `make drill`, which runs its reference every time."""
    stall_s: int | None = None
    """The VMs' log shipper's stall window, seconds (default: the experiment's stall_minutes), and
    the trainers' ``heartbeat_every_s`` with it: a drill that shows a healthy run raising no stall
    runs longer than it."""


@dataclass
class Preemption:
    index: int
    boot: int
    resumed_from: int | None = None
    resumed_tier: str | None = None
    target_step: int = 0
    notice_after_step: int = 0
    saved_step: int | None = None
    save_s: float | None = None
    no_save: str | None = None
    """Why the round has no emergency-save time, when it has none."""
    persistent_ok: bool | None = None
    gcs_ok: str | None = None
    trainer_exit: int | None = None
    unit_stopped_s: float | None = None
    off_s: float = 0.0
    killed: bool = False
    wiped_after: bool = False
    next_resumed_from: int | None = None
    steps_per_s: float = 0.0

    @property
    def steps_lost(self) -> int | None:
        if self.next_resumed_from is None:
            return None
        reached = self.saved_step if self.saved_step is not None else self.notice_after_step
        return max(0, reached - self.next_resumed_from)


@dataclass
class DrillResult:
    config: DrillConfig
    reference_digest: str | None
    digest: str | None
    status: dict[str, Any]
    preemptions: list[Preemption] = field(default_factory=list)
    reference_s: float = 0.0
    drill_s: float = 0.0
    final_resumed_from: int | None = None
    workdir: Path | None = None
    after_finish: dict[str, Any] = field(default_factory=dict)
    """One more boot after the run finished: {"unit_started": bool, "guest_state": str|None}."""
    group_sizes: list[int] = field(default_factory=list)
    """The group's target size after every change the fake Compute API saw (scale to zero)."""
    logs: list[str] = field(default_factory=list)
    """`python -m trainer logs` over what the drill's VMs shipped to (the loopback) Cloud Logging."""
    refusals: list[tuple[str, str, str]] = field(default_factory=list)
    """Every call the stack's grants did not allow (principal, permission, resource): Google would
    have refused them too. None in a healthy drill."""
    control_runs: list[int] = field(default_factory=list)
    """The exit status of each execution of the control job (0: every step done and confirmed)."""

    @property
    def ok(self) -> bool:
        same = self.digest == self.reference_digest or not self.config.reference
        return (self.digest is not None and same and not self.refusals and not any(self.control_runs))


# --- the boot scripts ------------------------------------------------------------------------
@dataclass(frozen=True)
class Rendered:
    startup: str
    shutdown: str
    name: str
    bucket: str
    gcs_uri: str
    local_ssd_count: int
    health_port: int = 0
    uploads: tuple[tuple[str, Path], ...] = ()
    """(object name, local file) the stack would upload to the bucket: the code archives."""
    props: Any = field(default=None, compare=False)
    """The `stacks.boot.BootProps` the scripts were rendered from."""
    spec: Any = field(default=None, compare=False)
    """The `stacks.experiment.Experiment` they were rendered for (with the drill's pool, if any):
    its synthesized stack's grants are what the fake Google APIs allow (`project_fake`)."""

    @property
    def delivers_trainer(self) -> bool:
        return bool(self.uploads)



def many_tensors(exp: Any) -> Any:
    """A multi-rank experiment (a pool, or several GPUs a VM) that trains the bundled GPT without
    choosing its size trains the model of hundreds of tensors (``drill.tiny_gpt``): a restore
    between ranks must cost one copy of the state whatever the number of tensors, and the default
    few-tensor model hid that it did not. Anything else is the experiment as written."""
    from drill.tiny_gpt import MULTI_RANK_SIZE

    multi_rank = exp.pool is not None or exp.machine.gpu_count > 1
    args = dict(exp.trainer.config.get("task_args") or {})
    if not multi_rank or exp.trainer.task != "trainer.tasks.gpt:build" or "n_layer" in args:
        return exp
    config = {**exp.trainer.config, "task_args": {**args, **MULTI_RANK_SIZE}}
    return exp.model_copy(update={"trainer": exp.trainer.model_copy(update={"config": config})})


def render(cfg: DrillConfig, health_port: int, *, trainer_source: Path | None = None,
           code_dir: Path | None = None, extra: dict[str, Any] | None = None, pool: Any = None,
           trainer_args: tuple[str, ...] = ()) -> Rendered:
    """The experiment's real scripts, as the stack renders them, with the drill's overrides.

    With `trainer_source` and a stack that delivers code (`stacks.delivery`), the trainer is
    packed as the stack packs it and the scripts fetch it from the bucket; otherwise the VM
    image carries it preinstalled. `extra`: more BootProps fields (e.g. driver_timeout_s).
    `pool`: a `stacks.experiment.Pool` replacing the experiment's own (the multi-node drill's).
    `trainer_args`: more `trainer run` flags, after the experiment's."""
    from stacks.boot import boot_props, render as render_boot
    from stacks.load import load_file

    from stacks.wheels import for_python

    ef = load_file(cfg.experiment)
    exp = ef.spec if pool is None else ef.spec.model_copy(update={"pool": pool})
    if cfg.stall_s is not None and "logs" not in (extra or {}):
        from stacks.boot import LogShipping

        extra = {**(extra or {}), "logs": LogShipping(project=exp.gcp.project, stall_s=cfg.stall_s)}
    if cfg.stall_s is not None:  # the nodes' heartbeat as far inside that window as the stack's rule asks
        from stacks.experiment import HEARTBEATS_PER_STALL_WINDOW

        beat = {**exp.trainer.config, "heartbeat_every_s": cfg.stall_s / HEARTBEATS_PER_STALL_WINDOW}
        exp = exp.model_copy(update={"trainer": exp.trainer.model_copy(update={"config": beat})})
    exp = many_tensors(exp)
    # The VM stand-in's Python is this one (drill.sandbox), not the image's: its wheels are the
    # lock for this Python (`make lock` writes it beside the image's), and the startup script's
    # check of the Python they were locked for holds.
    exp = for_python(exp, this_python())
    every = cfg.checkpoint_every_steps or max(1, cfg.steps // 6)
    args = _replace_flag(list(exp.trainer.args), "--checkpoint-every-steps", str(every)) + list(trainer_args)
    uploads: list[tuple[str, Path]] = []
    releases: tuple = ()
    if trainer_source is not None:
        from stacks.delivery import trainer_archive, user_archive, wheels_archive
        from stacks.experiment import code_path
        from stacks.wheels import shipped_wheels

        archives = [trainer_archive(trainer_source, out_dir=code_dir)]
        user_code = code_path(exp.trainer.code_dir) if exp.trainer.code_dir is not None else None
        if user_code is not None:  # the user's own code, shipped beside the trainer
            archives.append(user_archive(user_code, out_dir=code_dir))
        # What a deploy ships besides the code: the locked wheels, installed offline by the
        # startup script; the VM's Python finds its dependencies there, not in the host's venv.
        archives.append(wheels_archive(shipped_wheels(exp, user_code, ef.name), out_dir=code_dir))
        releases = tuple(a.release for a in archives)
        uploads += [(a.release.object_name, a.path) for a in archives]
    # The stack's own props, with the drill's step count, health port and checkpoint cadence.
    props = boot_props(ef.name, exp, releases=releases, steps=cfg.steps, health_port=health_port,
                       args=tuple(args), **(extra or {}))
    scripts = render_boot(props)
    return Rendered(scripts.startup, scripts.shutdown, ef.name, props.bucket, props.gcs_uri,
                    exp.disk.local_ssd_count, health_port, tuple(uploads), props, exp)


def drill_wheels(cfg: DrillConfig) -> Path:
    """The wheels the drill's VMs install: the experiment's lock for this Python, fetched (or
    cached); InputError (exit 2) when it is missing or stale."""
    from stacks.experiment import code_path
    from stacks.load import load_file
    from stacks.wheels import for_python, shipped_wheels

    ef = load_file(cfg.experiment)
    code = code_path(ef.spec.trainer.code_dir) if ef.spec.trainer.code_dir is not None else None
    return shipped_wheels(for_python(ef.spec, this_python()), code, ef.name)


def _replace_flag(args: list[str], flag: str, value: str) -> list[str]:
    out, skip = [], False
    for i, a in enumerate(args):
        if skip:
            skip = False
            continue
        if a == flag:
            skip = True
            continue
        if a.startswith(flag + "="):
            continue
        out.append(a)
    return out + [flag, value]


# --- the project: the fake Google APIs with the stack's IAM, and the control job ------------------
_STACKS: dict[tuple[str, str], str] = {}
_POLICIES: dict[tuple[str, str], Any] = {}


def stack_json(r: Rendered) -> dict[str, Any]:
    """The experiment's stack as `cdktn synth` writes it for the drill's spec (`stacks.stack.synthesized`),
    synthesized once per experiment; a fresh copy each call (callers may alter it)."""
    from stacks.stack import synthesized

    key = (r.name, r.spec.model_dump_json())
    if key not in _STACKS:
        _STACKS[key] = json.dumps(synthesized(r.name, r.spec))
    return json.loads(_STACKS[key])


def stack_policy(r: Rendered) -> Any:
    """The IAM of the experiment's synthesized stack (`drill.iam`), once per experiment."""
    from drill.iam import Policy

    key = (r.name, r.spec.model_dump_json())
    if key not in _POLICIES:
        _POLICIES[key] = Policy.from_stack(stack_json(r))
    return _POLICIES[key]


def account(r: Rendered, kind: str) -> str:
    """The email of the stack's `trainer` or `control` service account."""
    project = r.props.scale.project if r.props.scale is not None else r.spec.gcp.project
    return f"{r.name}-{kind}@{project}.iam.gserviceaccount.com"


def project_fake(r: Rendered) -> FakeGcp:
    """The fake Google APIs of the experiment's project, enforcing its stack's grants: the VMs'
    token is the trainer's account, the operator's the deployer (an Owner)."""
    fake = FakeGcp(r.spec.gcp.project, token=OPERATOR_TOKEN, policy=stack_policy(r))
    fake.add_identity(DRILL_TOKEN, f"serviceAccount:{account(r, 'trainer')}")
    return fake


def control_job(fake: FakeGcp, rendered: list[Rendered], storage: str, image: Path) -> Any:
    """The experiment's control job (`trainer.cloud.control`, run as its own account by `jobs.run`),
    with the settings the stack would give it for the drill's scripts; None when the scripts
    never ask for it. Every node's bad-input marker is included (the drill renders each node
    with a health port of its own, so with its own startup-script digest)."""
    from drill.control_job import ControlJob
    from stacks.control import control_settings
    from trainer.cloud import scale

    r0 = rendered[0]
    t = r0.props.scale if r0.props is not None else None
    if t is None:
        return None
    prefix = f"runs/{r0.name}"
    markers = sorted({m for r in rendered for m in scale.markers(prefix, r.props.steps, scale.digest(r.startup)).values()})
    settings = control_settings(project=t.project, region=t.region, location=t.location, groups=t.groups,
                                bucket=r0.bucket, prefix=prefix, stop_markers=tuple(markers),
                                checkpoint_key_secret=r0.props.checkpoint_key_secret,
                                coordinator=t.coordinator, flex_run_duration_s=t.run_duration_s)
    return ControlJob(fake, settings, account=account(r0, "control"), storage=storage, pythonpath=image,
                      poll_s=0.5)


# --- one experiment deployment: fakes + disk + successive VMs -----------------------------------
class Deployment:
    """What `cdktn deploy` would have made, faked: a bucket, a metadata server carrying the
    scripts, a checkpoint disk; VMs come and go on top of it."""

    def __init__(self, root: Path, rendered: Rendered, cfg: DrillConfig, say: Callable[[str], None],
                 image: Path, *, preinstall_trainer: bool = True, upload: bool = True,
                 gcs: StorageEmulator | None = None, attributes: dict[str, str] | None = None,
                 hostname: str = "spottrain-drill-vm", image_files: dict[str, Path] | None = None,
                 unit_environment: dict[str, str] | None = None, compute: FakeGcp | None = None,
                 observability: FakeObservability | None = None, fake_project: Any = None) -> None:
        """`image`: a directory holding the `trainer` package the VMs run (a snapshot, so that
        every VM and the final `status` run the same code). `preinstall_trainer` puts it on the
        VM image at /opt/spottrain/trainer: the boot scripts do not deliver it yet.

        A pool's node (`drill.pool_drill`) shares the bucket of its pool (`gcs`, started and
        stopped by the pool, which uploads the code once), has more instance metadata
        (`attributes`, e.g. its role), its own host name, and more files on its image.

        `compute`: the fake Compute API the VM's own calls reach (scale to zero); by default one of
        its own, holding the experiment's group with this VM in it (a pool shares one).

        `fake_project`: a `drill.fake_project.FakeProject` the stack was applied to (the lifecycle
        drill); it hears of every VM the group creates and deletes, and of the fakes' final state."""
        self.root = root
        self.image = image
        self.preinstall_trainer = preinstall_trainer and not rendered.delivers_trainer
        self.owns_gcs = gcs is None
        self.upload_code = upload and self.owns_gcs
        self.r = rendered
        self.cfg = cfg
        self.say = say
        self.hostname = hostname
        self.image_files = dict(image_files or {})
        if "/etc/hosts" not in self.image_files:
            # The VM's own name resolves, as GCE's internal DNS makes it: torchrun --standalone
            # (a VM with several GPUs) serves its rendezvous store under the host name.
            root.mkdir(parents=True, exist_ok=True)
            hosts = root / "hosts"
            base = Path("/etc/hosts").read_text() if Path("/etc/hosts").exists() else "127.0.0.1 localhost\n"
            hosts.write_text(base.rstrip("\n") + f"\n127.0.1.1 {hostname}\n")
            self.image_files["/etc/hosts"] = hosts
        self.unit_environment = {"OMP_NUM_THREADS": "1", **(unit_environment or {})}
        root.mkdir(parents=True, exist_ok=True)
        self.gcs = gcs if gcs is not None else StorageEmulator(rendered.bucket, log=root / "gcs-emulator.log")
        target = rendered.props.scale if rendered.props is not None else None
        #: The experiment's checkpoint key secret (`stacks.checkpoint_key`): the VM's boot fills and
        #: reads it through the fake Secret Manager; `status` reads it as an operator would.
        self.key_secret = rendered.props.checkpoint_key_secret if rendered.props is not None else None
        project = target.project if target is not None else \
            self.key_secret.split("/")[1] if self.key_secret else "spottrain-drill"
        zone = target.location.split("/", 1)[1] if target is not None else "europe-west4-a"
        if target is not None and target.location.startswith("regions/"):
            zone += "-a"
        self.zone = zone
        self.owns_compute = compute is None
        self.compute = compute if compute is not None else project_fake(rendered)
        self.control: Any = None
        if self.owns_compute and target is not None:
            for group in target.groups[:1]:
                where = {"zone": zone} if target.location.startswith("zones/") else \
                    {"region": zone[:-2], "zones": (zone,)}
                self.compute.add_group(group, instances=(hostname,), **where)  # type: ignore[arg-type]
        if self.key_secret:
            self.compute.add_secret(self.key_secret.rsplit("/", 1)[1])
        #: Cloud Logging (and Monitoring), which the VM's log shipper writes to (docs/watch.md).
        self.owns_observability = observability is None
        # It knows one token: the VMs' (their log shipper writes with the trainer account's token,
        # which the stack grants logging.logWriter), also what `logs()` reads with.
        self.observability = observability or FakeObservability(project, token=DRILL_TOKEN)
        self.metadata = MetadataServer(attributes={"startup-script": rendered.startup,
                                                   "shutdown-script": rendered.shutdown, **(attributes or {})},
                                       instance_name=hostname, zone=zone, project_id=project, token=DRILL_TOKEN,
                                       email=account(rendered, "trainer"))
        if self.owns_compute and target is not None:
            # The VM is the group's member: its metadata says the id the group lists (the
            # control job acts on a stop marker only when its writer is a member).
            self.metadata.set_value("instance/id", self.compute.instance(zone, hostname).id)
        self.disk = Disk(root / "checkpoint-disk.img", cfg.disk_mb)
        # Local NVMe SSDs: blank on every boot (Spot VMs lose them on preemption).
        self.local_ssds = {f"local-nvme-ssd-{i}": Disk(root / f"local-ssd-{i}.img", cfg.disk_mb)
                           for i in range(rendered.local_ssd_count)}
        self.vm: Sandbox | None = None
        self.finished_guest_attributes: dict[str, str] = {}
        self.fake_project = fake_project

    def __enter__(self) -> "Deployment":
        if self.owns_gcs:
            self.gcs.start()
        if self.owns_compute:
            self.compute.start()
            self.control = control_job(self.compute, [self.r], self.gcs.host, self.image)
            if self.control is not None:
                self.control.__enter__()
        if self.owns_observability:
            self.observability.start()
        self.metadata.start()
        for name, path in self.r.uploads if self.upload_code else ():
            self.upload(name, path.read_bytes())
        fakes = {"GCE_METADATA_HOST": self.metadata.host, "GCE_METADATA_IP": self.metadata.host,
                 "STORAGE_EMULATOR_HOST": self.gcs.host, "SPOTTRAIN_RUN_API": self.compute.run_api,
                 "SPOTTRAIN_SECRETMANAGER_API": self.compute.secretmanager_api,
                 "SPOTTRAIN_LOGGING_API": self.observability.logging_api,
                 "SPOTTRAIN_MONITORING_API": self.observability.monitoring_api}
        # The fakes' addresses are in PID 1's environment: the scripts get them, and units get
        # what they name in PassEnvironment= (on GCE they are unset: the defaults are real).
        image_files: dict[str, str | Path] = dict(self.image_files)
        if self.preinstall_trainer:
            image_files["/opt/spottrain/trainer"] = self.image / "trainer"
        self.vm = Sandbox(self.root / "vm", env=fakes, hostname=self.hostname,
                          default_environment=self.unit_environment,
                          disks={DEVICE_NAME: self.disk, **self.local_ssds}, image_files=image_files)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.vm is not None:
            self.vm.close()
        self.metadata.stop()
        if self.owns_gcs:
            self.gcs.stop()
        if self.owns_compute:
            self.compute.stop()  # after the control job's last execution
            if self.control is not None:
                self.control.__exit__()
        if self.owns_observability:
            self.observability.stop()
        for disk in (self.disk, *self.local_ssds.values()):
            disk.detach()
        if self.fake_project is not None:
            self.fake_project.sync(self.compute)

    def upload(self, name: str, data: bytes) -> None:
        """Put an object into the bucket with the real client, as `cdktn deploy` would have."""
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        client = storage.Client(project="spottrain-drill", credentials=AnonymousCredentials(),
                                client_options={"api_endpoint": self.gcs.host})
        client.bucket(self.r.bucket).blob(name).upload_from_string(data, content_type="application/gzip")

    def boot(self) -> tuple[int, int]:
        """Power on the VM; (journal offset, events offset) where this boot begins. Every boot
        starts from a pristine boot disk, whatever the termination action: the group repairs a
        preempted VM by recreating it from the template; only the checkpoint disk is kept."""
        assert self.vm is not None
        self.metadata.reset()
        for ssd in self.local_ssds.values():
            ssd.blank()
        offsets = (len(self.vm.journal()), len(self.vm.events()))
        if self.fake_project is not None and self.group is not None:
            self.fake_project.instance_up(self.group, self.hostname)
        if self.owns_compute and self.group is not None:
            # A recreated VM has a new id on Google; a stop marker is bound to its writer's.
            self.metadata.set_value("instance/id", self.compute.recreate(self.group, self.hostname).id)
        self.vm.boot(keep_boot_disk=False)
        return offsets

    def power_off(self) -> dict[str, Any]:
        """ACPI soft-off, hard off when the window closes: the VM is gone (Spot's termination
        action DELETE; the group recreates it unless its target size went below it)."""
        assert self.vm is not None
        off = self.vm.power_off(self.cfg.window_s)
        if self.fake_project is not None and self.group is not None:
            self.fake_project.instance_down(self.group, self.hostname, self.group_size() or 0)
        return off

    def wait_line(self, regex: re.Pattern[str], since: int, accept: Callable[[re.Match[str]], bool] = lambda m: True,
                  *, events_since: int | None = None) -> re.Match[str]:
        assert self.vm is not None
        check = None if events_since is None else (lambda: self.check_unit(events_since))

        def hit(line: str) -> re.Match[str] | None:
            m = regex.search(line)
            return m if m and accept(m) else None

        return self.vm.wait_journal(hit, self.cfg.guard_s, since=since, check=check)

    def check_unit(self, since_events: int) -> None:
        """Fail fast when the trainer unit failed (anything but finished or preempted)."""
        assert self.vm is not None
        for ev in self.vm.events()[since_events:]:
            if ev["event"] == "startup-script-exited" and ev["rc"] != 0:
                raise DrillFailure(f"startup script failed with status {ev['rc']}; journal tail:\n{self.vm.tail()}")
            if ev["event"] == "unit-exited" and ev["unit"] == UNIT and not ev["clean"]:
                raise DrillFailure(f"{UNIT} failed ({ev['code']} {ev['status']}); journal tail:\n{self.vm.tail()}")

    @property
    def group(self) -> str | None:
        """The group this VM belongs to (None when the scripts never touch their group)."""
        target = self.r.props.scale if self.r.props is not None else None
        return target.groups[0] if target is not None else None

    def group_size(self) -> int | None:
        return self.compute.group(self.group).target_size if self.group else None

    def wait_group_size(self, size: int) -> bool:
        """Wait until the fake Compute API has the group at `size` (what stops the recreation)."""
        return self.group is not None and self.compute.wait_for(
            lambda gcp: gcp.group(self.group).target_size == size, self.cfg.guard_s)

    def iam_record(self) -> tuple[list[tuple[str, str, str]], list[int]]:
        """(calls the stack's grants refused, exit status of each control-job execution), once the
        executions under way have ended."""
        self.compute.join_jobs()
        runs = [r.returncode for r in self.control.runs] if self.control is not None else []
        return list(self.compute.refusals), runs

    def boot_after_finish(self) -> dict[str, Any]:
        """Boot once more after the run finished, as if someone had resized the group to 1 by
        hand: the trainer must not start again, and the VM stops paying again. Waits for the
        startup script, then powers off."""
        assert self.vm is not None
        if self.group is not None:
            self.compute.set_target(self.group, 1)  # `gcloud ... resize --size 1`, by hand
        _, e0 = self.boot()
        ev = self.vm.wait_event(lambda e: e["event"] == "startup-script-exited", self.cfg.guard_s, since=e0)
        units = [e["unit"] for e in self.vm.events()[e0:] if e["event"] == "unit-started"]
        state = self.metadata.guest_attributes().get("spottrain/state")
        # Only a unit that serves the health port is worth waiting for (the trainer's, or the
        # finished run's answer); the log shipper starts at every boot and answers nothing.
        from stacks.boot import FINISHED_UNIT

        serving = {UNIT, FINISHED_UNIT} & set(units)
        health = health_answer(self.r.health_port, timeout=30 if serving else 0)
        self.power_off()
        return {"startup_rc": ev["rc"], "unit_started": UNIT in units, "other_units": units,
                "guest_state": state, "health": health, "group_size": self.group_size()}

    def checkpoint_key(self) -> list[str]:
        """`--checkpoint-key-file F` for an operator's `trainer status`: the experiment's key, read
        from (the fake) Secret Manager with the operator's own access, as `gcloud secrets versions
        access 1 --secret S --out-file F` would; none when the scripts use no secret."""
        if not self.key_secret:
            return []
        from trainer.checkpoint.key import fetch
        from trainer.cloud.gce import Client

        path = self.root / "operator-checkpoint.key"
        fetch(self.key_secret, path, client=Client(token=lambda: (self.compute.token, 3600.0)), create=False,
              api=self.compute.secretmanager_api, say=lambda m: None)
        return ["--checkpoint-key-file", str(path)]

    def logs(self) -> list[str]:
        """`python -m trainer logs` over what this deployment's VMs shipped to the loopback Cloud
        Logging (docs/watch.md): every session across the recreated VMs, and how each ended."""
        from datetime import datetime, timedelta, timezone

        from trainer.cloud.gce import Client
        from trainer.cloud.logs import describe, list_entries, log_filter, report

        project = self.observability.project
        entries = list_entries(Client(token=lambda: (DRILL_TOKEN, 3600.0)), project,
                               log_filter(project, self.r.name, since=datetime.now(timezone.utc) - timedelta(days=1)),
                               api=self.observability.logging_api)
        return describe(report(entries), title=f"experiment {self.r.name}, from the drill's Cloud Logging")

    def status(self) -> dict[str, Any]:
        """`python -m trainer status --json` over the disk (mounted read-only) and the bucket."""
        out = disk_status(self.disk, [sys.executable, "-m", "trainer", "status", "--run-dir", f"{MOUNT_DIR}/run",
                                      "--gcs-uri", self.r.gcs_uri, "--json", *self.checkpoint_key()],
                          env={"STORAGE_EMULATOR_HOST": self.gcs.host, "OMP_NUM_THREADS": "1"}, cwd=self.image)
        if out.returncode != 0:
            raise DrillFailure(f"trainer status failed ({out.returncode}):\n{out.stderr[-4000:]}")
        return json.loads(out.stdout)

    def run_to_end(self) -> tuple[int | None, str | None]:
        """Boot a VM, wait until the trainer finished, power it off normally. (resumed step, tier)"""
        assert self.vm is not None
        j0, e0 = self.boot()
        restore = self.wait_line(RESTORE_RE, j0, events_since=e0)
        self.vm.wait_event(lambda ev: ev["event"] == "unit-exited" and ev["unit"] == UNIT and ev["status"] == 0,
                           self.cfg.guard_s, since=e0, check=lambda: self.check_unit(e0))
        self.finished_guest_attributes = self.metadata.guest_attributes()
        if self.group is not None and not self.wait_group_size(0):
            raise DrillFailure(f"the finished run did not scale {self.group} to zero; journal tail:\n{self.vm.tail()}")
        self.power_off()
        return int(restore.group(1)), restore.group(2)


def health_answer(port: int, timeout: float, request: bytes = b"spottrain-health") -> str | None:
    """What the health check would get on `port` (None when nothing answers within `timeout`)."""
    import socket

    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(request)
                return s.recv(256).decode(errors="replace").strip()
        except OSError:
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.1)  # polling a port until it listens; timeout is the guard


# --- the drill -------------------------------------------------------------------------------
def check(cfg: DrillConfig) -> None:
    """Refuse a drill that cannot work; ValueError names the setting."""
    if not (cfg.window_s > 0):
        raise ValueError("window: must be > 0 seconds")
    if cfg.preemptions < 0:
        raise ValueError("preemptions must be >= 0")
    if cfg.steps < MIN_STEPS_PER_ROUND * (cfg.preemptions + 1):
        # Preemptions are placed on logged steps (every 10) and must land before the end.
        raise ValueError(f"steps: {cfg.steps} is too few for {cfg.preemptions} preemption(s); "
                         f"allowed: at least {MIN_STEPS_PER_ROUND * (cfg.preemptions + 1)}")
    bad = [n for n in cfg.wipe_disk_after if not 1 <= n <= cfg.preemptions]
    if bad:
        raise ValueError(f"wipe_disk_after: {bad} is not a preemption between 1 and {cfg.preemptions}")


def run_drill(cfg: DrillConfig, say: Callable[[str], None] = print, *,
              deploy: Callable[[Rendered], Any] | None = None) -> DrillResult:
    """`deploy`: given the rendered scripts, apply the stack to a fake project and return it
    (`drill.fake_project.FakeProject`, the lifecycle drill): the drilled deployment then uses its
    bucket and tells it of every VM; None: the deployment's fakes are its own."""
    check(cfg)
    import tempfile

    workdir = Path(cfg.workdir) if cfg.workdir else Path(tempfile.mkdtemp(prefix="spottrain-drill-"))
    workdir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(cfg.seed)
    try:
        image = workdir / "image"
        shutil.copytree(cfg.trainer_source, image / "trainer", dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        rendered = render(cfg, free_port(), trainer_source=image / "trainer", code_dir=workdir / "code")
        say(f"drill: experiment {rendered.name}, {cfg.steps} steps, {cfg.preemptions} preemption(s) "
            f"(seed {cfg.seed}), {cfg.window_s:g} s window"
            + (f", disk wiped after preemption {', '.join(map(str, cfg.wipe_disk_after))}" if cfg.wipe_disk_after else ""))

        t0 = time.monotonic()
        ref_status: dict[str, Any] = {}
        refusals, control_runs = [], []
        if cfg.reference:
            def run_reference() -> dict[str, Any]:
                say("reference: one VM, no preemption ...")
                with Deployment(workdir / "reference", rendered, cfg, say, image) as ref:
                    ref.run_to_end()
                    status = ref.status()
                    found, runs = ref.iam_record()
                return {"status": status, "refusals": found, "control_runs": runs}

            if cfg.reference_cache is not None:
                key = reference_key(cfg, rendered, image / "trainer")
                ran, cached = cached_reference(cfg.reference_cache, key, run_reference)
                if not ran:
                    say(f"reference: taken from {cfg.reference_cache / (key + '.json')} (the same trainer, "
                        "scripts, code and settings ran it uninterrupted)")
            else:
                cached = run_reference()
            ref_status = cached["status"]
            refusals = [tuple(r) for r in cached["refusals"]]
            control_runs = list(cached["control_runs"])
            say(f"reference: step {ref_status['latest_step']}, digest {str(ref_status['model_digest'])[:16]}, "
                f"{time.monotonic() - t0:.1f} s")
        reference_s = time.monotonic() - t0
        project = deploy(rendered) if deploy is not None else None

        t1 = time.monotonic()
        preemptions: list[Preemption] = []
        with Deployment(workdir / "drill", rendered, cfg, say, image, fake_project=project,
                        gcs=project.gcs if project is not None else None) as dep:
            assert dep.vm is not None
            for i in range(1, cfg.preemptions + 1):
                p = _preempt_round(dep, cfg, i, rng, say)
                if preemptions:
                    preemptions[-1].next_resumed_from = p.resumed_from
                preemptions.append(p)
                if i in cfg.wipe_disk_after:
                    dep.disk.blank()
                    p.wiped_after = True
                    say("  disk wiped: the next VM is recreated elsewhere, with a blank checkpoint disk and a new boot disk")
            say(f"round {cfg.preemptions + 1}: VM trains to the end ...")
            resumed, tier = dep.run_to_end()
            if preemptions:
                preemptions[-1].next_resumed_from = resumed
            say(f"  resumed from step {resumed}" + (f" ({tier})" if tier else "") + "; finished; guest attributes: "
                + (", ".join(f"{k}={v}" for k, v in dep.finished_guest_attributes.items()) or "none"))
            status = dep.status()
            drill_s = time.monotonic() - t1
            if dep.group is not None:
                say(f"the finished VM scaled its group {dep.group} to {dep.group_size()} through the Compute "
                    "API: the VM stand-in recreates nothing")
            after = dep.boot_after_finish()
            say(f"after the finish: one more boot (a manual resize to 1) started the trainer: "
                f"{'YES' if after['unit_started'] else 'no'}"
                f" (units started: {', '.join(after['other_units']) or 'none'}); "
                f"guest attribute spottrain/state={after['guest_state']}; health answer {after['health']!r}; "
                f"group size afterwards {after['group_size']}")
            sizes = [size for _, size in dep.compute.group(dep.group).history] if dep.group else []
            logs = dep.logs()
            more = dep.iam_record()
            refusals, control_runs = refusals + more[0], control_runs + more[1]
        result = DrillResult(cfg, ref_status.get("model_digest"), status.get("model_digest"), status,
                             preemptions, reference_s, drill_s, resumed, workdir, after, sizes, logs,
                             refusals, control_runs)
        say(report(result))
        return result
    finally:
        if not cfg.keep and not cfg.workdir:
            shutil.rmtree(workdir, ignore_errors=True)


def reference_key(cfg: DrillConfig, rendered: Rendered, trainer: Path) -> str:
    """The digest of everything an uninterrupted reference run's result follows from: the rendered
    boot scripts (their loopback health port blanked), the archives they fetch (named by their
    content: the trainer, the experiment's code, its locked wheels), the trainer tree the VM runs,
    the drill's own code (the VM stand-in and the fakes), this Python and its torch, and the
    settings the run reads. Preemptions, their seed and the wiped rounds are the drill's, not the
    reference's."""
    import hashlib

    import torch

    h = hashlib.sha256()

    def add(label: str, data: bytes) -> None:
        h.update(f"{label}\0{len(data)}\0".encode())
        h.update(data)

    port = str(rendered.health_port)
    for label, text in (("startup", rendered.startup), ("shutdown", rendered.shutdown)):
        add(label, text.replace(port, "HEALTH_PORT").encode() if rendered.health_port else text.encode())
    for name, path in sorted(rendered.uploads):
        add(f"upload:{name}", path.read_bytes())
    for root, label in ((trainer, "trainer"), (REPO / "drill", "drill")):
        for f in sorted(root.rglob("*.py")):
            add(f"{label}:{f.relative_to(root)}", f.read_bytes())
    add("experiment", Path(cfg.experiment).read_bytes())
    add("runtime", f"{sys.version}|{torch.__version__}".encode())
    add("settings", json.dumps({"steps": cfg.steps, "every": cfg.checkpoint_every_steps, "window_s": cfg.window_s,
                                "disk_mb": cfg.disk_mb, "nodes": cfg.nodes}).encode())
    return h.hexdigest()[:32]


def cached_reference(folder: Path, key: str, run: Callable[[], dict[str, Any]]) -> tuple[bool, dict[str, Any]]:
    """(ran it, result): the reference result stored under `key` in `folder`, else `run()`'s, stored
    there when it is a clean one (a final digest, no refusal, every control run 0). One process
    runs a key at a time (a lock file): a second one waits and takes the first one's result."""
    import fcntl

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{key}.json"
    with open(folder / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return False, json.loads(path.read_text())
        result = run()
        if result["status"].get("model_digest") and not result["refusals"] and not any(result["control_runs"]):
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(result, default=str))
            os.replace(tmp, path)
        return True, result


def _preempt_round(dep: Deployment, cfg: DrillConfig, i: int, rng: random.Random, say: Callable[[str], None]) -> Preemption:
    assert dep.vm is not None
    j0, e0 = dep.boot()
    p = Preemption(index=i, boot=dep.vm.boots)
    restore = dep.wait_line(RESTORE_RE, j0, events_since=e0)
    p.resumed_from, p.resumed_tier = int(restore.group(1)), restore.group(2)
    # Spread the remaining preemptions over what is left of the run; keep clear of the end so the
    # notice always lands while the trainer is still stepping.
    left = cfg.preemptions - i + 1
    span = (cfg.steps - p.resumed_from) / (left + 1)
    p.target_step = min(cfg.steps - 1, p.resumed_from + max(1, int(span * rng.uniform(0.3, 1.0))))
    m = dep.wait_line(STEP_RE, j0, accept=lambda m: int(m.group(1)) >= p.target_step, events_since=e0)
    p.notice_after_step, p.steps_per_s = int(m.group(1)), float(m.group(3))
    # A random moment between two logged steps (up to one logging interval).
    interval_s = 10 / max(p.steps_per_s, 1e-3)
    time.sleep(rng.uniform(0.0, 0.9) * interval_s)  # the injected randomness, not a synchronisation
    say(f"round {i}: resumed from step {p.resumed_from}" + (f" ({p.resumed_tier})" if p.resumed_tier else "")
        + f"; preempting after step {p.notice_after_step} ...")
    events_before = len(dep.vm.events())
    t_notice = time.monotonic()
    dep.metadata.preempt()
    off = dep.power_off()
    p.off_s, p.killed = float(off["seconds"]), bool(off["killed"])
    notice_wall = time.time() - (time.monotonic() - t_notice)
    for ev in dep.vm.events()[events_before:]:
        if ev["event"] == "unit-exited" and ev["unit"] == UNIT and p.trainer_exit is None:
            p.trainer_exit = ev["status"] if ev["code"] == "exited" else -ev["status"]
            p.unit_stopped_s = ev["t"] - notice_wall
    emergency_save(p, dep.vm.journal()[j0:])
    say(f"  notice -> saved step {p.saved_step} in "
        f"{p.no_save or _f(p.save_s) + ' s'} (trainer exit {p.trainer_exit}, "
        f"unit down after {_f(p.unit_stopped_s)} s); VM off after {p.off_s:.1f} s of {cfg.window_s:g}"
        + (" (KILLED at the end of the window)" if p.killed else ""))
    return p


def emergency_save(p: Preemption, journal: str) -> None:
    """The round's emergency save as the trainer logged it (event=preempted): the step, the
    measured seconds and the tiers; or why there was none."""
    saved = PREEMPTED_RE.search(journal)
    if saved:
        p.saved_step = int(saved.group(1))
        if saved.group(4):
            p.persistent_ok, p.gcs_ok, p.save_s = saved.group(2) == "1", saved.group(3), float(saved.group(4))
            return
    why = NO_SAVE_RE.search(journal)
    if why:
        p.no_save = f"none: {why.group(1).strip()}"
    elif p.killed:
        p.no_save = "none logged: killed at the end of the window"
    else:
        p.no_save = f"none logged (trainer exit {p.trainer_exit})"


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def goodput_note(g: dict[str, Any]) -> str:
    """One line on why a drill's goodput is low: its fixed costs against its short training."""
    sessions = max(1, int(g.get("sessions") or 1))
    fixed = float(g.get("startup_s") or 0.0) + float(g.get("restore_s") or 0.0)
    down = float(g.get("downtime_s") or 0.0)
    return (f"(why so low: this run trains for only {float(g.get('productive_s') or 0.0):.1f} s, while each of its "
            f"{sessions} VM boots pays about {fixed / sessions:.1f} s of trainer start-up and restore, plus "
            f"{down:.1f} s without a trainer in all (VM boot and preemption), whatever the run's length; a run of "
            "hours pays the same per preemption, a few percent of its time)")


def report(r: DrillResult) -> str:
    g = r.status.get("goodput", {})
    lines = ["", "## Preemption drill", "",
             "| # | resumed from | notice after step | saved step | emergency save s | unit down s | "
             "window s | VM off s | killed | trainer exit | steps lost | disk wiped |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in r.preemptions:
        lines.append(f"| {p.index} | {p.resumed_from} ({p.resumed_tier or '-'}) | {p.notice_after_step} | "
                     f"{p.saved_step if p.saved_step is not None else '-'} | {p.no_save or _f(p.save_s)} | "
                     f"{_f(p.unit_stopped_s)} | "
                     f"{r.config.window_s:g} | {p.off_s:.2f} | {'yes' if p.killed else 'no'} | {p.trainer_exit} | "
                     f"{p.steps_lost if p.steps_lost is not None else '-'} | {'yes' if p.wiped_after else 'no'} |")
    if g:
        wall = g.get("wall_s") or 0.0
        lines += ["", f"goodput {100 * g.get('goodput', 0):.1f}% of {wall:.1f} s wall over {g.get('sessions')} "
                  f"session(s); preemptions {g.get('preemptions')}, crashes {g.get('crashes')}, "
                  f"finished {'yes' if g.get('finished') else 'no'}", goodput_note(g), "",
                  "| part | seconds | share of wall |", "|---|---|---|"]
        for key, label in (("productive_s", "productive"), ("startup_s", "badput: start-up"),
                           ("restore_s", "badput: restore"), ("checkpoint_blocked_s", "badput: checkpoint blocked"),
                           ("lost_s", "badput: work lost"), ("downtime_s", "badput: down (no trainer)")):
            v = float(g.get(key) or 0.0)
            lines.append(f"| {label} | {v:.2f} | {100 * v / wall if wall else 0:.1f}% |")
    if r.logs:
        lines += ["", "## The VMs' logs (`python -m trainer logs`, from the loopback Cloud Logging)", "", *r.logs]
    same = r.digest is not None and r.digest == r.reference_digest
    if r.config.reference:
        lines += ["", f"reference digest {r.reference_digest}", f"drill digest     {r.digest}",
                  f"digest {'MATCHES' if same else 'DIFFERS'}: reference run {r.reference_s:.1f} s, drill {r.drill_s:.1f} s"]
    else:
        lines += ["", f"drill digest     {r.digest} (no reference run to compare with), drill {r.drill_s:.1f} s"]
    lines.append(iam_line(r.refusals, r.control_runs))
    return "\n".join(lines)


def iam_line(refusals: list[tuple[str, str, str]], control_runs: list[int]) -> str:
    """What Google's IAM would have said of the drill's calls, and what the control job did."""
    if refusals:
        first = "; ".join(f"{who} lacks {perm} on {res}" for who, perm, res in refusals[:3])
        iam = f"IAM: {len(refusals)} call(s) outside the stack's grants, which Google refuses too: {first}"
    else:
        iam = "IAM: every call within the synthesized stack's grants"
    failed = sum(1 for rc in control_runs if rc)
    return f"{iam}; control job: {len(control_runs)} execution(s)" + (f", {failed} FAILED" if failed else ", all done")
