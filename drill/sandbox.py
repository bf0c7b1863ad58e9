"""The drill VM: a stand-in for one Spot VM built from namespaces over throwaway directories.

A `Sandbox` is one VM's life: `boot()` starts `unshare --mount --pid --fork` with the service
manager (`drill.service_manager`) as its PID 1; `power_off()` is the ACPI soft-off of a preemption
(the shutdown script runs, units stop) with a hard kill when the window closes: killing PID 1 of
a PID namespace kills every process in it, exactly like a VM losing power. The disk image
outlives the VM; `wipe_disk()` replaces it with a blank one (a VM recreated in another zone).

Inside, the VM sees (all in its own mount namespace, nothing reaches the host's paths):
- `/etc /opt /usr /var /root /home /srv /dev` as overlays whose writes land in throwaway upper
  dirs (so the scripts can write units and install files freely), `/mnt` and `/run` fresh tmpfs;
  its own hostname (UTS namespace);
- the checkpoint disk, a real ext4-able image on a loop device, at
  `/dev/disk/by-id/google-spottrain-checkpoints` (and local SSDs at
  `google-local-nvme-ssd-N` when asked for); `/dev/ttyS0` and `/dev/console` as files;
- stubs for what cannot exist here, installed at their real paths: `systemctl` (talks to PID 1),
  `nvidia-smi`, `logger`, `systemd-cat`, `journalctl`; and `python3` is the project's venv
  Python, standing in for the Deep Learning VM image's torch.
Everything else is the host's own: bash, coreutils, util-linux (`mount`, `blkid`, `mkfs.ext4`,
`mountpoint`), curl, and the network namespace (the fakes listen on 127.0.0.1).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel

REPO = Path(__file__).resolve().parent.parent
STUBS = Path(__file__).resolve().parent / "stubs"
OVERLAYS = ("/etc", "/opt", "/usr", "/var", "/root", "/home", "/srv", "/dev")
DISK_LINK = "disk/by-id/google-{}"


class SandboxConfig(BaseModel):
    """What PID 1 of the VM needs to know; written as JSON by the host side."""

    state_dir: str
    """Host dir (visible inside) holding the journal, serial log, events and overlay uppers."""
    hostname: str = "spottrain-drill-vm"
    env: dict[str, str]
    """The manager's environment: what the metadata scripts run with."""
    default_environment: dict[str, str] = {}
    """systemd's DefaultEnvironment=: given to every unit (points clients at the fakes)."""
    startup_script_file: str | None = None
    """Run this file instead of fetching `startup-script` from the metadata server."""
    shutdown_script_file: str | None = None
    exit_after_startup: bool = False
    """Power off as soon as the startup script has finished (a one-shot script run)."""


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)


def enter(cfg: SandboxConfig) -> None:
    """Mount the VM's filesystem view; runs as PID 1 inside the new mount namespace."""
    state = Path(cfg.state_dir)
    hold = state / "hold"
    for sub in ("shm", "pts"):
        (hold / sub).mkdir(parents=True, exist_ok=True)
        _run("mount", "--bind", f"/dev/{sub}", str(hold / sub))
    for target in OVERLAYS:
        name = target.strip("/")
        upper, work = state / "upper" / name, state / "work" / name
        upper.mkdir(parents=True, exist_ok=True)
        work.mkdir(parents=True, exist_ok=True)
        _run("mount", "-t", "overlay", f"drill-{name}", "-o",
             f"lowerdir={target},upperdir={upper},workdir={work}", target)
    for sub in ("shm", "pts"):
        _run("mount", "--move", str(hold / sub), f"/dev/{sub}")
    # A VM boots with an empty /mnt and /run.
    _run("mount", "-t", "tmpfs", "-o", "mode=0755", "drill-mnt", "/mnt")
    _run("mount", "-t", "tmpfs", "-o", "mode=0755", "drill-run", "/run")
    Path("/run/drill").mkdir()
    Path("/run/lock").mkdir()
    socket.sethostname(cfg.hostname)
    # A new boot id per boot, as the kernel gives a VM.
    boot_id = state / "boot_id"
    boot_id.write_text(str(uuid.uuid4()) + "\n")
    _run("mount", "--bind", str(boot_id), "/proc/sys/kernel/random/boot_id")
    os.environ.clear()
    os.environ.update(cfg.env)


class Disk:
    """A disk image file attached to a loop device while a VM uses it."""

    def __init__(self, path: Path, size_mb: int) -> None:
        self.path = path
        self.size_mb = size_mb
        self.device: str | None = None
        if not path.exists():
            self.blank()

    def blank(self) -> None:
        """A brand-new disk: no filesystem, all zeros (sparse)."""
        self.detach()
        self.path.unlink(missing_ok=True)
        with open(self.path, "wb") as f:
            f.truncate(self.size_mb * 1024 * 1024)

    def attach(self) -> str:
        if self.device is None:
            out = subprocess.run(["losetup", "--find", "--show", str(self.path)], check=True,
                                 capture_output=True, text=True)
            self.device = out.stdout.strip()
        return self.device

    def detach(self) -> None:
        if self.device is not None:
            subprocess.run(["losetup", "--detach", self.device], stderr=subprocess.DEVNULL)
            self.device = None


class Sandbox:
    """One drill VM. Use as a context manager; `close()` kills, unmounts and removes everything."""

    def __init__(self, state_dir: Path, *, env: dict[str, str] | None = None,
                 default_environment: dict[str, str] | None = None,
                 disks: dict[str, Disk] | None = None, hostname: str = "spottrain-drill-vm",
                 image_files: dict[str, str | Path] | None = None) -> None:
        """`disks`: device_name -> Disk, exposed at /dev/disk/by-id/google-<device_name>.
        `image_files`: absolute VM path -> host file or dir copied into the VM image (e.g. a
        preinstalled package)."""
        self.state = Path(state_dir)
        self.state.mkdir(parents=True, exist_ok=True)
        self.hostname = hostname
        self.env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                    "LANG": "C.UTF-8", "HOME": "/root", **(env or {})}
        self.default_environment = dict(default_environment or {})
        self.disks = dict(disks or {})
        self.image_files = dict(image_files or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self.boots = 0
        self.console = self.state / "console.out"

    # --- files the host reads -------------------------------------------------------------
    @property
    def journal_path(self) -> Path:
        return self.state / "journal.log"

    @property
    def events_path(self) -> Path:
        return self.state / "events.jsonl"

    def journal(self) -> str:
        return self.journal_path.read_text(errors="replace") if self.journal_path.exists() else ""

    def events(self) -> list[dict[str, Any]]:
        if not self.events_path.exists():
            return []
        return [json.loads(line) for line in self.events_path.read_text().splitlines() if line.strip()]

    def set_gpu(self, mode: str) -> None:
        """The nvidia-smi stub's answer: ok | missing | fail."""
        (self.state / "nvidia-smi.mode").write_text(mode)

    # --- the VM's life --------------------------------------------------------------------
    def _image(self, keep_boot_disk: bool) -> None:
        """The overlay uppers for this boot: the stubs, the disks' by-id links, the console.
        `keep_boot_disk` keeps what earlier boots wrote (a STOPped VM restarted); /dev is fresh
        on every boot either way, /mnt and /run are tmpfs."""
        for sub in ("work", "hold", "upper/dev") if keep_boot_disk else ("upper", "work", "hold"):
            shutil.rmtree(self.state / sub, ignore_errors=True)
        upper = self.state / "upper"
        usr_bin = upper / "usr" / "bin"
        usr_bin.mkdir(parents=True, exist_ok=True)
        subs = {"@PYTHON@": sys.executable, "@STATE@": str(self.state), "@HOSTNAME@": self.hostname}
        for stub in STUBS.iterdir():
            if stub.name.startswith((".", "_")) or not stub.is_file():
                continue
            text = stub.read_text()
            for k, v in subs.items():
                text = text.replace(k, v)
            (usr_bin / stub.name).unlink(missing_ok=True)
            (usr_bin / stub.name).write_text(text)
            (usr_bin / stub.name).chmod(0o755)
        # The image's Python with torch: the project's venv interpreter.
        for name in ("python3", "python"):
            (usr_bin / name).unlink(missing_ok=True)
            (usr_bin / name).write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
            (usr_bin / name).chmod(0o755)
        by_id = upper / "dev" / "disk" / "by-id"
        by_id.mkdir(parents=True)
        for device_name, disk in self.disks.items():
            (by_id / f"google-{device_name}").symlink_to(disk.attach())
        for tty in ("ttyS0", "console"):
            (upper / "dev" / tty).symlink_to(self.console)
        for vm_path, src in self.image_files.items():
            dst = upper / vm_path.lstrip("/")
            if dst.exists():
                continue  # a kept boot disk already has it
            dst.parent.mkdir(parents=True, exist_ok=True)
            if Path(src).is_dir():
                shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                shutil.copy2(src, dst)

    def boot(self, *, startup_script_file: Path | None = None, shutdown_script_file: Path | None = None,
             exit_after_startup: bool = False, keep_boot_disk: bool = False) -> None:
        """Start the VM: PID 1 mounts the VM view and runs the startup script. `keep_boot_disk`:
        the boot disk keeps what the previous boot wrote (a STOPped Spot VM started again);
        otherwise it is the pristine image (a VM created or recreated from the template)."""
        assert self.proc is None or self.proc.poll() is not None, "VM already running"
        self._image(keep_boot_disk and self.boots > 0)
        self.boots += 1
        self.journal_path.touch()
        with open(self.events_path, "a") as f:
            f.write(json.dumps({"t": time.time(), "event": "power-on", "boot": self.boots}) + "\n")
        cfg = SandboxConfig(state_dir=str(self.state), hostname=self.hostname, env=self.env,
                            default_environment=self.default_environment,
                            startup_script_file=str(startup_script_file) if startup_script_file else None,
                            shutdown_script_file=str(shutdown_script_file) if shutdown_script_file else None,
                            exit_after_startup=exit_after_startup)
        cfg_path = self.state / "vm.json"
        cfg_path.write_text(cfg.model_dump_json())
        with open(self.state / "pid1.out", "ab") as out:
            self.proc = subprocess.Popen(
                ["unshare", "--mount", "--uts", "--pid", "--fork", "--mount-proc", "--propagation", "private",
                 "--kill-child", sys.executable, "-m", "drill.service_manager", str(cfg_path)],
                cwd=REPO, env=self.env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def pid1(self) -> int | None:
        """Host pid of the VM's PID 1 (the child unshare forked)."""
        if not self.running:
            return None
        assert self.proc is not None
        try:
            children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        except OSError:
            return None
        return int(children[0]) if children else None

    def path(self, vm_path: str) -> Path:
        """A path as the running VM sees it, readable from the host (through /proc/PID/root)."""
        pid = self.pid1()
        if pid is None:
            raise RuntimeError("the VM is not running")
        return Path(f"/proc/{pid}/root") / vm_path.lstrip("/")

    def exec(self, argv: list[str], *, timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run a command inside the running VM (its mount and PID namespaces), like SSH."""
        pid = self.pid1()
        if pid is None:
            raise RuntimeError("the VM is not running")
        return subprocess.run(["nsenter", "-t", str(pid), "-m", "-p", "--", *argv], env={**self.env, **(env or {})},
                              capture_output=True, text=True, timeout=timeout, cwd="/")

    def wait_event(self, pred: Callable[[dict[str, Any]], bool], timeout: float, *, since: int = 0,
                   check: Callable[[], None] | None = None) -> dict[str, Any]:
        """The first event (from index `since`) matching `pred`; raises TimeoutError after
        `timeout` (a failure guard) or as soon as the VM is gone without it. `check` runs on
        every poll and may raise to give up early (e.g. a failed unit)."""
        return self._poll(lambda: next((ev for ev in self.events()[since:] if pred(ev)), None),
                          "event", timeout, check)

    def wait_journal(self, pred: Callable[[str], Any], timeout: float, *, since: int = 0,
                     check: Callable[[], None] | None = None) -> Any:
        """The first truthy `pred(line)` over journal lines from character offset `since`."""
        return self._poll(lambda: next((hit for line in self.journal()[since:].splitlines()
                                        if (hit := pred(line))), None),
                          "journal line", timeout, check)

    def _poll(self, find: Callable[[], Any], awaited: str, timeout: float,
              check: Callable[[], None] | None) -> Any:
        """Poll `find` (None: not yet) until it answers, the VM is gone, or `timeout` passes."""
        deadline = time.monotonic() + timeout
        while True:
            if check is not None:
                check()
            gone = not self.running  # read before `find`, so a last event written at power-off counts
            found = find()
            if found is not None:
                return found
            if gone:
                raise TimeoutError(f"VM powered off without the awaited {awaited}; journal tail:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no awaited {awaited} within {timeout}s; journal tail:\n{self.tail()}")
            time.sleep(0.05)  # polling a file the VM appends to; not a synchronisation sleep

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.journal().splitlines()[-n:])

    def power_off(self, window: float) -> dict[str, float | bool]:
        """ACPI soft-off now, hard power-off `window` seconds later if anything is still alive.

        Returns when the VM is gone: {"seconds": how long it took, "killed": whether the window
        ran out}."""
        t0 = time.monotonic()
        pid = self.pid1()
        if pid is not None:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        killed = False
        assert self.proc is not None
        try:
            self.proc.wait(timeout=window)
        except subprocess.TimeoutExpired:
            killed = True
            self.kill()
        return {"seconds": time.monotonic() - t0, "killed": killed}

    def kill(self) -> None:
        """Pull the plug: SIGKILL to PID 1 takes every process of the VM with it."""
        if self.proc is None:
            return
        pid = self.pid1()
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def run_script(self, script: Path, *, timeout: float = 300) -> int:
        """Boot a VM that runs `script` as its startup script and powers off when it ends; the
        script's exit status (its output is in the journal)."""
        since = len(self.events())
        self.boot(startup_script_file=script, exit_after_startup=True)
        ev = self.wait_event(lambda e: e["event"] == "startup-script-exited", timeout, since=since)
        assert self.proc is not None
        self.proc.wait(timeout=timeout)
        return int(ev["rc"])

    def close(self) -> None:
        self.kill()
        for disk in self.disks.values():
            disk.detach()

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def disk_status(disk: Disk, argv: list[str], *, mount_at: str = "/mnt/spottrain", timeout: float = 300,
                env: dict[str, str] | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    """Run `argv` on the host with `disk` mounted read-only at `mount_at` in a private mount
    namespace (for `python -m trainer status` after the VM is gone). A blank disk is not
    mounted: `mount_at` is then an empty directory."""
    device = disk.attach()
    try:
        script = ('set -e; mount -t tmpfs drill-mnt /mnt; mkdir -p "$1"; '
                  'if blkid "$2" >/dev/null; then mount -o ro "$2" "$1"; fi; shift 2; exec "$@"')
        return subprocess.run(["unshare", "--mount", "--propagation", "private", "bash", "-c", script, "drill",
                               mount_at, device, *argv], capture_output=True, text=True, timeout=timeout,
                              cwd=cwd, env={**os.environ, **(env or {})})
    finally:
        disk.detach()
