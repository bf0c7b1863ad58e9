"""The boot scripts: rendered deterministically, shellcheck-clean, and inert to hostile values."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
from stack_support import VARIANTS, variant

from stacks.boot import BootProps, BootScripts, Release, boot_props, render, shquote

SHELLCHECK = str(Path(sys.prefix) / "bin" / "shellcheck")
HOSTILE_ARGS = (
    "$(touch {canary})", "`touch {canary}`", "; touch {canary}", "' ; touch {canary} ; '",
    '" && touch {canary} "', "--flag=$HOME", "*", "a b", "\\", "%n %%", "${{IFS}}",
    "SPOTTRAIN_TRAINER_SH",
)
#: Fixed releases: rendering tests do not depend on the trainer's current bytes.
RELEASES = (
    Release("trainer", "code/trainer-0123456789abcdef.tar.gz", "0123456789abcdef" + "0" * 48),
    Release("user", "code/user-fedcba9876543210.tar.gz", "fedcba9876543210" + "1" * 48),
)


def props_for(name: str) -> BootProps:
    return boot_props(name, variant(VARIANTS[name], name), releases=RELEASES[:1])


def shellcheck(tmp_path: Path, scripts: BootScripts, *options: str) -> None:
    files = []
    for key in ("startup", "shutdown", "trainer_sh", "stop_paying"):
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
    for releases in ((), RELEASES):
        shellcheck(tmp_path, render(BootProps(
            name="x", bucket="b", task="m:f", steps=1, health_port=8471, provisioning="spot",
            local_ssd_count=2, args=args, releases=releases)))


@pytest.mark.parametrize("releases", [(), RELEASES[:1], RELEASES])
def test_every_delivery_variant_passes_shellcheck(tmp_path, releases):
    shellcheck(tmp_path, render(BootProps(
        name="x", bucket="b", task="m:f", steps=1, health_port=8471, provisioning="standard",
        local_ssd_count=4, args=("--seed", "3"), releases=releases)))


def test_example_trainer_command_line():
    scripts = render(props_for("example"))
    assert '"${SPOTTRAIN_PYTHON:-python3}" -m trainer run' in scripts.trainer_sh
    for part in ("--run-dir /mnt/spottrain/run", "--steps 20000",
                 "--gcs-uri gs://my-project-123456-example-ckpt/runs/example",
                 "--task trainer.tasks.gpt:build", "--health-port 8471",
                 "--checkpoint-every-steps \\\n  500"):
        assert part in scripts.trainer_sh
    assert "--local-dir" not in scripts.trainer_sh
    # Inside the 30 s Spot window, and a standard VM's (the on-demand fallback) inside its 120 s:
    # the startup script's drop-in for the unit (tests/stacks/test_shutdown_window.py).
    assert "\nTimeoutStopSec=" not in scripts.unit
    assert "  SPOT) model=SPOT window_s=30 stop_timeout_s=25 budget_s=20 ;;" in scripts.startup
    assert "  STANDARD) model=STANDARD window_s=120 stop_timeout_s=115 budget_s=110 ;;" in scripts.startup
    assert "KillSignal=SIGTERM" in scripts.unit
    assert "Restart=on-failure" in scripts.unit
    assert "RestartPreventExitStatus=2" in scripts.unit
    assert "SuccessExitStatus=75" in scripts.unit
    assert "PassEnvironment=GCE_METADATA_HOST GCE_METADATA_IP STORAGE_EMULATOR_HOST" in scripts.unit
    assert "s/^TimeoutStopSec=//p' /etc/systemd/system/spottrain.service.d/window.conf" in scripts.shutdown
    assert 'systemctl stop "$UNIT"' in scripts.shutdown


def test_a_restart_in_place_gets_a_new_vms_grace():
    """The group's initial_delay_sec spares new VMs only; the trainer's start-up passes the health
    check for as long (trainer.health), and the experiment cannot set the two apart."""
    default = render(props_for("example")).trainer_sh
    assert "--startup-grace-s 900 " in default
    longer = variant({"group": {"initial_delay_sec": 1800}}, "x")
    assert "--startup-grace-s 1800 " in render(boot_props("x", longer)).trainer_sh


def test_delivered_code_is_named_by_its_hash_in_the_scripts():
    scripts = render(BootProps(name="x", bucket="b", task="m:f", steps=1, health_port=8471,
                               provisioning="spot", releases=RELEASES))
    trainer, user = RELEASES
    for r in RELEASES:
        assert r.sha256 in scripts.startup
        assert r.object_name.replace("/", "%2F") in scripts.startup
    assert (f"export PYTHONPATH=/opt/spottrain/releases/{trainer.sha256}:"
            f"/opt/spottrain/releases/{user.sha256}") in scripts.trainer_sh
    assert f"cd /opt/spottrain/releases/{trainer.sha256}" in scripts.trainer_sh
    assert "sha256sum -c" in scripts.startup


def test_a_user_release_needs_a_trainer_release():
    with pytest.raises(ValueError, match="needs a trainer release"):
        render(BootProps(name="x", bucket="b", task="m:f", steps=1, health_port=8471,
                         provisioning="spot", releases=RELEASES[1:]))


def test_standard_vms_get_the_longer_window():
    startup = render(props_for("standard")).startup
    assert "  STANDARD) model=STANDARD window_s=120 stop_timeout_s=115 budget_s=110 ;;" in startup
    assert "SPOT)" not in startup


def test_rendering_is_deterministic():
    assert render(props_for("example")) == render(props_for("example"))


def _fake_python(tmp_path: Path) -> tuple[Path, Path]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    argv = tmp_path / "argv"
    fake = bin_dir / "python3"
    # Exit 3: a finished run (0) would be recorded under /mnt/spottrain of this machine.
    fake.write_text(f"#!/bin/bash\nprintf '%s\\0' \"$@\" > {shquote(argv)}\nexit 3\n")
    fake.chmod(0o755)
    return bin_dir, argv


def test_hostile_args_reach_the_trainer_verbatim_and_execute_nothing(tmp_path):
    canary = tmp_path / "pwned"
    args = tuple(a.format(canary=canary) for a in HOSTILE_ARGS)
    # They pass validation: the quoting, not the validator, is what keeps them inert.
    exp = variant({"trainer": {"args": list(args), "task": "trainer.tasks.gpt:build", "steps": 7,
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
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": "/home/nobody",
           "GCE_METADATA_HOST": "127.0.0.1:9"}  # guest attributes: refused at once
    env.pop("SPOTTRAIN_PYTHON", None)
    proc = subprocess.run(["bash", str(script)], env=env, cwd=tmp_path, timeout=30)
    assert proc.returncode == 3  # the trainer's exit status, passed on
    argv = argv_file.read_bytes().split(b"\0")[:-1]
    assert [a.decode() for a in argv] == [
        "-m", "trainer", "run", "--run-dir", "/mnt/spottrain/run", "--steps", "7",
        "--gcs-uri", "gs://b/runs/x", "--task", "trainer.tasks.gpt:build", "--health-port", "9000",
        "--startup-grace-s", "900", "--preemption-budget-s", "20", "--local-dir", "/mnt/localssd/run", *args,
    ]
    assert not canary.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["argv", "bin", "trainer.sh", work.name])


def test_startup_script_writes_the_trainer_script_and_unit_unexpanded(tmp_path):
    """Files are written from single-quoted words: they land on disk byte for byte."""
    canary = tmp_path / "pwned"
    args = tuple(a.format(canary=canary) for a in HOSTILE_ARGS)
    scripts = render(BootProps(name="x", bucket="b", task="m:f", steps=1, health_port=8471,
                               provisioning="spot", args=args, releases=RELEASES))
    start = scripts.startup.index("write_if_changed /etc/spottrain/trainer.env")
    end = scripts.startup.index("if [[ $changed -eq 1 ]]", start)
    first = scripts.startup.index("write_if_changed /etc/spottrain/finished_health.py")
    writes = (scripts.startup[first:scripts.startup.index('\nlog "starting', first)] + "\n"
              + scripts.startup[start:end].replace("$python", "/usr/bin/python3"))
    out = tmp_path / "out"
    out.mkdir()
    # The script's own writes, with a stand-in writer that puts each file under out/.
    stub = 'write_if_changed() { printf "%s\\n" "$3" > "$OUT/$(basename "$1")"; }\n'
    subprocess.run(["bash", "-c", stub + writes], check=True, timeout=30, cwd=tmp_path,
                   env={**os.environ, "OUT": str(out)})
    assert (out / "trainer.sh").read_text() == scripts.trainer_sh + "\n"
    assert (out / "spottrain.service").read_text() == scripts.unit + "\n"
    assert (out / "trainer.env").read_text() == "SPOTTRAIN_PYTHON=/usr/bin/python3\n"
    assert (out / "finished_health.py").read_text() == scripts.finished_health + "\n"
    assert (out / "spottrain-finished.service").read_text() == scripts.finished_unit + "\n"
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


def test_every_value_in_a_shell_template_goes_through_a_filter():
    """No bare `{{ value }}` in a script: each is shell-quoted or an integer."""
    from stacks.boot import TEMPLATES

    bare = []
    for path in sorted(TEMPLATES.glob("*.sh.j2")):
        for expr in re.findall(r"\{\{(.*?)\}\}", path.read_text()):
            if not re.search(r"\|\s*(shquote|shquote_text|int)\s*$", expr):
                bare.append(f"{path.name}: {{{{{expr}}}}}")
    assert bare == []


def test_boot_props_overrides_by_name_and_refuses_unknown_fields():
    exp = variant(VARIANTS["example"], "example")
    p = boot_props("example", exp, steps=7, health_port=9000)
    assert (p.steps, p.health_port, p.task, p.releases) == (7, 9000, exp.trainer.task, ())
    assert p.gcs_uri == f"gs://{exp.bucket_name('example')}/runs/example"
    with pytest.raises(ValueError, match="no field"):
        boot_props("example", exp, stepz=7)


def test_the_trainer_gets_the_experiments_prices_verbatim(tmp_path):
    """The stack's prices reach the trainer as two flags it accepts, before the user's args."""
    from stacks.pricing import hourly_price, trainer_price_args
    from trainer.cli import parser

    exp = variant({"cost": {"spot_per_hour": 0.75, "on_demand_per_hour": 2.5},
                   "trainer": {"args": ["--seed", "4"]}}, "x")
    assert hourly_price(exp) == (0.75, 2.5)
    scripts = render(boot_props("x", exp, workdir=str(tmp_path)))
    script = tmp_path / "trainer.sh"
    script.write_text(scripts.trainer_sh)
    bin_dir, argv_file = _fake_python(tmp_path)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "GCE_METADATA_HOST": "127.0.0.1:9"}
    env.pop("SPOTTRAIN_PYTHON", None)
    assert subprocess.run(["bash", str(script)], env=env, cwd=tmp_path, timeout=30).returncode == 3
    argv = [a.decode() for a in argv_file.read_bytes().split(b"\0")[:-1]]
    assert argv[-6:] == [*trainer_price_args(exp), "--seed", "4"]
    args = parser().parse_args(argv[2:])
    assert (args.price_per_hour, args.on_demand_price_per_hour, args.seed) == (0.75, 2.5, 4)


# --- one process per GPU ------------------------------------------------------------------------

def _launch(trainer_sh: str) -> str:
    """The trainer's command line in trainer.sh, up to `-m trainer run`."""
    start = trainer_sh.index('"${SPOTTRAIN_PYTHON:-python3}" ')
    return trainer_sh[start:trainer_sh.index("-m trainer run", start)]


@pytest.mark.parametrize("name, gpus", [("a2-a100-40", 2), ("a3-h100", 8), ("g2-l4x4", 4),
                                        ("n1-v100", 2), ("n1-p4", 4)])
def test_a_multi_gpu_vm_runs_one_process_per_gpu(name, gpus):
    """Built-in GPUs (a2, a3, g2) and attached ones (n1): torchrun on one node, one rank each."""
    launch = _launch(render(props_for(name)).trainer_sh)
    assert "-m torch.distributed.run" in launch
    assert "--standalone" in launch and "--nnodes=1 " in launch
    assert f"--nproc-per-node={gpus} " in launch
    # systemd restarts a crash; torchrun must not restart a rank that paused (75) or hit bad
    # input (2).
    assert "--max-restarts=0 " in launch


def test_a_one_gpu_vm_runs_the_trainer_directly():
    scripts = render(props_for("example"))
    assert "torch.distributed.run" not in scripts.trainer_sh
    assert "SPOTTRAIN_EXIT_DIR" not in scripts.trainer_sh


def test_a_pool_runs_one_process_per_gpu_of_its_machine():
    exp = variant({"machine": {"machine_type": "a2-highgpu-4g", "gpu_type": "nvidia-tesla-a100",
                               "gpu_count": 4}, "pool": {"min_nodes": 2, "max_nodes": 3}}, "p")
    launch = _launch(render(boot_props("p", exp)).trainer_sh)
    assert "--nproc-per-node=4 " in launch and "--nnodes=2:3 " in launch
    assert "--standalone" not in launch and "--max-restarts=100 " in launch


def _fake_torchrun(tmp_path: Path, ranks: dict[int, int], status: int = 1) -> Path:
    """A python3 that plays torchrun: each listed rank records its status as the real trainer
    does (`trainer.exit_status`), then the launcher exits `status` as torchrun does."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    records = "".join(
        f"SPOTTRAIN_EXIT_DIR=\"$SPOTTRAIN_EXIT_DIR\" LOCAL_RANK={r} {shquote(sys.executable)} -c "
        f"'from trainer import exit_status; exit_status.starting(); exit_status.record({code})'\n"
        for r, code in ranks.items())
    fake = bin_dir / "python3"
    fake.write_text(f"#!/bin/bash\ncd {shquote(Path(__file__).resolve().parents[2])}\n{records}"
                    f"exit {status}\n")
    fake.chmod(0o755)
    return bin_dir


@pytest.mark.parametrize("ranks, status, expected", [
    ({0: 75, 1: 75}, 1, 75),  # preempted: every rank saved and exited 75
    ({0: 2, 1: 2}, 1, 2),  # bad input on every rank: not restarted (RestartPreventExitStatus)
    ({0: 75}, 1, 1),  # a rank recorded nothing (killed): torchrun's status stands
    ({0: 75, 1: 1}, 1, 1),  # the ranks disagree: a failure
])
def test_the_unit_exits_with_the_ranks_own_status(tmp_path, ranks, status, expected):
    exit_dir = tmp_path / "exit"
    exit_dir.mkdir()
    (exit_dir / "rank-1").write_text("75\n")  # an earlier round's: removed before the launch
    props = boot_props("x", variant(VARIANTS["a2-a100-40"], "x"), workdir=str(tmp_path),
                       exit_dir=str(exit_dir))
    script = tmp_path / "trainer.sh"
    script.write_text(render(props).trainer_sh)
    env = {**os.environ, "PATH": f"{_fake_torchrun(tmp_path, ranks, status)}:{os.environ['PATH']}",
           "GCE_METADATA_HOST": "127.0.0.1:9"}
    env.pop("SPOTTRAIN_PYTHON", None)
    proc = subprocess.run(["bash", str(script)], env=env, cwd=tmp_path, timeout=60,
                          capture_output=True, text=True)
    assert proc.returncode == expected, proc.stderr


def test_the_code_downloads_403_loop_waits_as_the_trainers_grant_rule(tmp_path):
    """The startup script's bash loop mirrors trainer.retry's 403 grace: run the rendered loop
    against a bucket that answers 403 forever (curl and sleep stand-ins; sleep moves bash's own
    clock) and it waits exactly what the trainer's Retry waits, then fails at the grace."""
    from trainer import retry

    scripts = render(BootProps(name="x", bucket="b", task="m:f", steps=1, health_port=8471,
                               provisioning="spot", releases=RELEASES, checkpoint_key_secret="projects/p/secrets/k"))
    start = scripts.startup.index("install_release() {")
    function = scripts.startup[start:scripts.startup.index("\n}\n", start) + 3]
    waits = tmp_path / "waits"
    stubs = f"""
unset SECONDS  # a plain variable from here on: only the sleep stand-in moves this clock
SECONDS=0
log() {{ :; }}
fail() {{ echo "FAILED: $*"; exit 1; }}
METADATA=http://metadata STORAGE=http://storage BUCKET=b
curl() {{ if [[ "$*" == *token* ]]; then echo '{{"access_token": "t"}}'; else printf 403; fi; }}
mkdir() {{ :; }}
mktemp() {{ echo {str(tmp_path)!r}; }}
rm() {{ :; }}
sleep() {{ echo "$1" >> {str(waits)!r}; SECONDS=$((SECONDS + $1)); }}
"""
    proc = subprocess.run(["bash", "-c", stubs + function + "install_release trainer o o sha dir"],
                          capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert proc.returncode == 1 and "still HTTP 403 after 600 s" in proc.stdout, proc.stdout + proc.stderr
    bash_waits = [float(w) for w in waits.read_text().split()]

    class Forbidden(Exception):
        code = retry.FORBIDDEN

    now = [0.0]
    trainer_waits: list[float] = []

    def sleep(s: float) -> None:
        trainer_waits.append(s)
        now[0] += s

    def refused() -> None:
        raise Forbidden()

    with pytest.raises(Forbidden):
        retry.Retry(retry.IAM_GRANT, transient=retry.never, clock=lambda: now[0], sleep=sleep).call(refused)
    assert bash_waits == trainer_waits
    assert f"--forbidden-retry-s {int(retry.IAM_GRANT.grace_s)} \\\n" in scripts.startup  # the key fetch's too
    assert f"--first-wait-s {int(retry.IAM_GRANT.grace_first_s)})" in scripts.startup


def test_a_script_and_hostile_script_args_reach_the_trainer_verbatim_and_execute_nothing(tmp_path):
    """`trainer.script`: the script's path and each of its arguments are one word of the trainer's
    command line (`--script-arg=ARG`, so that an argument that looks like a flag stays the
    script's), whatever they hold; the scripts with a user release stay shellcheck-clean."""
    canary = tmp_path / "pwned"
    args = tuple(a.format(canary=canary) for a in HOSTILE_ARGS) + ("--epochs", "-x")
    code = tmp_path / "code"
    code.mkdir()
    name = "my $(touch pwned) train.py"
    (code / name).write_text("print('hi')\n")
    exp = variant({"trainer": {"task": None, "code_dir": str(code), "script": name, "script_args": list(args),
                               "steps": 7, "health_port": 9000}}, "x")  # valid: quoting keeps them inert
    work = tmp_path / "work"
    work.mkdir()
    props = boot_props("x", exp, workdir=str(work), local_ssd_count=0)
    shellcheck(tmp_path, render(dataclasses.replace(props, releases=RELEASES)))
    script = tmp_path / "trainer.sh"
    script.write_text(render(props).trainer_sh)
    bin_dir, argv_file = _fake_python(tmp_path)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": "/home/nobody",
           "GCE_METADATA_HOST": "127.0.0.1:9"}
    env.pop("SPOTTRAIN_PYTHON", None)
    proc = subprocess.run(["bash", str(script)], env=env, cwd=tmp_path, timeout=30)
    assert proc.returncode == 3
    argv = [a.decode() for a in argv_file.read_bytes().split(b"\0")[:-1]]
    at = argv.index("--script")
    assert argv[at:at + 2 + len(args)] == ["--script", name, *(f"--script-arg={a}" for a in args)]
    assert "--task" not in argv
    assert not canary.exists() and not (tmp_path / "pwned").exists() and not (work / "pwned").exists()
    # The trainer's own parser reads them back as the script's command line.
    from trainer.cli import parser

    parsed = parser().parse_args(argv[2:])
    assert (parsed.script, parsed.script_args) == (name, list(args))


def test_the_images_python_is_the_first_with_torch_installed_found_without_importing_it(tmp_path):
    """The rendered choice of the image's Python, run with stand-in candidates: one without torch
    is passed over, one whose torch fails at import is still chosen (the boot only looks for
    torch: importing it cost every boot seconds, and the trainer's own import says what is
    wrong), and none at all fails the boot with one clear line."""
    from stacks.boot import PYTHONS

    scripts = render(BootProps(name="x", bucket="b", task="m:f", steps=1, health_port=8471, provisioning="spot"))
    start = scripts.startup.index('python=""\n')
    block = scripts.startup[start:scripts.startup.index('log "python: $python"', start)]
    no_torch, broken = tmp_path / "no-torch", tmp_path / "broken-torch"
    (tmp_path / "site" / "torch").mkdir(parents=True)
    (tmp_path / "site" / "torch" / "__init__.py").write_text("raise ImportError('libcudnn.so.9: cannot open')\n")
    (tmp_path / "empty").mkdir()
    for path, site in ((no_torch, tmp_path / "empty"), (broken, tmp_path / "site")):
        path.write_text(f"#!/bin/sh\nPYTHONPATH={site} exec /usr/bin/python3 -S \"$@\"\n")
        path.chmod(0o755)

    def choose(*candidates: Path) -> subprocess.CompletedProcess[str]:
        listed = " ".join(shquote(p) for p in PYTHONS)
        assert listed in block
        script = ('fail() { echo "FAILED: $*"; exit 1; }\n' + block.replace(listed, " ".join(map(str, candidates)))
                  + 'echo "chosen: $python"\n')
        return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)

    chose = choose(no_torch, broken)
    assert chose.returncode == 0 and chose.stdout == f"chosen: {broken}\n", chose
    none = choose(no_torch, no_torch)
    assert none.returncode == 1 and none.stdout.startswith("FAILED: no Python with torch on this image (tried"), none
