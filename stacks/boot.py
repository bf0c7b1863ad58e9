"""The VM boot path: renders templates/ into the startup and shutdown scripts of the metadata.

Jinja runs with StrictUndefined (a missing value is an error, never an empty string) and every
value that reaches a shell goes through `shquote`. Rendering is deterministic: the same
experiment gives byte-identical scripts, so an unchanged experiment plans no diff.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

import jinja2

from stacks import gcp_rules as R

TEMPLATES = Path(__file__).resolve().parent.parent / "templates"
DEVICE_NAME = "spottrain-checkpoints"
MOUNT_DIR = "/mnt/spottrain"
RUN_DIR = f"{MOUNT_DIR}/run"
LOCAL_MOUNT_DIR = "/mnt/localssd"
LOCAL_DIR = f"{LOCAL_MOUNT_DIR}/run"
WORKDIR = "/opt/spottrain"
#: Seconds of the shutdown window kept back from the trainer for the kernel's own power-off.
STOP_SLACK_S = 5


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
class BootProps:
    """Everything the scripts need; all already validated."""

    name: str
    bucket: str
    task: str
    steps: int
    health_port: int
    provisioning: str
    local_ssd_count: int = 0
    args: tuple[str, ...] = field(default_factory=tuple)
    workdir: str = WORKDIR  # where the trainer package lives on the VM

    @property
    def gcs_uri(self) -> str:
        return f"gs://{self.bucket}/runs/{self.name}"

    @property
    def window_s(self) -> int:
        return R.SHUTDOWN_WINDOW_S[self.provisioning]


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


def render(props: BootProps) -> BootScripts:
    env = _env()
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
        "health_port": props.health_port,
        "args": list(props.args),
        "window_s": props.window_s,
        "stop_timeout_s": props.window_s - STOP_SLACK_S,
    }
    trainer_sh = env.get_template("trainer.sh.j2").render(ctx).rstrip("\n")
    unit = env.get_template("spottrain.service.j2").render(ctx).rstrip("\n")
    startup = env.get_template("startup.sh.j2").render(ctx, trainer_sh=trainer_sh, unit=unit)
    shutdown = env.get_template("shutdown.sh.j2").render(ctx)
    return BootScripts(startup=startup, shutdown=shutdown, unit=unit, trainer_sh=trainer_sh)
