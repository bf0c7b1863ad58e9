"""The systemd stand-in: PID 1 of a drill VM, supervising units for the `systemctl` stub.

systemd cannot run here, so this process plays the parts of it that the boot scripts rely on, with
systemd's semantics, and nothing more:

- boot: like `google_metadata_script_runner startup`, fetch `instance/attributes/startup-script`
  from the metadata server (or take a given file), run it under bash, and log every line to the
  journal and the serial console with a timestamp;
- units: `/etc/systemd/system/NAME.service` files and their drop-ins (`NAME.service.d/*.conf`),
  parsed for Type, ExecStartPre, ExecStart,
  Environment, EnvironmentFile, PassEnvironment, WorkingDirectory, KillSignal, KillMode,
  TimeoutStopSec, SuccessExitStatus, Restart (no/on-failure/always), RestartSec and
  RestartPreventExitStatus; each unit runs in its own process group (its "cgroup"), its output
  goes to the journal; the service environment is systemd's: PATH and LANG, plus Environment=,
  EnvironmentFile= and the manager variables named by PassEnvironment=;
- `systemctl` verbs over a unix socket: start, stop, restart, is-active, is-failed, show,
  status, daemon-reload, enable, disable, is-enabled, reset-failed;
- soft power-off (SIGTERM to this process, i.e. ACPI): run the shutdown script the same way,
  then stop every unit (KillSignal, TimeoutStopSec, then SIGKILL) and exit. Whatever outlives the
  window is the drill's to kill: killing PID 1 of a PID namespace kills everything in it.

Every state change is appended to an events file (JSON lines) that the host side waits on.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

UNIT_DIR = Path("/etc/systemd/system")
SOCKET = "/run/drill/systemd.sock"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: pids this process spawned itself (reaped by their Popen, never by the orphan reaper).
OWN_PIDS: set[int] = set()
# Exit by these signals counts as clean for systemd (besides status 0 and SuccessExitStatus).
CLEAN_SIGNALS = {signal.SIGHUP, signal.SIGINT, signal.SIGTERM, signal.SIGPIPE}


def stamp() -> str:
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e6):06d}Z"


class Journal:
    """The journal (a text file, and the same lines as journald's JSON records in another, for
    `journalctl --output=json`) and the serial console (another), all timestamped lines."""

    def __init__(self, journal: Path, serial: Path, events: Path, hostname: str,
                 records: Path | None = None, boot_id: str = "") -> None:
        self._lock = threading.Lock()
        self._journal = open(journal, "a", buffering=1, encoding="utf-8")
        self._serial = open(serial, "a", buffering=1, encoding="utf-8")
        self._events = open(events, "a", buffering=1, encoding="utf-8")
        self.hostname = hostname
        self.boot_id = boot_id.replace("-", "")
        # The records file outlives boots, as journald's persistent journal does: its sequence
        # numbers (the cursors) go on from the last one.
        self._seq = sum(1 for _ in open(records, encoding="utf-8")) if records and records.exists() else 0
        self._records = open(records, "a", buffering=1, encoding="utf-8") if records else None

    def log(self, ident: str, line: str, *, console: bool = False, fields: dict[str, str] | None = None) -> None:
        """One line. `ident` is how syslog shows its sender ("NAME[PID]", "NAME[PID]: PREFIX");
        `fields` are more journal fields (a unit's _SYSTEMD_UNIT, its invocation id)."""
        now = time.time()
        text = f"{stamp()} {self.hostname} {ident}: {line.rstrip()}\n"
        with self._lock:
            self._journal.write(text)
            if console:
                self._serial.write(text)
            if self._records is not None:
                self._seq += 1
                m = re.fullmatch(r"([^\[:]+)(?:\[(\d+)\])?(?:: (.*))?", ident)
                name, pid, prefix = (m.group(1), m.group(2), m.group(3)) if m else (ident, None, None)
                record = {"__CURSOR": f"s=drill;i={self._seq:x};b={self.boot_id}",
                          "__REALTIME_TIMESTAMP": str(int(now * 1e6)), "_BOOT_ID": self.boot_id,
                          "_HOSTNAME": self.hostname, "PRIORITY": "6", "SYSLOG_IDENTIFIER": name,
                          "MESSAGE": f"{prefix}: {line.rstrip()}" if prefix else line.rstrip(),
                          **({"_PID": pid} if pid else {}), **(fields or {})}
                self._records.write(json.dumps(record) + "\n")

    def event(self, name: str, **fields: Any) -> None:
        with self._lock:
            self._events.write(json.dumps({"t": time.time(), "event": name, **fields}) + "\n")
            self._events.flush()
            os.fsync(self._events.fileno())

    def pump(self, stream: IO[bytes], ident: str, *, console: bool = False,
             fields: dict[str, str] | None = None) -> threading.Thread:
        """Copy a child's output into the journal line by line, in a thread."""
        def run() -> None:
            for raw in iter(stream.readline, b""):
                self.log(ident, raw.decode("utf-8", "replace"), console=console, fields=fields)
            stream.close()
        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t


# --- unit files ----------------------------------------------------------------------------
@dataclass
class Unit:
    name: str
    type: str = "simple"
    exec_start_pre: list[str] = field(default_factory=list)
    exec_start: str = ""
    environment: dict[str, str] = field(default_factory=dict)
    environment_files: list[str] = field(default_factory=list)
    pass_environment: list[str] = field(default_factory=list)
    working_directory: str | None = None
    kill_signal: int = signal.SIGTERM
    kill_mode: str = "control-group"
    timeout_stop_s: float = 90.0
    success_exit_status: set[int] = field(default_factory=set)
    restart: str = "no"
    restart_s: float = 0.1
    restart_prevent: set[int] = field(default_factory=set)
    ignored: list[str] = field(default_factory=list)   # keys this stand-in does not honour


def _seconds(value: str) -> float:
    value = value.strip()
    if value in ("infinity", "0"):
        return float("inf") if value == "infinity" else 0.0
    total, num = 0.0, ""
    units = {"ms": 0.001, "s": 1, "sec": 1, "min": 60, "m": 60, "h": 3600}
    for part in value.split():
        for suffix in sorted(units, key=len, reverse=True):
            if part.endswith(suffix) and part[: -len(suffix)].replace(".", "").isdigit():
                total += float(part[: -len(suffix)]) * units[suffix]
                break
        else:
            num = part
            total += float(num)
    return total


def _signal(value: str) -> int:
    value = value.strip().upper()
    return int(value) if value.isdigit() else int(getattr(signal, value if value.startswith("SIG") else "SIG" + value))


def _exit_statuses(value: str) -> set[int]:
    out = set()
    for word in value.split():
        if word.isdigit():
            out.add(int(word))
        else:  # a signal name: systemd allows those too
            out.add(-_signal(word))
    return out


def parse_unit(path: Path) -> Unit:
    """The unit file, then its drop-ins (`NAME.service.d/*.conf`, in name order) as systemd
    reads them: a later assignment of a setting overrides an earlier one."""
    unit = Unit(name=path.name)
    drop_ins = sorted(path.with_name(path.name + ".d").glob("*.conf"))
    text = "\n".join(p.read_text() for p in [path, *drop_ins]).replace("\\\n", " ")
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, _, value = line.partition("=")
        key, value = key.strip(), value.strip()
        if section != "Service":
            continue
        if key == "Type":
            unit.type = value
        elif key == "ExecStartPre":
            if value:
                unit.exec_start_pre.append(value)
            else:
                unit.exec_start_pre.clear()
        elif key == "ExecStart":
            unit.exec_start = value
        elif key == "Environment":
            for word in shlex.split(value):
                k, _, v = word.partition("=")
                unit.environment[k] = v
        elif key == "EnvironmentFile":
            unit.environment_files.append(value)
        elif key == "PassEnvironment":
            unit.pass_environment.extend(value.split())
        elif key == "WorkingDirectory":
            unit.working_directory = value
        elif key == "KillSignal":
            unit.kill_signal = _signal(value)
        elif key == "KillMode":
            unit.kill_mode = value
        elif key in ("TimeoutStopSec", "TimeoutSec"):
            unit.timeout_stop_s = _seconds(value)
        elif key == "SuccessExitStatus":
            unit.success_exit_status |= _exit_statuses(value)
        elif key == "Restart":
            unit.restart = value
        elif key == "RestartSec":
            unit.restart_s = _seconds(value)
        elif key == "RestartPreventExitStatus":
            unit.restart_prevent |= _exit_statuses(value)
        else:
            unit.ignored.append(key)
    if not unit.exec_start:
        raise ValueError(f"{path}: no ExecStart=")
    return unit


def _expand(word: str, env: dict[str, str]) -> str:
    """systemd's `${VAR}` / `$VAR` expansion of ExecStart words from the unit's environment."""
    import re
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: env.get(m.group(1) or m.group(2), ""), word)


def _read_env_file(spec: str) -> dict[str, str]:
    optional = spec.startswith("-")
    path = Path(spec.lstrip("-"))
    if not path.exists():
        if optional:
            return {}
        raise FileNotFoundError(f"EnvironmentFile {path} not found")
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";")) and "=" in line:
            k, _, v = line.partition("=")
            words = shlex.split(v) if v.strip() else [""]
            out[k.strip()] = " ".join(words)
    return out


# --- services ------------------------------------------------------------------------------
class Service:
    """One loaded unit and its state machine (inactive -> activating -> active -> deactivating)."""

    def __init__(self, manager: "Manager", unit: Unit) -> None:
        self.m = manager
        self.unit = unit
        self.state = "inactive"          # ActiveState
        self.result = "success"
        self.main: subprocess.Popen[bytes] | None = None
        self.exec_main_status = 0
        self.exec_main_code = "exited"
        self.n_restarts = 0
        self.invocation = ""   # this start's INVOCATION_ID (systemd: one per start of the unit)
        self.enabled = False
        self._stopping = False
        self._restart_timer: threading.Timer | None = None
        self._cond = threading.Condition()

    def about(self) -> dict[str, str]:
        """The journal fields of systemd's own lines about this unit."""
        return {"UNIT": self.unit.name, "INVOCATION_ID": self.invocation, "SYSLOG_FACILITY": "3"}

    def own(self) -> dict[str, str]:
        """The journal fields of the unit's output (journald's trusted fields of its cgroup)."""
        return {"_SYSTEMD_UNIT": self.unit.name, "_SYSTEMD_INVOCATION_ID": self.invocation,
                "_TRANSPORT": "stdout"}

    # Processes of the unit share one process group: our stand-in for its cgroup.
    def _spawn(self, command: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
        argv = [_expand(word, env) for word in shlex.split(command)]
        proc = subprocess.Popen(argv, env=env, cwd=self.unit.working_directory or "/",
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        OWN_PIDS.add(proc.pid)
        return proc

    def _env(self) -> dict[str, str]:
        env = {"PATH": DEFAULT_PATH, "LANG": "C.UTF-8", "HOME": "/root", "USER": "root",
               "INVOCATION_ID": self.invocation}
        env.update(self.m.default_environment)
        for name in self.unit.pass_environment:
            if name in self.m.manager_env:
                env[name] = self.m.manager_env[name]
        env.update(self.unit.environment)
        for spec in self.unit.environment_files:
            env.update(_read_env_file(spec))
        return env

    def start(self) -> tuple[int, str]:
        with self._cond:
            if self.state in ("active", "activating", "reloading"):
                return 0, ""     # systemd: starting a running unit is a no-op
            if self._restart_timer is not None:
                self._restart_timer.cancel()
                self._restart_timer = None
            self.state, self._stopping = "activating", False
            self.invocation = os.urandom(16).hex()
        self.m.journal.event("unit-starting", unit=self.unit.name)
        self.m.journal.log("systemd[1]", fields=self.about(), line=f"Starting {self.unit.name}...")
        try:
            env = self._env()
            for pre in self.unit.exec_start_pre:
                ignore = pre.startswith("-")
                proc = self._spawn(pre.lstrip("-@+!"), env)
                assert proc.stdout is not None
                self.m.journal.pump(proc.stdout, f"{self.unit.name.removesuffix('.service')}[{proc.pid}]",
                                    fields=self.own()).join()
                rc = proc.wait()
                if rc != 0 and not ignore:
                    self.m.journal.log("systemd[1]", fields=self.about(), line=f"{self.unit.name}: Control process exited, code=exited, status={rc}/FAILURE")
                    self._exited(rc, "exited", during_start=True)
                    return 1, f"Job for {self.unit.name} failed because the control process exited with error code."
            self.main = self._spawn(self.unit.exec_start.lstrip("-@+!"), env)
        except (OSError, ValueError) as e:
            self.m.journal.log("systemd[1]", fields=self.about(), line=f"{self.unit.name}: Failed to execute: {e}")
            self._exited(203, "exited", during_start=True)
            return 1, f"Job for {self.unit.name} failed: {e}"
        main = self.main
        with self._cond:
            self.state = "active"
        self.m.journal.event("unit-started", unit=self.unit.name, pid=main.pid)
        self.m.journal.log("systemd[1]", fields=self.about(), line=f"Started {self.unit.name}.")
        assert main.stdout is not None
        pump = self.m.journal.pump(main.stdout, f"{self.unit.name.removesuffix('.service')}[{main.pid}]",
                                   fields=self.own())
        threading.Thread(target=self._supervise, args=(main, pump), daemon=True).start()
        if self.unit.type == "oneshot":
            self.wait_inactive(float("inf"))
            return (0, "") if self.result == "success" else (1, f"Job for {self.unit.name} failed.")
        return 0, ""

    def _supervise(self, main: subprocess.Popen[bytes], pump: threading.Thread) -> None:
        rc = main.wait()
        if self.unit.kill_mode in ("mixed", "control-group"):
            # The main process is gone: systemd SIGKILLs what is left of the cgroup.
            try:
                os.killpg(main.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        pump.join(timeout=5)
        code, status = ("killed", -rc) if rc < 0 else ("exited", rc)
        self._exited(status if code == "exited" else -status, code)

    def _clean(self, status: int, code: str) -> bool:
        if code == "exited":
            return status == 0 or status in self.unit.success_exit_status
        sig = -status
        return sig in CLEAN_SIGNALS or -sig in self.unit.success_exit_status

    def _exited(self, status: int, code: str, during_start: bool = False) -> None:
        """`status` is the exit status, or minus the signal number when `code` is killed."""
        shown = status if code == "exited" else signal.Signals(-status).name
        clean = self._clean(status, code)
        # As systemd does: the exit is in the journal before the unit leaves "active" (a reader
        # that sees the unit inactive finds the line there).
        self.m.journal.log("systemd[1]", fields=self.about(), line=f"{self.unit.name}: Main process exited, code={code}, status={shown}")
        with self._cond:
            self.exec_main_status = status if code == "exited" else -status
            self.exec_main_code = code
            stopping = self._stopping
            self.result = "success" if clean or stopping else ("exit-code" if code == "exited" else "signal")
            restart = (not stopping and not self.m.shutting_down
                       and (self.unit.restart == "always" or (self.unit.restart == "on-failure" and not clean))
                       and status not in self.unit.restart_prevent)
            self.state = "activating" if restart else ("failed" if self.result != "success" else "inactive")
            self.main = None
            self._cond.notify_all()
        self.m.journal.event("unit-exited", unit=self.unit.name, code=code, status=status, clean=clean,
                             restarting=restart, stopping=stopping)
        if restart:
            self.m.journal.log("systemd[1]", fields=self.about(), line=f"{self.unit.name}: Scheduled restart in {self.unit.restart_s:g}s.")
            timer = threading.Timer(self.unit.restart_s, self._restart)
            timer.daemon = True
            with self._cond:
                self._restart_timer = timer
            timer.start()

    def _restart(self) -> None:
        with self._cond:
            if self._restart_timer is None or self._stopping or self.m.shutting_down:
                return
            self._restart_timer = None
            self.state = "inactive"
            self.n_restarts += 1
        self.start()

    def stop(self) -> tuple[int, str]:
        with self._cond:
            if self._restart_timer is not None:
                self._restart_timer.cancel()
                self._restart_timer = None
                self.state = "inactive"
            main = self.main
            if main is None:
                if self.state == "activating":
                    self.state = "inactive"
                return 0, ""
            # systemd merges a stop into the stop job already running: no second signal.
            joining = self.state == "deactivating"
            self._stopping = True
            self.state = "deactivating"
        if joining:  # the first stop's own timeout (then SIGKILL) bounds this wait
            self.wait_inactive(float("inf"))
            return 0, ""
        self.m.journal.log("systemd[1]", fields=self.about(), line=f"Stopping {self.unit.name}...")
        self.m.journal.event("unit-stopping", unit=self.unit.name, pid=main.pid)
        try:
            if self.unit.kill_mode == "control-group":
                os.killpg(main.pid, self.unit.kill_signal)
            else:
                os.kill(main.pid, self.unit.kill_signal)
        except ProcessLookupError:
            pass
        if not self.wait_inactive(self.unit.timeout_stop_s):
            self.m.journal.log("systemd[1]", fields=self.about(), line=f"{self.unit.name}: State 'stop-sigterm' timed out. Killing.")
            self.m.journal.event("unit-stop-timeout", unit=self.unit.name)
            try:
                os.killpg(main.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.wait_inactive(float("inf"))
        self.m.journal.log("systemd[1]", fields=self.about(), line=f"Stopped {self.unit.name}.")
        return 0, ""

    def wait_inactive(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.main is not None or self.state in ("activating", "deactivating") and self._restart_timer is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 3600))
        return True

    def show(self) -> dict[str, str]:
        main = self.main
        return {
            "Id": self.unit.name, "ActiveState": self.state,
            "SubState": {"active": "running", "inactive": "dead", "failed": "failed",
                         "activating": "auto-restart" if self._restart_timer else "start",
                         "deactivating": "stop-sigterm"}.get(self.state, self.state),
            "Result": self.result, "MainPID": str(main.pid if main else 0),
            "ExecMainStatus": str(self.exec_main_status), "ExecMainCode": self.exec_main_code,
            "NRestarts": str(self.n_restarts), "Type": self.unit.type,
            "UnitFileState": "enabled" if self.enabled else "disabled",
            "TimeoutStopUSec": str(int(self.unit.timeout_stop_s * 1e6)) if self.unit.timeout_stop_s != float("inf") else "infinity",
        }


class Manager:
    def __init__(self, journal: Journal, manager_env: dict[str, str],
                 default_environment: dict[str, str] | None = None) -> None:
        self.journal = journal
        self.manager_env = manager_env
        # system.conf's DefaultEnvironment=: given to every unit (the VM image's configuration).
        self.default_environment = dict(default_environment or {})
        self.services: dict[str, Service] = {}
        self.shutting_down = False
        self._lock = threading.Lock()

    def load(self, name: str) -> Service | None:
        name = name if "." in name else name + ".service"
        with self._lock:
            path = UNIT_DIR / name
            if name not in self.services:
                if not path.exists():
                    return None
                unit = parse_unit(path)
                if unit.ignored:
                    self.journal.log("systemd[1]", f"{name}: drill stand-in ignores {', '.join(unit.ignored)}")
                self.services[name] = Service(self, unit)
            return self.services[name]

    def daemon_reload(self) -> None:
        with self._lock:
            for name, svc in self.services.items():
                path = UNIT_DIR / name
                if path.exists():
                    svc.unit = parse_unit(path)
        self.journal.log("systemd[1]", "Reloading finished.")

    def systemctl(self, argv: list[str]) -> tuple[int, str, str]:
        """One `systemctl` invocation: (exit status, stdout, stderr)."""
        opts = [a for a in argv if a.startswith("-")]
        words = [a for a in argv if not a.startswith("-")]
        props: list[str] = []
        for i, a in enumerate(argv):
            if a.startswith("--property="):
                props += a.split("=", 1)[1].split(",")
            elif a in ("-p", "--property") and i + 1 < len(argv):
                props += argv[i + 1].split(",")
                if argv[i + 1] in words:
                    words.remove(argv[i + 1])
        quiet = "-q" in opts or "--quiet" in opts
        if not words:
            return 1, "", "systemctl (drill stand-in): a verb is required\n"
        verb, names = words[0], words[1:]
        if verb == "daemon-reload":
            self.daemon_reload()
            return 0, "", ""
        services = []
        for n in names:
            svc = self.load(n)
            if svc is None and verb not in ("is-active", "is-failed", "is-enabled", "stop", "show"):
                return 5, "", f"Failed to {verb} {n}: Unit {n} not found.\n"
            services.append((n, svc))
        out, rc = [], 0
        for n, svc in services:
            if verb == "start":
                r, err = svc.start()
                if r:
                    return r, "", err + "\n"
            elif verb == "stop":
                if svc is not None:
                    svc.stop()
            elif verb == "restart":
                svc.stop()
                r, err = svc.start()
                if r:
                    return r, "", err + "\n"
            elif verb in ("is-active", "is-failed"):
                state = svc.state if svc else "inactive"
                out.append(state)
                ok = state in ("active", "reloading") if verb == "is-active" else state == "failed"
                rc = rc if ok else 3
            elif verb in ("enable", "disable"):
                svc.enabled = verb == "enable"
            elif verb == "is-enabled":
                out.append("enabled" if svc and svc.enabled else "disabled")
                rc = rc if svc and svc.enabled else 1
            elif verb == "reset-failed":
                if svc.state == "failed":
                    svc.state = "inactive"
            elif verb == "show":
                values = svc.show() if svc else {"Id": n, "ActiveState": "inactive", "LoadState": "not-found"}
                for p in props or sorted(values):
                    v = values.get(p, "")
                    out.append(v if "--value" in opts else f"{p}={v}")
            elif verb == "status":
                v = svc.show()
                out.append(f"● {n} - {v['ActiveState']} ({v['SubState']}) main pid {v['MainPID']}, "
                           f"last exit {v['ExecMainCode']}/{v['ExecMainStatus']}")
                rc = 0 if v["ActiveState"] == "active" else 3
            else:
                return 1, "", f"systemctl (drill stand-in): verb {verb!r} is not supported\n"
        return rc, "" if quiet else "".join(line + "\n" for line in out), ""

    def serve(self, path: str) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(path)
        srv.listen(16)

        def handle(conn: socket.socket) -> None:
            with conn:
                data = b""
                while not data.endswith(b"\n"):
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                try:
                    rc, out, err = self.systemctl(json.loads(data)["argv"])
                except Exception as e:  # a stand-in bug must surface in the caller, not hang it
                    rc, out, err = 1, "", f"systemctl (drill stand-in) error: {e!r}\n"
                conn.sendall(json.dumps({"rc": rc, "stdout": out, "stderr": err}).encode() + b"\n")

        def loop() -> None:
            while True:
                conn, _ = srv.accept()
                threading.Thread(target=handle, args=(conn,), daemon=True).start()

        threading.Thread(target=loop, daemon=True).start()

    def stop_all(self) -> None:
        threads = [threading.Thread(target=s.stop) for s in list(self.services.values())]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


# --- metadata scripts ----------------------------------------------------------------------
def fetch_script(key: str, metadata_host: str) -> str | None:
    req = urllib.request.Request(f"http://{metadata_host}/computeMetadata/v1/instance/attributes/{key}",
                                 headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.read().decode()
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        raise


def run_script(journal: Journal, kind: str, script: str | None, env: dict[str, str], workdir: Path) -> int | None:
    """Run a metadata script under bash as google_metadata_script_runner does; its exit status."""
    ident = "google_metadata_script_runner"
    if script is None:
        journal.log(ident, f"No {kind} scripts to run.", console=True)
        return None
    path = workdir / f"{kind}-{time.monotonic_ns()}.sh"
    path.write_text(script)
    journal.log(ident, f"Starting {kind} scripts.", console=True)
    journal.event(f"{kind}-started")
    proc = subprocess.Popen(["/bin/bash", str(path)], env=env, cwd="/", stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    OWN_PIDS.add(proc.pid)
    assert proc.stdout is not None
    journal.pump(proc.stdout, f"{ident}[{proc.pid}]: {kind}", console=True).join()
    rc = proc.wait()
    journal.log(ident, f"{kind} exit status {rc}", console=True)
    journal.log(ident, f"Finished running {kind} scripts.", console=True)
    journal.event(f"{kind}-exited", rc=rc)
    return rc


def main(argv: list[str]) -> int:
    """`python -m drill.service_manager CONFIG.json`, as PID 1 inside the sandbox's namespaces."""
    from drill.sandbox import SandboxConfig, enter

    cfg = SandboxConfig.model_validate_json(Path(argv[0]).read_text())
    enter(cfg)   # the VM's mounts, from inside the new mount namespace
    state = Path(cfg.state_dir)
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    journal = Journal(state / "journal.log", state / "serial.log", state / "events.jsonl", cfg.hostname,
                      records=state / "journal.jsonl", boot_id=boot_id)
    env = dict(cfg.env)
    manager = Manager(journal, env, cfg.default_environment)
    manager.serve(SOCKET)
    power_off = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: power_off.set())
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    # As PID 1, reap orphans (reparented to us when their parent died), never our own
    # subprocesses: their Popen must see their real exit status.
    def reap() -> None:
        while not power_off.is_set():
            for pid in _zombies():
                if pid not in OWN_PIDS:
                    try:
                        os.waitpid(pid, os.WNOHANG)
                    except ChildProcessError:
                        pass
            power_off.wait(1.0)
    threading.Thread(target=reap, daemon=True).start()
    journal.event("boot")
    journal.log("kernel", "drill VM booted", console=True)
    scripts_dir = Path("/run/drill")

    def script(kind: str) -> str | None:
        given = getattr(cfg, f"{kind.replace('-', '_')}_file")
        if given:
            return Path(given).read_text()
        return fetch_script(kind, cfg.env["GCE_METADATA_HOST"]) if "GCE_METADATA_HOST" in cfg.env else None

    def boot() -> None:
        try:
            run_script(journal, "startup-script", script("startup-script"), env, scripts_dir)
        except Exception as e:
            journal.log("google_metadata_script_runner", f"startup-script failed to run: {e!r}", console=True)
            journal.event("startup-script-exited", rc=-1)
        if cfg.exit_after_startup:
            power_off.set()

    threading.Thread(target=boot, daemon=True).start()
    power_off.wait()
    manager.shutting_down = True
    journal.event("power-off-requested")
    journal.log("systemd-logind", "Power key pressed short.", console=True)
    if not cfg.exit_after_startup:
        try:
            run_script(journal, "shutdown-script", script("shutdown-script"), env, scripts_dir)
        except Exception as e:
            journal.log("google_metadata_script_runner", f"shutdown-script failed to run: {e!r}", console=True)
    manager.stop_all()
    journal.event("powered-off")
    journal.log("kernel", "reboot: Power down", console=True)
    return 0


def _zombies() -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if fields[0] == "Z" and int(fields[1]) == os.getpid():
                    out.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
