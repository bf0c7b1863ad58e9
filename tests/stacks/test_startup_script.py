"""The REAL rendered startup and shutdown scripts, with code delivery, run under bash in a drill VM
(`drill.sandbox`: mount/PID namespaces, a loop-device checkpoint disk, the systemd stand-in, a fake
metadata server and gcp-storage-emulator on loopback). The trainer and a user task really run."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest

from stacks.boot import CHECKPOINT_KEY_FILE, FINISHED_FILE, BootProps, BootScripts, render
from stacks.delivery import Archive, trainer_archive, user_archive

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("losetup") is None,
    reason="drill VMs need root, unshare and losetup (mount/PID namespaces, loop devices)")

BUCKET = "boot-test-ckpt"
DISK = "/dev/disk/by-id/google-spottrain-checkpoints"
UNIT = "spottrain.service"
GUARD_S = 300  # failure guard for any wait, never a timing assertion
REPO = Path(__file__).resolve().parents[2]

USER_TASK = '''\
import torch

from trainer.task import Task


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.f = torch.nn.Linear(1, 1)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.f(x), y)


class Line:
    def __len__(self):
        return 256

    def __getitem__(self, i):
        x = torch.tensor([i / 256.0])
        return x, 2 * x


def build(ctx):
    torch.set_num_threads(1)
    model = Net()
    return Task(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), dataset=Line())
'''

# A task that reads the staged dataset (ctx.data_dir) and imports a package that only the shipped
# wheels bring (installed offline by the startup script).
DATA_TASK = '''\
import hashlib
import logging

import spottrain_probe
from usertask import build as build_line


def build(ctx):
    files = sorted(p for p in ctx.data_dir.rglob("*") if p.is_file() and ".spottrain-staging" not in p.parts)
    h = hashlib.sha256()
    for p in files:
        h.update(p.relative_to(ctx.data_dir).as_posix().encode() + b"\\0" + p.read_bytes())
    logging.getLogger("datatask").warning("event=data_seen dir=%s files=%d sha256=%s probe=%s",
                                          ctx.data_dir, len(files), h.hexdigest(), spottrain_probe.ANSWER)
    return build_line(ctx)
'''
#: The Python of the drill VM's "image": the one running the tests.
PY = "%d.%d" % __import__("sys").version_info[:2]


class Boot:
    """One deployment's fakes, disk and VM, and the archives the scripts name."""

    def __init__(self, root: Path, archives: tuple[Archive, ...]) -> None:
        from drill.fake_gcp import FakeGcp
        from drill.gcs_emulator import StorageEmulator
        from drill.metadata_server import MetadataServer
        from drill.sandbox import Disk, Sandbox

        self.root, self.archives = root, archives
        self.gcs = StorageEmulator(BUCKET, log=root / "gcs.log").start()
        self.metadata = MetadataServer().start()
        # Secret Manager, holding the experiment's checkpoint key secret (no version yet).
        self.gcp = FakeGcp("boot-test-project", token="drill-fake-token").start()
        self.key_secret = self.gcp.add_secret("boot-test-checkpoint-key")
        fakes = {"GCE_METADATA_HOST": self.metadata.host, "GCE_METADATA_IP": self.metadata.host,
                 "STORAGE_EMULATOR_HOST": self.gcs.host, "SPOTTRAIN_SECRETMANAGER_API": self.gcp.secretmanager_api}
        self.disk = Disk(root / "disk.img", 64)
        self.vm = Sandbox(root / "vm", env=fakes,
                          default_environment={**fakes, "OMP_NUM_THREADS": "1"},
                          disks={"spottrain-checkpoints": self.disk})

    def upload(self, archive: Archive, data: bytes | None = None) -> None:
        name = quote(archive.release.object_name, safe="")
        req = urllib.request.Request(
            f"{self.gcs.host}/upload/storage/v1/b/{BUCKET}/o?uploadType=media&name={name}",
            data=archive.path.read_bytes() if data is None else data, method="POST",
            headers={"Content-Type": "application/gzip"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert resp.status == 200

    def scripts(self, *, steps: int, task: str = "usertask:build", wheels: Archive | None = None,
                **kw: object) -> BootScripts:
        kw.setdefault("health_port", 0)
        kw.setdefault("python_version", PY)
        kw.setdefault("checkpoint_key_secret", self.key_secret)
        return render(BootProps(
            name="boot-test", bucket=BUCKET, task=task, steps=steps, provisioning="spot",
            releases=tuple(a.release for a in (*self.archives, *([wheels] if wheels else []))),
            args=("--checkpoint-every-steps", "50"), **kw))  # type: ignore[arg-type]

    def boot(self, scripts: BootScripts, *, keep_boot_disk: bool = False) -> tuple[int, int]:
        """Boot with these scripts; (journal offset, events offset) where this boot begins.
        `keep_boot_disk`: a STOPped Spot VM started again (else a VM made from the template)."""
        startup, shutdown = self.root / "startup.sh", self.root / "shutdown.sh"
        startup.write_text(scripts.startup)
        shutdown.write_text(scripts.shutdown)
        offsets = (len(self.vm.journal()), len(self.vm.events()))
        self.vm.boot(startup_script_file=startup, shutdown_script_file=shutdown,
                     keep_boot_disk=keep_boot_disk)
        return offsets

    def startup_rc(self, since: int) -> int:
        ev = self.vm.wait_event(lambda e: e["event"] == "startup-script-exited", GUARD_S,
                                since=since)
        return int(ev["rc"])

    def startup_lines(self, since: int = 0) -> list[str]:
        return [line for line in self.vm.journal()[since:].splitlines()
                if "spottrain-startup:" in line]

    def close(self) -> None:
        self.vm.close()
        self.metadata.stop()
        self.gcs.stop()
        self.gcp.stop()


@pytest.fixture(scope="module")
def archives(tmp_path_factory) -> tuple[Archive, ...]:
    out = tmp_path_factory.mktemp("archives")
    code = out / "usercode"
    code.mkdir()
    (code / "usertask.py").write_text(USER_TASK)
    (code / "datatask.py").write_text(DATA_TASK)
    return trainer_archive(out_dir=out), user_archive(code, out_dir=out)


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> Archive:
    """The shipped wheels: a tiny package the VM's Python lacks, locked for that Python from a
    local index (the trainer's own dependencies are on this "image" already)."""
    from stacks import gcp_rules as R
    from stacks.delivery import wheels_archive
    from stacks.lock import lock
    from stacks.wheels import WheelSet, build_wheel, locked_wheels, read_lock

    out = tmp_path_factory.mktemp("wheels")
    (out / "index").mkdir()
    build_wheel(out / "index", "spottrain-probe", "1.0", files={"spottrain_probe/__init__.py": "ANSWER = 42\n"})
    ws = WheelSet(("spottrain-probe",), R.ImagePython(PY, (2, 35), None))
    made = lock(ws, out / "probe.lock", index=str(out / "index"), cache=out / "cache")
    return wheels_archive(locked_wheels(read_lock(made.path), out / "cache"), out_dir=out)


@pytest.fixture
def deployment(tmp_path, archives) -> Iterator[Boot]:
    dep = Boot(tmp_path, archives)
    try:
        yield dep
    finally:
        dep.close()


def test_delivered_code_trains_a_second_run_is_a_no_op_and_preemption_saves(deployment, tmp_path):
    dep, vm = deployment, deployment.vm
    for archive in dep.archives:
        dep.upload(archive)
    # A disk that already carries a filesystem and data: it must never be reformatted.
    seed = tmp_path / "seed"
    seed.mkdir()
    (seed / "keep-me").write_text("checkpoints live here\n")
    subprocess.run(["mkfs.ext4", "-q", "-F", "-d", str(seed), str(dep.disk.path)], check=True)
    uuid = subprocess.run(["blkid", "-s", "UUID", "-o", "value", str(dep.disk.path)],
                          capture_output=True, text=True, check=True).stdout
    scripts = dep.scripts(steps=10_000_000)
    j0, e0 = dep.boot(scripts)

    assert dep.startup_rc(e0) == 0, vm.tail()
    first = "\n".join(dep.startup_lines(j0))
    for archive in dep.archives:
        sha = archive.release.sha256
        assert f"code {sha[:16]} installed in /opt/spottrain/releases/{sha} (sha256 verified)" in first
    assert "formatting" not in first and "growing" not in first  # same size: nothing to grow
    assert vm.exec(["blkid", "-s", "UUID", "-o", "value", DISK]).stdout == uuid
    assert vm.path("/mnt/spottrain/keep-me").read_text() == "checkpoints live here\n"
    # The trainer runs the user's task from the delivered code.
    vm.wait_journal(lambda line: "event=step" in line, GUARD_S)
    assert dep.metadata.wait_guest_attribute("spottrain/state", GUARD_S) == "training"

    pid = vm.exec(["systemctl", "show", "--property=MainPID", "--value", UNIT]).stdout
    unit = vm.path(f"/etc/systemd/system/{UNIT}").read_text()
    offset = len(vm.journal())
    again = vm.exec(["bash", str(dep.root / "startup.sh")], timeout=GUARD_S)

    assert again.returncode == 0, again.stdout + again.stderr
    for archive in dep.archives:
        assert f"code {archive.release.sha256[:16]} already installed" in again.stdout
    assert "formatting" not in again.stdout and "installed in" not in again.stdout.replace(
        "already installed in", "")
    assert "trainer unit already running" in again.stdout
    assert vm.exec(["systemctl", "show", "--property=MainPID", "--value", UNIT]).stdout == pid
    assert vm.path(f"/etc/systemd/system/{UNIT}").read_text() == unit
    assert f"Starting {UNIT}" not in vm.journal()[offset:]
    assert "Reloading" not in vm.journal()[offset:]  # no file changed: no daemon-reload

    # Preemption: the notice, then ACPI soft-off; the shutdown script stops the unit in time.
    dep.metadata.preempt()
    off = vm.power_off(30)
    assert not off["killed"], vm.tail()
    shutdown = [line for line in vm.journal()[offset:].splitlines() if "spottrain-shutdown:" in line]
    assert any("preemption: the trainer saved its emergency checkpoint and stopped (exit 75)"
               in line for line in shutdown), "\n".join(shutdown)
    assert any("trainer: " in line and "event=preempted" in line for line in shutdown), shutdown
    assert dep.metadata.guest_attributes()["spottrain/state"] == "stopped-75"


def test_a_restarted_vm_reuses_its_code_and_a_recreated_one_fetches_it_again(deployment):
    dep, vm = deployment, deployment.vm
    for archive in dep.archives:
        dep.upload(archive)
    scripts = dep.scripts(steps=10_000_000)
    saved = []
    for keep_boot_disk, fetched in ((False, True), (True, False), (False, True)):
        dep.metadata.reset()  # a VM powered on again is no longer preempted
        j0, e0 = dep.boot(scripts, keep_boot_disk=keep_boot_disk)
        assert dep.startup_rc(e0) == 0, vm.tail()
        lines = "\n".join(dep.startup_lines(j0))
        for archive in dep.archives:
            sha = archive.release.sha256[:16]
            assert (f"code {sha} installed in" in lines) == fetched, lines
            assert (f"code {sha} already installed" in lines) == (not fetched), lines
        restored = vm.wait_journal(lambda line: re.search(r"event=restore step=(\d+)", line)
                                   if "event=restore" in line else None, GUARD_S, since=j0)
        if saved:  # every boot after a preemption resumes from the checkpoint saved on notice
            assert int(restored.group(1)) == saved[-1], vm.tail()
        # The same checkpoint key on every boot (a recreated VM's boot disk is new): version 1 of
        # the experiment's secret, on a tmpfs, readable by root only.
        assert vm.exec(["stat", "-f", "-c", "%T", CHECKPOINT_KEY_FILE]).stdout.strip() == "tmpfs"
        assert vm.exec(["stat", "-c", "%a %U", CHECKPOINT_KEY_FILE]).stdout.strip() == "600 root"
        assert len(dep.gcp.secret_versions(dep.key_secret)) == 1
        vm.wait_journal(lambda line: "event=step" in line, GUARD_S, since=j0)
        dep.metadata.preempt()
        assert not vm.power_off(30)["killed"], vm.tail()
        m = re.search(r"event=preempted step=(\d+)", vm.journal()[j0:])
        assert m, vm.tail()
        saved.append(int(m.group(1)))


def test_the_boot_ships_its_journal_to_cloud_logging_without_ever_waiting_for_it(deployment):
    """The startup script starts the log shipper first (spottrain-logs.service, the very file
    trainer/cloud/log_shipper.py): the boot's, the trainer's and the shutdown script's lines reach the
    Logging API as structured entries, the emergency save's inside the window. A Logging API that
    is down delays nothing: the trainer starts, and the lines arrive once it answers."""
    from drill.fake_observability import FakeObservability
    from stacks.boot import LogShipping

    dep, vm = deployment, deployment.vm
    for archive in dep.archives:
        dep.upload(archive)
    with FakeObservability("boot-test-project", token="drill-fake-token") as logging_api:
        logging_api.fail("POST", "entries:write", 503, times=3)  # down while the VM boots
        vm.env["SPOTTRAIN_LOGGING_API"] = logging_api.logging_api
        scripts = dep.scripts(steps=10_000_000, logs=LogShipping(project="boot-test-project", stall_s=3600))
        j0, e0 = dep.boot(scripts)
        assert dep.startup_rc(e0) == 0, vm.tail()
        vm.wait_journal(lambda line: "event=step" in line, GUARD_S, since=j0)

        def events(o: FakeObservability, source: str) -> list[str]:
            return [e["jsonPayload"].get("event") for e in o.entries if e["jsonPayload"]["source"] == source]

        assert logging_api.wait_for(lambda o: "step" in events(o, "trainer"), GUARD_S), vm.tail()
        assert [c[2] for c in logging_api.calls[:3]] == [503, 503, 503]
        assert vm.path("/etc/spottrain/log_shipper.py").read_text() == \
            (REPO / "trainer" / "cloud" / "log_shipper.py").read_text()
        first_boot = [e for e in logging_api.entries if e["jsonPayload"].get("event") == "boot"]
        assert [e["jsonPayload"]["fields"]["after"] for e in first_boot] == ["first"]
        step = next(e["jsonPayload"] for e in logging_api.entries if e["jsonPayload"].get("event") == "step")
        assert (step["experiment"], step["run"], step["node"]) == ("boot-test", "runs/boot-test", "spottrain-drill-vm")
        assert step["session"] and step["boot"] and isinstance(step["step"], int)

        dep.metadata.preempt()
        assert not vm.power_off(30)["killed"], vm.tail()
        assert "preempted" in events(logging_api, "trainer"), [e["jsonPayload"]["message"] for e in logging_api.entries]
        shutdown = [e["jsonPayload"] for e in logging_api.entries if e["jsonPayload"].get("event") == "shutdown"]
        assert [(p["fields"]["reason"], p["fields"]["trainer_status"]) for p in shutdown] == [("preemption", 75)]
        exited = [e["jsonPayload"] for e in logging_api.entries
                  if e["jsonPayload"]["source"] == "systemd" and "Main process exited" in e["jsonPayload"]["message"]]
        assert exited and exited[-1]["session"] == step["session"]

        # The group recreates the VM: a new boot disk, the same checkpoint disk, a new boot id.
        dep.metadata.reset()
        j1, e1 = dep.boot(scripts)
        assert dep.startup_rc(e1) == 0, vm.tail()
        assert logging_api.wait_for(lambda o: [e["jsonPayload"]["fields"]["after"] for e in o.entries
                                               if e["jsonPayload"].get("event") == "boot"] == ["first", "preemption"],
                                    GUARD_S), vm.tail()
        assert len({e["jsonPayload"]["boot"] for e in logging_api.entries}) == 2
        vm.power_off(30)


def health(port: int) -> bytes:
    """The group's health check: send the request, read the answer (retried while the answering
    service starts; the guard is the deadline)."""
    deadline = time.monotonic() + GUARD_S
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(b"spottrain-health")
                return s.recv(64)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)  # polling a port that is being opened; not a synchronisation sleep


def test_a_finished_run_is_recorded_and_never_trains_again(deployment):
    from drill.net import free_port

    dep, vm = deployment, deployment.vm
    for archive in dep.archives:
        dep.upload(archive)
    port = free_port()
    j0, e0 = dep.boot(dep.scripts(steps=5, health_port=port))
    assert dep.startup_rc(e0) == 0, vm.tail()
    vm.wait_event(lambda e: e["event"] == "unit-exited" and e["unit"] == UNIT, GUARD_S, since=e0)
    assert vm.exec(["systemctl", "show", "--property=ExecMainStatus", "--value", UNIT]).stdout == "0\n"
    assert dep.metadata.guest_attributes()["spottrain/state"] == "finished"
    assert vm.path(FINISHED_FILE).read_text().startswith("20")
    # The VM stays healthy (no autoheal recreation loop) and says it is done.
    assert health(port) == b"ok finished\n"

    # The next boot of this VM (or of its replacement with the same disk) starts nothing.
    offset, events = len(vm.journal()), len(vm.events())
    again = vm.exec(["bash", str(dep.root / "startup.sh")], timeout=GUARD_S)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "the run finished at" in again.stdout and "not starting the trainer" in again.stdout
    assert not [e for e in vm.events()[events:] if e["event"] == "unit-starting"]
    assert f"Starting {UNIT}" not in vm.journal()[offset:]
    assert health(port) == b"ok finished\n"

    # The experiment now has more steps: finished at 5 is not finished at 8, so the trainer
    # starts, and, without extend_steps in the experiment, refuses (exit 2) and says why.
    vm.exec(["systemctl", "stop", "spottrain-finished.service"])
    assert vm.path(FINISHED_FILE).read_text().endswith(" steps=5\n")
    (dep.root / "startup.sh").write_text(dep.scripts(steps=8, health_port=port).startup)
    offset, events = len(vm.journal()), len(vm.events())
    more = vm.exec(["bash", str(dep.root / "startup.sh")], timeout=GUARD_S)
    assert more.returncode == 0, more.stdout + more.stderr
    assert "the run finished at 5 steps; the experiment now says 8: starting the trainer" in more.stdout
    ev = vm.wait_event(lambda e: e["event"] == "unit-exited" and e["unit"] == UNIT, GUARD_S, since=events)
    assert (ev["code"], ev["status"], ev["restarting"]) == ("exited", 2, False), vm.tail()
    assert health(port).startswith(b"ok bad-input: cannot resume: steps: checkpoint has 5")  # (64 bytes read)
    assert "this run has 8; to continue this run to 8 steps, say so with --extend-steps" in \
        dep.metadata.guest_attributes()["spottrain/reason"]


def _fails_loudly(dep: Boot, scripts: BootScripts, message: str) -> str:
    j0, e0 = dep.boot(scripts)
    rc = dep.startup_rc(e0)
    lines = dep.startup_lines(j0)
    assert rc != 0, dep.vm.tail()
    assert "FAILED: " in lines[-1] and message in lines[-1], "\n".join(lines)
    assert not [e for e in dep.vm.events()[e0:] if e["event"] == "unit-starting"]
    assert dep.metadata.guest_attributes()["spottrain/state"] == "failed"
    return lines[-1]


def test_a_missing_archive_fails_loudly(deployment):
    trainer, user = deployment.archives
    deployment.upload(trainer)  # the user's archive is not in the bucket
    line = _fails_loudly(deployment, deployment.scripts(steps=5), "cannot fetch user code")
    assert f"gs://{BUCKET}/{user.release.object_name} (HTTP 404)" in line


def test_a_corrupt_archive_fails_loudly_and_installs_nothing(deployment):
    trainer, user = deployment.archives
    data = bytearray(trainer.path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    deployment.upload(trainer, bytes(data))
    deployment.upload(user)
    line = _fails_loudly(deployment, deployment.scripts(steps=5), "trainer code")
    assert "is corrupt: sha256 " in line and f"expected {trainer.release.sha256}" in line
    assert not deployment.vm.path(f"/opt/spottrain/releases/{trainer.release.sha256}").exists()


def test_a_disk_grown_since_its_filesystem_was_made_gets_the_space_at_boot(deployment, tmp_path):
    """`gcloud compute disks resize` grows the kept stateful disk, not its filesystem: the next
    boot grows it online (a real ext4 on a loop device whose image was grown with truncate)."""
    dep = deployment
    seed = tmp_path / "seed"
    seed.mkdir()
    (seed / "keep-me").write_text("checkpoints live here\n")
    subprocess.run(["mkfs.ext4", "-q", "-F", "-d", str(seed), str(dep.disk.path)], check=True)
    os.truncate(dep.disk.path, 96 << 20)  # the disk, resized from 64 to 96 MiB
    # Nothing uploaded: the boot stops at the code download, after the disk is ready.
    j0, e0 = dep.boot(dep.scripts(steps=5))
    assert dep.startup_rc(e0) != 0
    lines = "\n".join(dep.startup_lines(j0))
    assert "growing the checkpoint filesystem from 64 MiB to the disk's 96 MiB" in lines, lines
    assert "checkpoint filesystem grown to 96 MiB" in lines and "formatting" not in lines
    info = dep.vm.exec(["tune2fs", "-l", DISK]).stdout
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    assert int(fields["Block count"]) * int(fields["Block size"]) > 95 << 20
    assert dep.vm.path("/mnt/spottrain/keep-me").read_text() == "checkpoints live here\n"


class ForbiddenFirst:
    """A loopback HTTP proxy in front of the storage emulator that answers 403 to the first
    `times` downloads of a code archive (a bucket grant not propagated yet), then forwards."""

    def __init__(self, upstream: str, times: int) -> None:
        import http.client
        import http.server
        import threading
        from urllib.parse import urlsplit

        self.left, self.forbidden = times, 0
        up = urlsplit(upstream)
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _any(self) -> None:
                if self.command == "GET" and "/o/code%2F" in self.path and proxy.left > 0:
                    proxy.left -= 1
                    proxy.forbidden += 1
                    body = b'{"error": {"code": 403, "message": "does not have storage.objects.get"}}'
                    self.send_response(403)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                length = int(self.headers.get("Content-Length") or 0)
                data = self.rfile.read(length) if length else None
                conn = http.client.HTTPConnection(up.hostname, up.port, timeout=60)
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("host", "connection")}
                conn.request(self.command, self.path, body=data, headers=headers)
                resp = conn.getresponse()
                payload = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
                conn.close()

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _any

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.host = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def forbidden_first(deployment):
    """(make(times) -> proxy): the startup script's bucket answers 403 `times` times first."""
    made: list[ForbiddenFirst] = []

    def make(times: int) -> ForbiddenFirst:
        proxy = ForbiddenFirst(deployment.gcs.host, times)
        made.append(proxy)
        deployment.vm.env["STORAGE_EMULATOR_HOST"] = proxy.host
        return proxy

    yield make
    for proxy in made:
        proxy.close()


def test_a_403_on_the_code_download_is_retried_while_iam_propagates(deployment, forbidden_first):
    for archive in deployment.archives:
        deployment.upload(archive)
    proxy = forbidden_first(2)
    j0, e0 = deployment.boot(deployment.scripts(steps=10_000_000, forbidden_first_wait_s=1))
    assert deployment.startup_rc(e0) == 0, deployment.vm.tail()
    lines = deployment.startup_lines(j0)
    waits = [line for line in lines if "answered HTTP 403" in line]
    assert len(waits) == 2 and proxy.forbidden == 2, "\n".join(lines)
    assert "retrying in 1 s" in waits[0] and "retrying in 2 s" in waits[1]  # backoff, logged
    trainer = deployment.archives[0].release
    assert any(f"code {trainer.sha256[:16]} installed in" in line for line in lines)


def test_a_403_that_outlasts_iam_propagation_fails_clearly(deployment, forbidden_first):
    for archive in deployment.archives:
        deployment.upload(archive)
    forbidden_first(10**6)
    line = _fails_loudly(deployment, deployment.scripts(
        steps=5, forbidden_retry_s=2, forbidden_first_wait_s=1), "cannot fetch trainer code")
    assert "still HTTP 403 after" in line and "cannot read the bucket" in line, line
    assert "did not arrive in 2 s" in line


def test_the_checkpoint_key_waits_out_a_403_and_a_lost_key_stops_the_boot(deployment):
    for archive in deployment.archives:
        deployment.upload(archive)
    dep, vm = deployment, deployment.vm
    dep.gcp.deny("GET", r":access$", times=2)  # the secret grant is still propagating
    scripts = dep.scripts(steps=10_000_000, forbidden_first_wait_s=1)
    j0, e0 = dep.boot(scripts)
    assert dep.startup_rc(e0) == 0, vm.tail()
    keys = [line for line in vm.journal()[j0:].splitlines() if "spottrain-key:" in line]
    assert sum("answered HTTP 403" in line for line in keys) == 2, "\n".join(keys)
    assert any("has no version yet: adding a new random key as version 1" in line for line in keys)
    vm.power_off(30)
    # Someone destroyed the key: the VM must not make a new one (it would disown every checkpoint).
    dep.gcp.secrets[dep.key_secret][0]["state"] = "DESTROYED"
    line = _fails_loudly(dep, scripts, "cannot read the checkpoint key")
    assert dep.key_secret in line
    assert "FAILED_PRECONDITION" in vm.journal()
    assert len(dep.gcp.secret_versions(dep.key_secret)) == 1


def test_no_gpu_driver_fails_with_a_clear_message_instead_of_hanging(deployment):
    for archive in deployment.archives:
        deployment.upload(archive)
    deployment.vm.set_gpu("missing")
    line = _fails_loudly(deployment, deployment.scripts(steps=5, driver_timeout_s=1),
                         "no working GPU driver after 1 s")
    assert "couldn't communicate with the NVIDIA driver" in line


GATED_UNIT = """\
[Service]
Type=exec
ExecStart=/etc/spottrain/gated.sh
KillMode=mixed
TimeoutStopSec=25
SuccessExitStatus=75
"""
# A trainer stand-in whose emergency save ends only when the test says so: it stays
# "deactivating" as long as the test needs, without a timing guess.
GATED_TRAINER = """\
#!/bin/bash
trap 'until [[ -e /run/release ]]; do sleep 0.05; done; echo "event=preempted step=7"; exit 75' TERM
while :; do sleep 1 & wait $!; done
"""


def test_the_shutdown_script_waits_for_a_trainer_systemd_is_already_stopping(deployment):
    """At power-off systemd stops every unit in parallel with the shutdown script: the trainer
    can be "deactivating" when the script asks. It must still wait for the save and report it."""
    dep, vm = deployment, deployment.vm
    real = dep.scripts(steps=5)
    install = (f"#!/bin/bash\nset -euo pipefail\ninstall -d /etc/spottrain\n"
               f"cat > /etc/spottrain/gated.sh <<'EOF'\n{GATED_TRAINER}EOF\n"
               "chmod 0755 /etc/spottrain/gated.sh\n"
               f"cat > /etc/systemd/system/{UNIT} <<'EOF'\n{GATED_UNIT}EOF\n"
               f"systemctl daemon-reload\nsystemctl start {UNIT}\n")
    j0, e0 = dep.boot(BootScripts(startup=install, shutdown=real.shutdown, unit="", trainer_sh=""))
    assert dep.startup_rc(e0) == 0, vm.tail()
    # systemd's own stop, under way before the shutdown script asks.
    vm.exec(["bash", "-c", f"systemctl stop {UNIT} >/dev/null 2>&1 &"])
    vm.wait_event(lambda e: e["event"] == "unit-stopping" and e["unit"] == UNIT, GUARD_S, since=e0)
    assert vm.exec(["systemctl", "is-active", UNIT]).stdout == "deactivating\n"
    dep.metadata.preempt()

    import threading

    off: dict = {}
    power = threading.Thread(target=lambda: off.update(vm.power_off(60)))
    power.start()
    try:
        vm.wait_journal(lambda line: "spottrain-shutdown: the trainer is already stopping" in line,
                        GUARD_S, since=j0)
    finally:
        if vm.running:
            vm.path("/run/release").touch()  # the save completes
        power.join()
    assert not off["killed"], vm.tail()
    shutdown = [line for line in vm.journal()[j0:].splitlines() if "spottrain-shutdown:" in line]
    assert any("preemption: the trainer saved its emergency checkpoint and stopped (exit 75)"
               in line for line in shutdown), "\n".join(shutdown)
    assert not any("was not running" in line for line in shutdown)
    assert dep.metadata.guest_attributes()["spottrain/state"] == "stopped-75"


def test_bad_input_is_not_restarted_in_a_loop(deployment):
    """Exit 2 (bad input: here a task the delivered code does not have) stops the unit for good;
    restarting could not fix it."""
    dep, vm = deployment, deployment.vm
    for archive in dep.archives:
        dep.upload(archive)
    j0, e0 = dep.boot(dep.scripts(steps=5, task="usertask:no_such_task"))
    assert dep.startup_rc(e0) == 0, vm.tail()
    ev = vm.wait_event(lambda e: e["event"] == "unit-exited" and e["unit"] == UNIT, GUARD_S,
                       since=e0)
    assert (ev["code"], ev["status"], ev["restarting"]) == ("exited", 2, False), vm.tail()
    show = vm.exec(["systemctl", "show", "--property=ActiveState,NRestarts", UNIT]).stdout
    assert show == "ActiveState=failed\nNRestarts=0\n"
    assert "no_such_task" in vm.journal()[j0:]
    assert not vm.path(FINISHED_FILE).exists()


# --- [data] and the shipped wheels (issue 11) ---------------------------------------------------
DATA_BUCKET = "boot-test-data"


def _dataset(dep: Boot, n: int = 3) -> str:
    """Objects under gs://boot-test-data/ds (a bucket of its own); the sha256 the task reports."""
    import hashlib

    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    client = storage.Client(project="boot-test", credentials=AnonymousCredentials(),
                            client_options={"api_endpoint": dep.gcs.host})
    bucket = client.create_bucket(DATA_BUCKET)
    h = hashlib.sha256()
    for i in range(n):
        key, data = f"shard-{i}.bin", bytes([i]) * (1000 * (i + 1))
        bucket.blob(f"ds/{key}").upload_from_string(data)
        h.update(key.encode() + b"\0" + data)
    return h.hexdigest()


def _data_seen(vm, since: int) -> re.Match:
    return vm.wait_journal(lambda line: re.search(r"event=data_seen dir=(\S+) files=(\d+) sha256=(\w+) "
                                                  r"probe=(\d+)", line), GUARD_S, since=since)


def test_data_is_staged_and_wheels_installed_once_a_recreated_vm_reuses_both(deployment, wheels):
    dep, vm = deployment, deployment.vm
    for archive in (*dep.archives, wheels):
        dep.upload(archive)
    digest = _dataset(dep)
    scripts = dep.scripts(steps=10_000_000, task="datatask:build", wheels=wheels,
                          data_source=f"gs://{DATA_BUCKET}/ds", data_parallel=2)
    deps_dir = f"/mnt/spottrain/deps/{wheels.release.sha256}"
    for boot in (1, 2):  # the second: the group recreated the VM (new boot disk, same data disk)
        dep.metadata.reset()
        j0, e0 = dep.boot(scripts)
        assert dep.startup_rc(e0) == 0, vm.tail()
        lines = "\n".join(dep.startup_lines(j0))
        if boot == 1:
            assert f"installed in {deps_dir} (1 wheels, offline)" in lines, lines
        else:  # nothing fetched, nothing installed: the disk has them
            assert f"already installed in {deps_dir}" in lines and "wheels code" not in lines, lines
        assert "dataset staged in /mnt/spottrain/data" in lines, lines
        staged = re.search(r"event=staging_done .* downloaded_files=(\d+) ", vm.journal()[j0:])
        assert staged and int(staged.group(1)) == (3 if boot == 1 else 0), vm.tail()
        seen = _data_seen(vm, j0)  # the task read the dataset at ctx.data_dir, with the wheel's package
        assert seen.groups() == ("/mnt/spottrain/data", "3", digest, "42")
        vm.wait_journal(lambda line: "event=step" in line, GUARD_S, since=j0)
        ledger = vm.path("/mnt/spottrain/run/goodput/ledger.jsonl").read_text()
        assert ledger.count('"event": "staging"') == boot  # its own badput, every boot
        dep.metadata.preempt()
        assert not vm.power_off(30)["killed"], vm.tail()


def test_a_data_prefix_with_nothing_in_it_fails_the_boot_clearly(deployment):
    for archive in deployment.archives:
        deployment.upload(archive)
    _dataset(deployment)
    line = _fails_loudly(deployment, deployment.scripts(steps=5, data_source=f"gs://{DATA_BUCKET}/empty"),
                         "cannot stage gs://boot-test-data/empty (bad input")
    assert "fix [data]" in line
    assert "no objects under gs://boot-test-data/empty/" in deployment.vm.journal()


def test_wheels_for_another_python_are_refused_before_installing(deployment, wheels):
    for archive in (*deployment.archives, wheels):
        deployment.upload(archive)
    line = _fails_loudly(deployment, deployment.scripts(steps=5, wheels=wheels, python_version="3.9"),
                         f"is {PY}, but the wheels were locked for Python 3.9")
    assert "machine.python_version" in line
    assert not deployment.vm.path(f"/mnt/spottrain/deps/{wheels.release.sha256}").exists()
