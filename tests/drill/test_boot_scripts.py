"""The real rendered boot scripts of experiments/example.toml, run in a drill VM."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from drill.drill import DEVICE_NAME, UNIT, Deployment, DrillConfig, render
from drill.net import free_port
from drill.sandbox import REPO
from drill_support import needs_root

pytestmark = needs_root

STARTUP_GUARD_S = 300


def _deployment(tmp_path: Path, *, extra: dict | None = None, **kwargs: object) -> Deployment:
    # Many steps: the trainer is still running when a test looks at it; the VM is killed after.
    # The trainer is delivered through the bucket when the stack does that, else preinstalled.
    cfg = DrillConfig(steps=1_000_000, disk_mb=64)
    rendered = render(cfg, free_port(), trainer_source=REPO / "trainer", code_dir=tmp_path / "code", extra=extra)
    return Deployment(tmp_path / "dep", rendered, cfg, lambda s: None, REPO, **kwargs)  # type: ignore[arg-type]


@pytest.fixture
def deployment(tmp_path: Path):
    with _deployment(tmp_path) as dep:
        yield dep


def _last_startup_line(dep: Deployment) -> str:
    assert dep.vm is not None
    return [line for line in dep.vm.journal().splitlines() if "spottrain-startup" in line][-1]


def _startup_fails(dep: Deployment) -> str:
    """Boot; the startup script must fail and start nothing but the log shipper, which ships the
    failure to Cloud Logging (it outlives the VM). Its last log line."""
    assert dep.vm is not None
    _, e0 = dep.boot()
    ev = dep.vm.wait_event(lambda e: e["event"] == "startup-script-exited", STARTUP_GUARD_S, since=e0)
    assert ev["rc"] != 0, dep.vm.tail()
    assert [e["unit"] for e in dep.vm.events()[e0:] if e["event"] == "unit-started"] == ["spottrain-logs.service"]
    line = _last_startup_line(dep)
    assert dep.observability.wait_for(lambda o: any(
        e["jsonPayload"].get("event") == "boot_failed" for e in o.entries), STARTUP_GUARD_S), dep.vm.tail()
    shipped = [e for e in dep.observability.entries if e["jsonPayload"].get("event") == "boot_failed"]
    assert shipped[-1]["severity"] == "ERROR" and shipped[-1]["jsonPayload"]["message"] in line
    return line


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


def test_a_missing_trainer_archive_fails_loudly(tmp_path: Path) -> None:
    with _deployment(tmp_path, upload=False, preinstall_trainer=False) as dep:
        line = _startup_fails(dep)
        assert "trainer" in line, line
        if dep.r.delivers_trainer:
            assert "404" in line and dep.r.uploads[0][0] in line, line


def test_a_corrupt_trainer_archive_fails_loudly(tmp_path: Path) -> None:
    with _deployment(tmp_path, upload=False) as dep:
        if not dep.r.delivers_trainer:
            pytest.skip("the stack does not deliver the trainer through the bucket yet")
        name, path = dep.r.uploads[0]
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        dep.upload(name, bytes(data))
        line = _startup_fails(dep)
        assert "corrupt" in line and "sha256" in line, line
        assert dep.vm is not None
        assert list(dep.vm.path("/opt/spottrain/releases").glob("[0-9a-f]*")) == []   # nothing installed


def test_no_gpu_driver_fails_after_the_timeout_instead_of_hanging(tmp_path: Path) -> None:
    from stacks.boot import BootProps
    import dataclasses

    if "driver_timeout_s" not in {f.name for f in dataclasses.fields(BootProps)}:
        pytest.skip("the boot scripts do not wait for the GPU driver yet")
    with _deployment(tmp_path, extra={"driver_timeout_s": 1}) as dep:
        assert dep.vm is not None
        dep.vm.set_gpu("missing")
        line = _startup_fails(dep)
        assert "driver" in line.lower() or "gpu" in line.lower(), line


def test_a_local_ssd_is_formatted_and_mounted_for_the_local_tier(tmp_path: Path) -> None:
    cfg = DrillConfig(experiment=REPO / "tests" / "stacks" / "fixtures" / "n1-v100-standard.toml",
                      steps=1_000_000, disk_mb=64)
    with Deployment(tmp_path / "dep", render(cfg, free_port()), cfg, lambda s: None, REPO) as dep:
        assert dep.vm is not None and list(dep.local_ssds) == ["local-nvme-ssd-0"]
        _boot_and_wait_startup(dep)
        assert dep.vm.exec(["mountpoint", "-q", "/mnt/localssd"]).returncode == 0
        assert dep.vm.path("/mnt/localssd/run").is_dir()
        assert "--local-dir /mnt/localssd/run" in dep.vm.path("/etc/spottrain/trainer.sh").read_text()


def test_bad_input_stays_stopped_says_why_and_stops_paying(tmp_path: Path) -> None:
    """A trainer that exits 2 on a VM (here: a task the delivered code does not define) is not
    restarted; the VM answers the health check "ok bad-input: WHY" (no autoheal recreation loop),
    its guest attributes say why, and it scales its group to zero with a stop marker naming the
    failure; a VM brought back by hand honours that marker and trains nothing."""
    from drill.drill import health_answer

    task = "trainer.tasks.gpt:no_such_task"
    with _deployment(tmp_path, extra={"task": task}) as dep:
        assert dep.vm is not None and dep.group is not None
        _, e0 = dep.boot()
        ev = dep.vm.wait_event(lambda e: e["event"] == "unit-exited" and e["unit"] == UNIT, STARTUP_GUARD_S,
                               since=e0)
        assert (ev["code"], ev["status"], ev["restarting"]) == ("exited", 2, False), dep.vm.tail()
        why = "task: module 'trainer.tasks.gpt' has no attribute 'no_such_task'"
        assert health_answer(dep.r.health_port, 60) == f"ok bad-input: {why}"
        assert dep.wait_group_size(0), dep.vm.tail()
        attributes = dep.metadata.guest_attributes()
        assert attributes["spottrain/state"] == "bad-input" and attributes["spottrain/reason"] == why
        name = dep.r.gcs_uri.split("/", 3)[3]
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        bucket = storage.Client(project="p", credentials=AnonymousCredentials(),
                                client_options={"api_endpoint": dep.gcs.host}).bucket(dep.r.bucket)
        markers = list(bucket.list_blobs(prefix=f"{name}/stop/bad-input-"))
        assert len(markers) == 1 and why in markers[0].download_as_bytes().decode()
        assert "the trainer refused its input (exit 2)" in dep.vm.journal()
        dep.vm.power_off(10)

        after = dep.boot_after_finish()  # someone resizes the group to 1 by hand
        assert after["unit_started"] is False and after["guest_state"] == "stopped"
        assert after["group_size"] == 0


def test_the_spend_cap_stops_the_unit_says_so_and_stops_paying(tmp_path: Path) -> None:
    """`max_usd` in `[trainer.config]` reached on a VM: the trainer pauses (exit 77), the unit takes
    it as success and is not restarted, the VM answers the health check "ok spend-cap" (no
    recreation loop), its guest state says `spend-cap`, and it scales its group to zero with a
    stop marker naming the cap; a VM brought back by hand trains nothing until the experiment
    changes."""
    from drill.drill import health_answer
    from stacks.trainer_config import to_toml, vm_config

    # The example's price (about $0.44 an hour) reaches a millionth of a dollar in milliseconds:
    # the cap is reached at the trainer's first look at the ledger.
    config = to_toml(vm_config({"max_usd": 1e-6, "progress_every_s": 0.5}, project="my-project-123456",
                               experiment="example"))
    with _deployment(tmp_path, extra={"config": config}) as dep:
        assert dep.vm is not None and dep.group is not None
        _, e0 = dep.boot()
        ev = dep.vm.wait_event(lambda e: e["event"] == "unit-exited" and e["unit"] == UNIT, STARTUP_GUARD_S,
                               since=e0)
        assert (ev["code"], ev["status"], ev["restarting"]) == ("exited", 77, False), dep.vm.tail()
        show = dep.vm.exec(["systemctl", "show", "--property=ActiveState,NRestarts", UNIT]).stdout
        assert show == "ActiveState=inactive\nNRestarts=0\n", show
        assert "event=paused reason=max_usd" in dep.vm.journal()
        assert health_answer(dep.r.health_port, 60) == "ok spend-cap: max_usd reached"
        assert dep.wait_group_size(0), dep.vm.tail()
        assert dep.metadata.guest_attributes()["spottrain/state"] == "spend-cap"
        name = dep.r.gcs_uri.split("/", 3)[3]
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        bucket = storage.Client(project="p", credentials=AnonymousCredentials(),
                                client_options={"api_endpoint": dep.gcs.host}).bucket(dep.r.bucket)
        markers = list(bucket.list_blobs(prefix=f"{name}/stop/bad-input-"))
        assert len(markers) == 1 and "trainer.config.max_usd" in markers[0].download_as_bytes().decode()
        dep.vm.power_off(10)

        after = dep.boot_after_finish()  # someone resizes the group to 1 by hand
        assert after["unit_started"] is False and after["group_size"] == 0


class _ProxiedBucket:
    """The deployment's bucket behind the fault proxy: what `Deployment(gcs=...)` needs of it."""

    def __init__(self, bucket: str, log: Path) -> None:
        from drill.fault_proxy import FaultProxy
        from drill.gcs_emulator import StorageEmulator

        self.emulator = StorageEmulator(bucket, log=log).start()
        self.proxy = FaultProxy(self.emulator.host).start()
        self.host = self.proxy.host

    def close(self) -> None:
        self.proxy.stop()
        self.emulator.stop()


def test_the_finished_marker_and_scaling_to_zero_follow_the_trainers_verdict(tmp_path: Path) -> None:
    """The bucket refuses the final checkpoint: the trainer exits 74, the boot records no finished
    run and keeps its group; the unit runs the trainer again, and once the bucket takes the
    checkpoint the run is finished: marker, group at zero."""
    from drill.drill import MOUNT_DIR
    from stacks.boot import FINISHED_FILE

    steps = 12
    cfg = DrillConfig(steps=steps, disk_mb=64, guard_s=STARTUP_GUARD_S)
    rendered = render(cfg, free_port(), trainer_source=REPO / "trainer", code_dir=tmp_path / "code",
                      trainer_args=("--durable-timeout-s", "2"))
    bucket = _ProxiedBucket(rendered.bucket, tmp_path / "gcs.log")
    prefix = rendered.gcs_uri.split("/", 3)[3]
    refuse = bucket.proxy.add("POST", rf"object={prefix}/step-{steps:08d}/manifest[.]json$", "status",
                              status=403, times=None)
    try:
        with Deployment(tmp_path / "dep", rendered, cfg, lambda s: None, REPO, gcs=bucket) as dep:  # type: ignore[arg-type]
            assert dep.vm is not None
            for name, path in rendered.uploads:
                dep.upload(name, path.read_bytes())
            _, e0 = dep.boot()
            first = dep.vm.wait_event(lambda e: e["event"] == "unit-exited" and e["unit"] == UNIT,
                                      STARTUP_GUARD_S, since=e0)
            assert (first["status"], first["restarting"]) == (74, True), dep.vm.tail()
            assert "event=not_durable step=12" in dep.vm.journal()
            assert not dep.vm.path(FINISHED_FILE).exists()
            assert dep.metadata.guest_attributes().get("spottrain/state") == "not-durable"
            assert dep.group_size() == 1  # its disk holds the only complete copy: the VM stays

            bucket.proxy.release(refuse)  # the grant is back; the unit's next run finishes the job
            done = dep.vm.wait_event(lambda e: e["event"] == "unit-exited" and e["unit"] == UNIT,
                                     STARTUP_GUARD_S, since=dep.vm.events().index(first) + 1)
            assert done["status"] == 0, dep.vm.tail()
            assert "event=finished step=12 (already complete)" in dep.vm.journal()
            assert dep.vm.path(FINISHED_FILE).exists() and dep.vm.path(f"{MOUNT_DIR}/run").is_dir()
            assert dep.wait_group_size(0), dep.vm.tail()
    finally:
        bucket.close()
