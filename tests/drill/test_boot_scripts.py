"""The real rendered boot scripts of experiments/example.toml, run in a drill VM."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from drill.drill import DEVICE_NAME, UNIT, Deployment, DrillConfig, render
from drill.gcs_emulator import free_port
from drill.sandbox import REPO
from drill_support import needs_root

pytestmark = needs_root

STARTUP_GUARD_S = 300


@pytest.fixture
def deployment(tmp_path: Path):
    # Many steps: the trainer is still running when the test looks at it; the VM is killed after.
    cfg = DrillConfig(steps=1_000_000, disk_mb=64)
    with Deployment(tmp_path / "dep", render(cfg, free_port()), cfg, lambda s: None, REPO) as dep:
        yield dep


def _boot_and_wait_startup(dep: Deployment) -> None:
    assert dep.vm is not None
    _, e0 = dep.boot()
    ev = dep.vm.wait_event(lambda e: e["event"] == "startup-script-exited", STARTUP_GUARD_S, since=e0)
    assert ev["rc"] == 0, dep.vm.tail()


def test_startup_script_twice_is_a_no_op_the_second_time(deployment: Deployment) -> None:
    vm = deployment.vm
    assert vm is not None
    _boot_and_wait_startup(deployment)
    disk = f"/dev/disk/by-id/google-{DEVICE_NAME}"
    uuid_before = vm.exec(["blkid", "-s", "UUID", "-o", "value", disk]).stdout
    pid_before = vm.exec(["systemctl", "show", "--property=MainPID", "--value", UNIT]).stdout
    unit_before = vm.path(f"/etc/systemd/system/{UNIT}").read_text()
    mounts_before = vm.path("/proc/1/mountinfo").read_text().count("/mnt/spottrain")
    script = vm.state / "startup-again.sh"
    script.write_text(deployment.r.startup)
    offset = len(vm.journal())

    again = vm.exec(["bash", str(script)], timeout=STARTUP_GUARD_S)

    assert again.returncode == 0, again.stdout + again.stderr
    assert "formatting" not in again.stdout
    assert vm.exec(["blkid", "-s", "UUID", "-o", "value", disk]).stdout == uuid_before
    assert vm.exec(["systemctl", "show", "--property=MainPID", "--value", UNIT]).stdout == pid_before
    assert vm.exec(["systemctl", "show", "--property=NRestarts", "--value", UNIT]).stdout == "0\n"
    assert vm.path(f"/etc/systemd/system/{UNIT}").read_text() == unit_before
    assert vm.path("/proc/1/mountinfo").read_text().count("/mnt/spottrain") == mounts_before
    assert f"Starting {UNIT}" not in vm.journal()[offset:]


def test_a_disk_with_a_filesystem_is_never_reformatted(deployment: Deployment, tmp_path: Path) -> None:
    vm = deployment.vm
    assert vm is not None
    seed = tmp_path / "seed"
    (seed / "run").mkdir(parents=True)
    (seed / "keep-me").write_text("checkpoints live here\n")
    deployment.disk.blank()
    subprocess.run(["mkfs.ext4", "-q", "-F", "-d", str(seed), str(deployment.disk.path)], check=True)
    uuid = subprocess.run(["blkid", "-s", "UUID", "-o", "value", str(deployment.disk.path)],
                          capture_output=True, text=True, check=True).stdout

    _boot_and_wait_startup(deployment)

    assert vm.exec(["blkid", "-s", "UUID", "-o", "value", f"/dev/disk/by-id/google-{DEVICE_NAME}"]).stdout == uuid
    assert vm.path("/mnt/spottrain/keep-me").read_text() == "checkpoints live here\n"
    assert "formatting" not in vm.journal()


def test_a_missing_trainer_fails_loudly_and_starts_nothing(tmp_path: Path) -> None:
    cfg = DrillConfig(steps=1000, disk_mb=64)
    with Deployment(tmp_path / "dep", render(cfg, free_port()), cfg, lambda s: None, REPO,
                    preinstall_trainer=False) as dep:
        assert dep.vm is not None
        _, e0 = dep.boot()
        ev = dep.vm.wait_event(lambda e: e["event"] == "startup-script-exited", STARTUP_GUARD_S, since=e0)
        assert ev["rc"] != 0
        failure = [line for line in dep.vm.journal().splitlines() if "spottrain-startup" in line][-1]
        assert "trainer" in failure, failure
        assert not any(e["event"] == "unit-started" for e in dep.vm.events()[e0:])


def test_a_local_ssd_is_formatted_and_mounted_for_the_local_tier(tmp_path: Path) -> None:
    cfg = DrillConfig(experiment=REPO / "tests" / "stacks" / "fixtures" / "n1-v100-standard.toml",
                      steps=1_000_000, disk_mb=64)
    with Deployment(tmp_path / "dep", render(cfg, free_port()), cfg, lambda s: None, REPO) as dep:
        assert dep.vm is not None and list(dep.local_ssds) == ["local-nvme-ssd-0"]
        _boot_and_wait_startup(dep)
        assert dep.vm.exec(["mountpoint", "-q", "/mnt/localssd"]).returncode == 0
        assert dep.vm.path("/mnt/localssd/run").is_dir()
        assert "--local-dir /mnt/localssd/run" in dep.vm.path("/etc/spottrain/trainer.sh").read_text()
