"""The boot scripts: rendered deterministically, shellcheck-clean, and inert to hostile values."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
from stack_support import VARIANTS, variant

from stacks.boot import BootProps, BootScripts, render, shquote

SHELLCHECK = str(Path(sys.prefix) / "bin" / "shellcheck")
HOSTILE_ARGS = (
    "$(touch {canary})", "`touch {canary}`", "; touch {canary}", "' ; touch {canary} ; '",
    '" && touch {canary} "', "--flag=$HOME", "*", "a b", "\\", "%n %%", "${{IFS}}",
    "SPOTTRAIN_TRAINER_SH",
)


def props_for(name: str) -> BootProps:
    exp = variant(VARIANTS[name], name)
    return BootProps(
        name=name, bucket=exp.bucket_name(name), task=exp.trainer.task,
        steps=exp.trainer.steps, health_port=exp.trainer.health_port,
        provisioning=exp.machine.provisioning, local_ssd_count=exp.disk.local_ssd_count,
        args=tuple(exp.trainer.args),
    )


def shellcheck(tmp_path: Path, scripts: BootScripts, *options: str) -> None:
    files = []
    for key in ("startup", "shutdown", "trainer_sh"):
        f = tmp_path / f"{key}.sh"
        f.write_text(getattr(scripts, key))
        files.append(str(f))
    proc = subprocess.run([SHELLCHECK, "--shell=bash", *options, *files],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("name", list(VARIANTS))
def test_rendered_scripts_pass_shellcheck(tmp_path, name):
    shellcheck(tmp_path, render(props_for(name)))


def test_hostile_values_pass_shellcheck(tmp_path):
    args = tuple(a.format(canary="/tmp/x") for a in HOSTILE_ARGS)
    shellcheck(tmp_path, render(BootProps(
        name="x", bucket="b", task="m:f", steps=1, health_port=8471, provisioning="spot",
        local_ssd_count=2, args=args)), "--severity=warning")
    # (Info level would only remark that '$(...)' in single quotes does not expand: the point.)


def test_example_trainer_command_line():
    scripts = render(props_for("example"))
    assert "exec python3 -m trainer run" in scripts.trainer_sh
    for part in ("--run-dir /mnt/spottrain/run", "--steps 20000",
                 "--gcs-uri gs://my-project-123456-example-ckpt/runs/example",
                 "--task trainer.tasks.gpt:build", "--health-port 8471",
                 "--checkpoint-every-steps \\\n  500"):
        assert part in scripts.trainer_sh
    assert "--local-dir" not in scripts.trainer_sh
    assert "TimeoutStopSec=25" in scripts.unit  # inside the 30 s Spot window
    assert "KillSignal=SIGTERM" in scripts.unit
    assert "at most 25 s" in scripts.shutdown
    assert "systemctl stop spottrain.service" in scripts.shutdown


def test_standard_vms_get_the_longer_window():
    assert "TimeoutStopSec=115" in render(props_for("standard")).unit


def test_rendering_is_deterministic():
    assert render(props_for("example")) == render(props_for("example"))


def _fake_python(tmp_path: Path) -> tuple[Path, Path]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    argv = tmp_path / "argv"
    fake = bin_dir / "python3"
    fake.write_text(f"#!/bin/bash\nprintf '%s\\0' \"$@\" > {shquote(argv)}\n")
    fake.chmod(0o755)
    return bin_dir, argv


def test_hostile_args_reach_the_trainer_verbatim_and_execute_nothing(tmp_path):
    canary = tmp_path / "pwned"
    args = tuple(a.format(canary=canary) for a in HOSTILE_ARGS)
    # They pass validation: the quoting, not the validator, is what keeps them inert.
    exp = variant({"trainer": {"args": list(args), "task": "pkg.mod:build", "steps": 7,
                               "health_port": 9000}}, "x")
    work = tmp_path / "work dir $(touch x)"
    work.mkdir()
    scripts = render(BootProps(
        name="x", bucket="b", task=exp.trainer.task, steps=exp.trainer.steps,
        health_port=exp.trainer.health_port, provisioning="spot", local_ssd_count=1,
        args=tuple(exp.trainer.args), workdir=str(work)))
    script = tmp_path / "trainer.sh"
    script.write_text(scripts.trainer_sh)
    bin_dir, argv_file = _fake_python(tmp_path)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": "/home/nobody"}
    subprocess.run(["bash", str(script)], check=True, env=env, cwd=tmp_path, timeout=30)
    argv = argv_file.read_bytes().split(b"\0")[:-1]
    assert [a.decode() for a in argv] == [
        "-m", "trainer", "run", "--run-dir", "/mnt/spottrain/run", "--steps", "7",
        "--gcs-uri", "gs://b/runs/x", "--task", "pkg.mod:build", "--health-port", "9000",
        "--local-dir", "/mnt/localssd/run", *args,
    ]
    assert not canary.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["argv", "bin", "trainer.sh", work.name])


def test_startup_script_writes_the_trainer_script_and_unit_unexpanded(tmp_path):
    """Files are written from single-quoted words: they land on disk byte for byte."""
    canary = tmp_path / "pwned"
    args = tuple(a.format(canary=canary) for a in HOSTILE_ARGS)
    scripts = render(BootProps(name="x", bucket="b", task="m:f", steps=1, health_port=8471,
                               provisioning="spot", args=args))
    for target, expected in (("/etc/spottrain/trainer.sh", scripts.trainer_sh),
                             ("/etc/systemd/system/spottrain.service", scripts.unit)):
        (command,) = re.findall(rf"^printf '%s\\n' '.*?' > {re.escape(target)}$",
                                scripts.startup, re.M | re.S)
        out = tmp_path / "out"
        subprocess.run(["bash", "-c", command.replace(f"> {target}", f"> {shquote(out)}")],
                       check=True, timeout=30, cwd=tmp_path)
        assert out.read_text() == expected + "\n"
    assert not canary.exists()


def test_unit_never_starts_without_the_checkpoint_mount():
    scripts = render(props_for("example"))
    assert "ExecStartPre=/usr/bin/mountpoint -q /mnt/spottrain" in scripts.unit
    assert "systemctl enable" not in scripts.startup
    assert "[Install]" not in scripts.unit


def test_disk_is_formatted_only_when_blkid_says_blank():
    startup = render(props_for("example")).startup
    assert 'blkid "$DISK" >/dev/null || rc=$?' in startup
    assert "if [[ $rc -eq 2 ]]; then" in startup
    assert "/dev/disk/by-id/google-spottrain-checkpoints" in startup


def test_shquote_refuses_control_characters():
    assert shquote("it's") == "'it'\"'\"'s'"
    assert shquote(42) == "42"
    with pytest.raises(ValueError, match="control character"):
        shquote("a\nb")


def test_templates_use_strict_undefined():
    from stacks.boot import _env

    with pytest.raises(jinja2.UndefinedError):
        _env().get_template("trainer.sh.j2").render({})
