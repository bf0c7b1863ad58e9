"""The VM boot path: renders templates/ into the startup and shutdown scripts of the metadata.

Jinja runs with StrictUndefined (a missing value is an error, never an empty string) and every
value that reaches a shell goes through `shquote`. Rendering is deterministic: the same
experiment (and the same code archives, `stacks.delivery`) gives byte-identical scripts, so an
unchanged experiment plans no diff and a code change rolls out as a new instance template.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import jinja2

from stacks import gcp_rules as R
from stacks.checkpoint_key_name import secret_name
from stacks.experiment import Experiment
from stacks.pool import COORDINATOR, ROLE_KEY, WORKER, PoolLayout, layout
from stacks.pricing import coordinator_price_args, trainer_price_args
from stacks.trainer_config import to_toml, vm_config
from trainer import shutdown_window
from trainer.cloud.log_shipper import KEY_ENV as LOG_KEY_ENV, KEY_FILE as LOG_KEY_FILE
from trainer.cloud.vm_info import PROVISIONING_KEY, PROVISIONING_MODELS
from trainer.retry import IAM_GRANT

TEMPLATES = Path(__file__).resolve().parent.parent / "templates"
DEVICE_NAME = "spottrain-checkpoints"
MOUNT_DIR = "/mnt/spottrain"
RUN_DIR = f"{MOUNT_DIR}/run"
LOCAL_MOUNT_DIR = "/mnt/localssd"
LOCAL_DIR = f"{LOCAL_MOUNT_DIR}/run"
WORKDIR = "/opt/spottrain"
#: Where delivered archives are unpacked, one directory per sha256 (on the boot disk).
RELEASES_DIR = f"{WORKDIR}/releases"
#: Where `[data]` is staged: the local SSDs when they are mounted, else the checkpoint disk.
DATA_DIR_LOCAL = f"{LOCAL_MOUNT_DIR}/data"
DATA_DIR_DISK = f"{MOUNT_DIR}/data"
#: `[trainer.config]` on the VM, the trainer's `--config` file (`stacks.trainer_config`).
CONFIG_FILE = "/etc/spottrain/trainer.toml"
#: Where each rank of a torchrun launch records its exit status (`trainer.exit_status`).
EXIT_DIR = "/run/spottrain/exit"
#: On the checkpoint disk: written when the trainer exits 0; no later boot trains again.
FINISHED_FILE = f"{MOUNT_DIR}/spottrain-finished"
#: The experiment's checkpoint key on the VM: a tmpfs (never a disk), mode 0600, root only.
CHECKPOINT_KEY_FILE = "/run/spottrain/checkpoint.key"
#: The trainer unit's drop-in that the startup script writes for this VM's shutdown window.
WINDOW_CONF = "/etc/systemd/system/spottrain.service.d/window.conf"
#: Interpreters tried in order for the image's Python with torch (Deep Learning VM images).
PYTHONS = ("/opt/conda/bin/python3", "/usr/bin/python3", "python3")
#: On the checkpoint disk: the shipped wheels installed, one directory per archive sha256, so that
#: a VM recreated with its disk installs nothing (stacks/wheels.py).
DEPS_ROOT = f"{MOUNT_DIR}/deps"
#: Seconds the startup script waits for the NVIDIA driver (first boot installs it).
DRIVER_TIMEOUT_S = 600
#: Seconds the startup script keeps retrying a 403 on the code download, its first wait, the
#: longest and the factor between two: the trainer's rule for a grant still propagating
#: (`trainer.retry.IAM_GRANT`), which the script's bash loop mirrors. curl never retries a 403.
FORBIDDEN_RETRY_S = int(IAM_GRANT.grace_s)
FORBIDDEN_FIRST_WAIT_S = int(IAM_GRANT.grace_first_s)
FORBIDDEN_MAX_WAIT_S = int(IAM_GRANT.grace_cap_s)
FORBIDDEN_FACTOR = int(IAM_GRANT.factor)


@dataclass(frozen=True)
class Release:
    """One code archive as the VM sees it (`stacks.delivery` builds and uploads it)."""

    kind: str  # "trainer" | "user" | "wheels"
    object_name: str  # code/<kind>-<sha256[:16]>.tar.gz in the checkpoint bucket
    sha256: str  # of the whole archive, checked before unpacking


def shquote(value: object) -> str:
    """Quote one value as a single shell word; control characters are refused outright."""
    return _quote(str(value), allowed="")


def shquote_text(value: object) -> str:
    """Quote multi-line text (a whole file) as one shell word; newlines are kept."""
    return _quote(str(value), allowed="\n")


def _quote(text: str, allowed: str) -> str:
    if any((ord(c) < 32 or ord(c) == 127) and c not in allowed for c in text):
        raise ValueError(f"refusing to put a control character into a script: {text!r}")
    return shlex.quote(text)


@dataclass(frozen=True)
class ScaleTarget:
    """What the VM's own scale calls (`trainer.cloud.scale`) ask for, and of whom: the experiment's
    control job (`stacks.control`), which acts on the groups and the coordinator named here. The
    rest of the VM's settings (bucket, prefix, steps, run dir) come from `BootProps`, so the
    drill's overrides reach them too."""

    project: str
    region: str
    job: str  # the control job's name (`stacks.control.job_name`)
    location: str  # "zones/<zone>" or "regions/<region>"
    groups: tuple[str, ...]  # the experiment's group names (Spot first; an on-demand fallback)
    stop_when_done: bool = True  # False: stop_paying.sh only says so
    coordinator: str | None = None  # "zones/<zone>/instances/<name>" of a pool
    run_duration_s: int | None = None  # flex-start
    stop_before_s: int = 600  # flex-start

    @property
    def job_path(self) -> str:
        return f"projects/{self.project}/locations/{self.region}/jobs/{self.job}"


def group_name(name: str, kind: str = "") -> str:
    """The managed instance group of an experiment ("" the main one, "od" the on-demand fallback)."""
    return f"{name}-{kind}-group" if kind else f"{name}-group"


def control_job_name(name: str) -> str:
    """The experiment's control job (`stacks.control`), and its service account's id."""
    return f"{name}-control"


def needs_control(exp: Experiment) -> bool:
    """Whether the experiment's stack has a control job (`stacks.control`): its VMs stop paying by
    themselves, ask for flex-start successors, or it falls back to on demand."""
    return (exp.group.stop_when_done or exp.machine.provisioning == "flex-start"
            or exp.capacity.on_demand_fallback_minutes is not None)


def scale_target(name: str, exp: Experiment) -> ScaleTarget | None:
    """None when the VM never touches its group: no scale to zero and no flex-start successor."""
    m, c = exp.machine, exp.capacity
    flex = m.provisioning == "flex-start"
    if not (exp.group.stop_when_done or flex):
        return None
    regional = exp.group.placement == "regional"
    pool = layout(name, exp)
    groups = (group_name(name),) + ((group_name(name, "od"),) if c.on_demand_fallback_minutes else ())
    return ScaleTarget(
        project=exp.gcp.project,
        region=exp.gcp.region,
        job=control_job_name(name),
        location=f"regions/{exp.gcp.region}" if regional else f"zones/{exp.gcp.zones[0]}",
        groups=groups,
        stop_when_done=exp.group.stop_when_done,
        coordinator=f"zones/{exp.gcp.zones[0]}/instances/{pool.coordinator_name}" if pool else None,
        run_duration_s=c.flex_max_run_hours * 3600 if flex else None,
        stop_before_s=c.flex_stop_before_minutes * 60,
    )


#: The log shipper's source (`trainer.cloud.log_shipper`): written verbatim by the startup script.
LOG_SHIPPER = Path(__file__).resolve().parent.parent / "trainer" / "cloud" / "log_shipper.py"
#: The trainer's unit, and the units whose output the shipper sends (flex-start adds its deadline's).
TRAINER_UNIT = "spottrain.service"
#: What answers the health check once the run has finished (trainer.sh starts it).
FINISHED_UNIT = "spottrain-finished.service"
LOG_UNITS = (TRAINER_UNIT, FINISHED_UNIT)
DEADLINE_UNIT = "spottrain-deadline.service"
#: On the boot disk, beside the journal it points into.
LOG_CURSOR_FILE = "/var/lib/spottrain/logs.cursor"


@dataclass(frozen=True)
class LogShipping:
    """The VM's log shipper (`trainer.cloud.log_shipper`, docs/watch.md): where its entries go and when
    it says the trainer stalled."""

    project: str
    stall_s: int = 1800
    """Seconds the trainer unit may be active without a step line before `event=stalled`."""
    drain_s: int = 10
    """At power-off: how long it keeps shipping once the trainer stopped (inside the window)."""


@dataclass(frozen=True)
class BootProps:
    """Everything the scripts need; all already validated."""

    name: str
    bucket: str
    task: str
    steps: int
    health_port: int
    provisioning: str
    script: str | None = None
    """`trainer.script`: run in place of `task`, relative to the user code release (the trainer's
    working directory then), with `script_args` as its command line."""
    script_args: tuple[str, ...] = ()
    local_ssd_count: int = 0
    args: tuple[str, ...] = field(default_factory=tuple)
    workdir: str = WORKDIR  # where a preinstalled trainer package lives (no `releases`)
    releases: tuple[Release, ...] = ()
    """The delivered archives (`stacks.delivery`): one "trainer", optionally one "user", and the
    "wheels" of the dependencies (`stacks.wheels`). Empty: the image carries the trainer package
    in `workdir` and its dependencies (the drill's preinstalled image)."""
    python_version: str | None = None
    """The image's Python ("X.Y") the wheels were locked for; the startup script refuses to
    install them into another."""
    driver_timeout_s: int = DRIVER_TIMEOUT_S
    forbidden_retry_s: int = FORBIDDEN_RETRY_S
    """How long a 403 on the code download is retried (IAM propagation) before failing."""
    forbidden_first_wait_s: int = FORBIDDEN_FIRST_WAIT_S
    price_args: tuple[str, ...] = ()
    """`--price-per-hour P --on-demand-price-per-hour Q` (`stacks.pricing.trainer_price_args`):
    the prices the trainer's ledger records at every boot, so `trainer status` reports the cost."""
    pool: PoolLayout | None = None
    """A multi-node pool (`stacks.pool`): the trainer runs under torchrun with a c10d rendezvous
    on the coordinator; None: one VM."""
    nproc_per_node: int = 1
    """Trainer processes per VM, one per GPU (`machine.gpu_count`). A single VM with more than
    one runs `torchrun --standalone --nproc-per-node=N`; with one, `python3 -m trainer run`."""
    config: str = ""
    """`[trainer.config]` as the TOML file the trainer reads (`--config`); "" for none."""
    exit_dir: str = EXIT_DIR
    """Under torchrun: where each rank records its exit status (`trainer.exit_status`)."""
    parallelism: str | None = None
    """`--parallelism ddp|fsdp` for the trainer; None passes no flag (the single-VM default)."""
    coordinator_price_args: tuple[str, ...] = ()
    """A pool's coordinator's `price_args` (on demand); trainer.sh picks them by role."""
    scale: ScaleTarget | None = None
    """What the VM asks its control job for: stopping paying when the job is done, flex-start
    successors (`stacks.control`, `stacks.scale_to_zero`); None: the VM never asks."""
    data_source: str | None = None
    """`[data] source`: staged before training (`python -m trainer stage`) and passed to the
    trainer as `--data-dir`; None: no dataset."""
    data_parallel: int = 16
    data_stream: bool = False
    """`[data] stream`: nothing staged; the trainer gets `data_source` as `--data-url`."""
    startup_grace_s: int = 900
    """`--startup-grace-s`: how long the trainer's start-up passes the health check
    (`group.initial_delay_sec`, the same grace a new VM gets; `trainer.health`)."""
    checkpoint_key_secret: str | None = None
    """`projects/P/secrets/S`: the experiment's checkpoint key (`stacks.checkpoint_key`), which the
    boot fetches into `CHECKPOINT_KEY_FILE` and the trainer signs and authenticates checkpoints
    with; None: the trainer's own default key (tests of other boot paths)."""
    logs: LogShipping | None = None
    """The log shipper (`LogShipping`); None: the journal stays on the VM (tests of other boot
    paths, which have no Logging API to ship to)."""

    @property
    def gcs_uri(self) -> str:
        return f"gs://{self.bucket}/runs/{self.name}"

    @property
    def torchrun(self) -> bool:
        """Whether the trainer runs under torchrun (a pool, or several GPUs on one VM)."""
        return self.pool is not None or self.nproc_per_node > 1

    @property
    def window_s(self) -> int:
        return shutdown_window.window_s(self.provisioning)


@dataclass(frozen=True)
class Window:
    """The shutdown window of one provisioning model a VM of these scripts may have
    (`trainer.shutdown_window`), as the startup script picks it by the VM's own."""

    model: str  # as Compute Engine names it: the VM's `spottrain-provisioning` metadata
    window_s: int
    stop_timeout_s: int  # the trainer unit's TimeoutStopSec
    budget_s: int  # the trainer's --preemption-budget-s


def windows(props: BootProps) -> tuple[Window, ...]:
    """The windows the scripts carry, the template's own provisioning first (a VM without the
    metadata gets it), then a standard VM's: the on-demand fallback's template and a pool's
    coordinator run the same scripts. Every trainer of a pool gets the budget of the pool's
    shortest window: its emergency save's deadline counts from the earliest notice on any node
    (`trainer.loop.finish`), and a worker's window closes first."""
    kinds = [props.provisioning] + (["standard"] if props.provisioning != "standard" else [])
    shortest = min(shutdown_window.trainer_budget_s(k) for k in kinds)
    return tuple(Window(
        model=PROVISIONING_MODELS[k], window_s=shutdown_window.window_s(k),
        stop_timeout_s=shutdown_window.stop_timeout_s(k),
        budget_s=shortest if props.pool is not None else shutdown_window.trainer_budget_s(k))
        for k in kinds)


def boot_props(name: str, exp: Experiment, *, releases: tuple[Release, ...] = (),
               **overrides: Any) -> BootProps:
    """The experiment's `BootProps`, the one place that maps an experiment onto the scripts
    (the stack and the drill both build them here, so a new field reaches both).

    `overrides` replace fields by name (the drill's step count, health port, args...); a name
    that is not a `BootProps` field is an error, never silently dropped."""
    known = {f.name for f in dataclasses.fields(BootProps)}
    unknown = set(overrides) - known
    if unknown:
        raise ValueError(f"BootProps has no field(s) {sorted(unknown)}")
    fields: dict[str, Any] = dict(
        name=name,
        bucket=exp.bucket_name(name),
        task=exp.trainer.task,
        script=exp.trainer.script,
        script_args=tuple(exp.trainer.script_args),
        steps=exp.trainer.steps,
        health_port=exp.trainer.health_port,
        provisioning=exp.machine.provisioning,
        local_ssd_count=exp.disk.local_ssd_count,
        args=tuple(exp.trainer.args),
        releases=tuple(releases),
        price_args=tuple(trainer_price_args(exp)),
        pool=layout(name, exp),
        nproc_per_node=exp.machine.gpu_count,
        config=to_toml(vm_config(exp.trainer.config, project=exp.gcp.project, experiment=name)),
        coordinator_price_args=tuple(coordinator_price_args(exp)) if exp.pool else (),
        # Passed with a pool, or when the experiment sets it: an unchanged single-VM experiment
        # renders byte-identical scripts.
        parallelism=exp.trainer.parallelism
        if exp.pool is not None or "parallelism" in exp.trainer.model_fields_set else None,
        scale=scale_target(name, exp),
        data_source=exp.data.source if exp.data is not None else None,
        data_parallel=exp.data.parallel if exp.data is not None else 16,
        data_stream=exp.data.stream if exp.data is not None else False,
        python_version=_image_python(exp),
        checkpoint_key_secret=secret_name(exp.gcp.project, name),
        startup_grace_s=exp.group.initial_delay_sec,
        logs=LogShipping(project=exp.gcp.project, stall_s=exp.alerts.stall_minutes * 60),
    )
    fields.update(overrides)
    return BootProps(**fields)


def _image_python(exp: Experiment) -> str | None:
    found = R.image_python(exp.machine.image_family, exp.machine.python_version)
    return found.version if found is not None else None


@functools.lru_cache(maxsize=1)  # one per process: each stack reuses the compiled templates
def _env() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES),
        undefined=jinja2.StrictUndefined,
        autoescape=False,  # shell, not HTML: quoting is explicit through shquote
        keep_trailing_newline=True,
        # bash's ${#array[@]} would open a Jinja comment; templates use no comments.
        comment_start_string="<%#",
        comment_end_string="#%>",
    )
    env.filters["shquote"] = shquote
    env.filters["shquote_text"] = shquote_text
    return env


@dataclass(frozen=True)
class BootScripts:
    startup: str
    shutdown: str
    unit: str
    trainer_sh: str
    finished_health: str = ""
    finished_unit: str = ""
    stop_paying: str = ""
    scale_settings: str = ""  # /etc/spottrain/scale.json ("" when the VM never scales its group)


def scale_settings(props: BootProps) -> str:
    """`trainer.cloud.scale.Settings` as JSON, deterministic (it is part of the startup script)."""
    t = props.scale
    if t is None:
        return ""
    settings = {"job": t.job_path, "bucket": props.bucket, "prefix": f"runs/{props.name}",
                "steps": props.steps, "run_dir": RUN_DIR, "run_duration_s": t.run_duration_s,
                "stop_before_s": t.stop_before_s}
    if props.checkpoint_key_secret:
        settings["checkpoint_key_file"] = CHECKPOINT_KEY_FILE
    return json.dumps(settings, sort_keys=True)


def log_config(props: BootProps) -> str:
    """/etc/spottrain/logs.json, the shipper's settings (deterministic: part of the script)."""
    assert props.logs is not None
    return json.dumps({
        "project": props.logs.project, "experiment": props.name, "run": f"runs/{props.name}",
        "log_id": "spottrain", "trainer_unit": TRAINER_UNIT,
        "units": [*LOG_UNITS, *([DEADLINE_UNIT] if props.scale and props.scale.run_duration_s else [])],
        "identifiers": ["google_metadata_script_runner"], "stall_s": props.logs.stall_s,
        "drain_s": props.logs.drain_s, "cursor_file": LOG_CURSOR_FILE, "key_file": LOG_KEY_FILE}, sort_keys=True)


def _release(props: BootProps, kind: str) -> dict[str, str] | None:
    found = [r for r in props.releases if r.kind == kind]
    if len(found) > 1:
        raise ValueError(f"more than one {kind} release: {found}")
    if not found:
        return None
    r = found[0]
    return {
        "kind": r.kind,
        "object": r.object_name,
        "object_url": quote(r.object_name, safe=""),  # one path segment of the JSON API
        "sha256": r.sha256,
        "dir": f"{RELEASES_DIR}/{r.sha256}",
    }


def render(props: BootProps) -> BootScripts:
    env = _env()
    trainer, user = _release(props, "trainer"), _release(props, "user")
    wheels = _release(props, "wheels")
    if (user is not None or wheels is not None) and trainer is None:
        raise ValueError("a user code or wheels release needs a trainer release")
    if wheels is not None:
        if props.python_version is None:
            raise ValueError("a wheels release needs the python_version it was locked for")
        wheels.update(deps_dir=f"{DEPS_ROOT}/{wheels['sha256']}", python=props.python_version)
    if props.script is not None and user is None and trainer is not None:
        # (Without any release the image carries the code in `workdir`, the script's file too.)
        raise ValueError("a script (trainer.script) needs the user code release it is a file of (trainer.code_dir)")
    releases = [r for r in (trainer, user) if r is not None]
    # The code first, then the wheels: the shipped dependencies shadow the image's copies.
    pythonpath = ":".join([r["dir"] for r in releases] + ([wheels["deps_dir"]] if wheels else []))
    scale_json = scale_settings(props)
    ctx = {
        "name": props.name,
        "device_name": DEVICE_NAME,
        "mount_dir": MOUNT_DIR,
        "run_dir": RUN_DIR,
        "local_mount_dir": LOCAL_MOUNT_DIR,
        "local_dir": LOCAL_DIR,
        "workdir": props.workdir,
        "local_ssd_count": props.local_ssd_count,
        "steps": props.steps,
        "gcs_uri": props.gcs_uri,
        "task": props.task,
        # An own loop runs from the user code's release, where `script` (relative, so that the
        # resume fingerprint does not change with the release) names its file.
        "script": props.script,
        "script_args": list(props.script_args),
        "script_dir": user["dir"] if props.script is not None and user is not None else None,
        "health_port": props.health_port,
        "startup_grace_s": props.startup_grace_s,
        # The prices go first: the template quotes each word; a user arg cannot repeat them
        # (`MANAGED_FLAGS`).
        # A pool picks its prices by role at run time (`price_args` arrays in trainer.sh).
        "args": [*props.price_args, *props.args] if props.pool is None else list(props.args),
        "price_args": list(props.price_args),
        "coordinator_price_args": list(props.coordinator_price_args),
        "windows": windows(props),
        "window_conf": WINDOW_CONF,
        "window_conf_dir": WINDOW_CONF.rsplit("/", 1)[0],
        "provisioning_key": PROVISIONING_KEY,
        "bucket": props.bucket,
        "trainer_release": trainer,
        "releases": releases,
        "releases_dir": RELEASES_DIR,
        "pythonpath": pythonpath,
        "trainer_dir": trainer["dir"] if trainer else props.workdir,
        "finished_file": FINISHED_FILE,
        "pythons": list(PYTHONS),
        "wheels": wheels,
        "deps_root": DEPS_ROOT,
        "driver_timeout_s": props.driver_timeout_s,
        "forbidden_retry_s": props.forbidden_retry_s,
        "forbidden_first_wait_s": props.forbidden_first_wait_s,
        "forbidden_max_wait_s": FORBIDDEN_MAX_WAIT_S,
        "forbidden_factor": FORBIDDEN_FACTOR,
        "pool": props.pool,
        "torchrun": props.torchrun,
        "nproc_per_node": props.pool.nproc_per_node if props.pool else props.nproc_per_node,
        "exit_dir": props.exit_dir,
        "trainer_config": props.config.rstrip("\n"),
        "config_file": CONFIG_FILE,
        "parallelism": props.parallelism,
        "role_key": ROLE_KEY,
        "coordinator_role": COORDINATOR,
        "worker_role": WORKER,
        "scale_settings": scale_json,
        "stop_when_done": props.scale is not None and props.scale.stop_when_done,
        "flex": props.scale is not None and props.scale.run_duration_s is not None,
        "data_url": props.data_source if props.data_stream else None,
        "data": None if props.data_source is None or props.data_stream else {
            "source": props.data_source, "parallel": props.data_parallel,
            "local_dir": DATA_DIR_LOCAL, "disk_dir": DATA_DIR_DISK},
        "checkpoint_key_secret": props.checkpoint_key_secret,
        "checkpoint_key_file": CHECKPOINT_KEY_FILE,
    }
    if props.logs is not None:
        logs = {"drain_s": props.logs.drain_s, "key_env": LOG_KEY_ENV, "key_file": LOG_KEY_FILE}
        ctx["logs"] = {**logs, "config": log_config(props), "shipper": LOG_SHIPPER.read_text().rstrip("\n"),
                       "unit": env.get_template("spottrain-logs.service.j2").render(ctx, logs=logs).rstrip("\n")}
    else:
        ctx["logs"] = None
    trainer_sh = env.get_template("trainer.sh.j2").render(ctx).rstrip("\n")
    unit = env.get_template("spottrain.service.j2").render(ctx).rstrip("\n")
    finished_health = env.get_template("finished_health.py.j2").render(ctx).rstrip("\n")
    finished_unit = env.get_template("spottrain-finished.service.j2").render(ctx).rstrip("\n")
    stop_paying = env.get_template("stop_paying.sh.j2").render(ctx).rstrip("\n")
    deadline_unit = env.get_template("spottrain-deadline.service.j2").render(ctx).rstrip("\n") \
        if ctx["flex"] else ""
    startup = env.get_template("startup.sh.j2").render(
        ctx, trainer_sh=trainer_sh, unit=unit, finished_health=finished_health,
        finished_unit=finished_unit, stop_paying=stop_paying, deadline_unit=deadline_unit)
    shutdown = env.get_template("shutdown.sh.j2").render(ctx)
    return BootScripts(startup=startup, shutdown=shutdown, unit=unit, trainer_sh=trainer_sh,
                       finished_health=finished_health, finished_unit=finished_unit,
                       stop_paying=stop_paying, scale_settings=scale_json)
