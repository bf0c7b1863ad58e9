"""The TCP health server the managed instance group's autohealer asks.

Protocol (fixed with the stack): the check sends ``spottrain-health`` and passes only when the
answer begins with ``ok``. Answers: ``ok starting`` during start-up and restore for the first
``startup_grace_s`` of the process, ``starting`` after that (a start-up that hangs gets the VM
repaired), ``ok`` while steps complete, ``ok degraded: gcs failing since ...`` while steps complete but a checkpoint tier keeps
failing (it passes: a VM still training must not be recreated for it), ``stalled`` once no step
has completed for the stall timeout (a hung collective or data loader: failing the check makes
the group recreate the VM, which resumes from the checkpoint), ``ok finishing: ...`` while the
final checkpoint (or a pause's) is being made durable (bounded by ``durable_timeout_s``) and then
while the finished run exports its weights (``ok finishing: exporting step N``), ``ok finished``
once the run is complete (as the VM's own answer after the trainer exits: a finished VM is never
recreated). Any other request gets ``unknown``. While start-up waits
for something a new VM cannot fix (a checkpoint tier it cannot read yet, another trainer's
lease to expire; bounded by the trainer) the answer is ``ok waiting ...``: recreating the VM
would only start the wait over.

Why the grace: the group's ``initial_delay_sec`` spares a *new* VM's start-up only. A trainer
restarted in place (a crash, systemd's restart, torchrun re-forming the world) on a VM that has
run for hours gets about a minute (6 failed probes 10 s apart) before the group recreates the
VM: a new boot disk, a reinstall, the local SSD lost, all for a restore that was going fine. So
start-up passes the check for as long as a new VM's would (the stack sets the grace to
``initial_delay_sec``), and no longer.
"""
from __future__ import annotations

import errno
import logging
import os
import socket
import socketserver
import threading
import time
from typing import Callable


class PortInUse(Exception):
    """The health port is taken by another process (bad input: exit 2, naming the port)."""


def holder(port: int) -> str:
    """`` by pid N (command line)`` of the process listening on TCP ``port``, from /proc (best
    effort: "" when it cannot be told, e.g. another user's process without root)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    parts = line.split()
                    # local address "IP:PORT" in hex, state 0A = LISTEN, inode in column 10
                    if len(parts) > 9 and parts[3] == "0A" and int(parts[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(parts[9])
        except (OSError, ValueError, StopIteration):
            continue
    if not inodes:
        return ""
    wanted = {f"socket:[{i}]" for i in inodes}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in wanted for fd in fds):
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                return f" by pid {pid} ({cmd[:200]})"
        except OSError:
            continue
    return ""


class Health:
    """The state the server reports; the loop calls ``beat()`` after every step.

    ``on_stalled(step, seconds)`` is told once when steps stop (``check``, which ``watch`` runs on a
    thread of its own: the loop itself is what hangs), so that the run's ``Stalled`` event is
    emitted whether or not the group's check asks."""

    def __init__(self, stall_timeout_s: float, clock: Callable[[], float] = time.monotonic,
                 degraded: Callable[[], str] | None = None, startup_grace_s: float = 0.0):
        self.stall_timeout_s = stall_timeout_s
        self.clock = clock
        self.startup_grace_s = startup_grace_s
        self._born = clock()
        #: One line saying which checkpoint tiers keep failing ("" when none does).
        self.degraded = degraded
        self._phase = "starting"
        self._finishing = ""
        self._last_beat = clock()
        self._step = 0
        self._stall_told = False
        self.on_stalled: Callable[[int, float], None] | None = None
        self._stop = threading.Event()

    def beat(self, step: int = 0) -> None:
        self._last_beat = self.clock()
        self._phase = "running"
        self._step = step
        self._stall_told = False

    def stalled(self) -> float | None:
        """Seconds since the last step while steps should be completing and none has for the stall
        timeout; None otherwise."""
        since = self.clock() - self._last_beat
        return since if self._phase == "running" and since > self.stall_timeout_s else None

    def check(self) -> None:
        """Tell ``on_stalled`` once about a stall (again after the next step, should it stall again)."""
        since = self.stalled()
        if since is not None and not self._stall_told:
            self._stall_told = True
            if self.on_stalled is not None:
                self.on_stalled(self._step, since)

    def watch(self) -> "Health":
        """``check`` on a daemon thread, often enough to tell a stall soon after the timeout."""
        every = max(0.05, min(30.0, self.stall_timeout_s / 4))

        def loop() -> None:
            while not self._stop.wait(every):
                try:
                    self.check()
                except Exception:  # noqa: BLE001 - telling must never take the watcher down
                    pass

        threading.Thread(target=loop, name="health-stall-watch", daemon=True).start()
        return self

    def close(self) -> None:
        self._stop.set()

    def finishing(self, step: int) -> None:
        self._phase = "finishing"
        self._finishing = f"making the checkpoint of step {step} durable on every tier"

    def exporting(self, step: int) -> None:
        self._phase = "finishing"
        self._finishing = f"exporting step {step} (the final checkpoint is durable)"

    def finished(self) -> None:
        self._phase = "ok finished"

    def starting(self) -> None:
        self._phase = "starting"

    def waiting(self, what: str) -> None:
        """Start-up waits, within its own bound, for ``what``: healthy meanwhile (see the module)."""
        self._phase = "ok waiting " + " ".join(what.split())[:200]

    def _degraded(self) -> str:
        try:
            return self.degraded() if self.degraded is not None else ""
        except Exception as e:  # noqa: BLE001 - the answer itself must not fail
            return f"unknown ({type(e).__name__})"

    def answer(self) -> str:
        if self._phase == "running":
            if self.stalled() is not None:
                return "stalled"
            why = self._degraded()
            return f"ok degraded: {why}" if why else "ok"
        if self._phase == "finishing":
            why = self._degraded()
            return f"ok finishing: {self._finishing}" + (f"; degraded: {why}" if why else "")
        if self._phase == "starting" and self.clock() - self._born < self.startup_grace_s:
            return "ok starting"
        return self._phase


class HealthServer:
    """A threaded TCP server answering ``request`` with the current :class:`Health` answer."""

    def __init__(self, health: Health, *, host: str, port: int, request: str = "spottrain-health",
                 log: logging.Logger | None = None):
        self.health = health
        expected = request.encode()
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                self.request.settimeout(5.0)
                data = b""
                try:
                    while len(data) < len(expected) and expected.startswith(data):
                        chunk = self.request.recv(len(expected) - len(data))
                        if not chunk:
                            break
                        data += chunk
                    answer = outer.health.answer() if data.strip() == expected else "unknown"
                    self.request.sendall(answer.encode() + b"\n")
                except OSError:
                    pass

        class Server(socketserver.ThreadingTCPServer):
            allow_reuse_address = True
            daemon_threads = True

        try:
            self._server = Server((host, port), Handler)
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
            raise PortInUse(
                f"health_port: port {port} on {host} is already in use{holder(port)}; another trainer may be "
                "running on this machine: give this run another port (--health-port, or 0 for any free "
                "port) or stop the other one") from None
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="health", daemon=True)
        (log or logging.getLogger("trainer.health")).info("event=health_listening host=%s port=%d", host, self.port)

    def start(self) -> "HealthServer":
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def ask(host: str, port: int, request: str = "spottrain-health", timeout: float = 5.0) -> str:
    """One health check, as the load balancer does it (for tests and `status`)."""
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.sendall(request.encode())
        return s.makefile().readline().strip()
