"""The fork server the suite's trainer launches come from (`python -m tests.trainer.zygote`; its
client is ``tests.trainer.support.Zygote``), and the ``subprocess.Popen`` face of a forked child.

Importing torch costs 1.6-1.9 s of CPU per process on this box, so one "zygote" a pytest process
imports torch and the trainer once and forks a child per trainer launch. Each child runs exactly
what ``python -m MODULE`` (or ``python FILE``) runs, through runpy, as ``__main__``, with the
launch's argv, environment, cwd and output, in its own session when the launch asks for one, and
exits as an interpreter exits (non-daemon threads joined, atexit run); tests signal and power it off
with real signals.

torchrun's agent (``-m torch.distributed.run``) is such a child, and its ranks are forked too: before
torchrun starts (while the agent has one thread), the agent forks a rank server of its own from
itself, and torchrun's ``SubprocessHandler`` asks it for each ``python -u -m MODULE`` (or
``python -u FILE.py``) rank. A rank is then what torchrun makes it, a process in a session of its
own that torchrun signals by its group, with torchrun's environment, without paying torch's import
(about 2.5 CPU-seconds a rank). A rank the server cannot reproduce (another program, output
redirected to files, an import-time setting of its own) is started fresh by torchrun as always.

What a fork cannot change, and so what a child's zygote must have been started with
(``support._zygote_key``; ``worker_zygote`` keeps one zygote per such environment): the variables
read when the interpreter or torch starts (``IMPORT_TIME_ENV``), and PYTHONPATH up to the zygote's
own entries (a child's further entries are put where a fresh interpreter puts them). trainer/ reads
no environment at import time. The zygote itself starts no thread (torch's intra-op pool and CUDA
start on first use, never here), so each child starts them as a fresh process would. Shared with the
zygote and so with every child: the hash seed (a fresh process draws its own).

Protocol: a JSON request a line on the server's input (``{"id", "module" | "script", "argv",
"env", "cwd", "new_session", "out", "err", "path_kept", "path_extra"}``), answered on its replies
with ``{"id", "pid"}`` once forked and ``{"exit": pid, "rc"}`` once reaped.
"""
from __future__ import annotations

import contextlib
import json
import os
import queue
import runpy
import select
import signal
import subprocess
import sys
import threading
from typing import IO, Any

#: What a zygote's child can run as ``python -m MODULE``: the trainer, the trainer held at a step
#: while a file exists (``tests/trainer/e2e/held.py``, for tests of any job), and torchrun's agent
#: (whose ranks are the first two, forked from the agent's own rank server).
LAUNCHERS = ("trainer", "tests.trainer.e2e.held", "torch.distributed.run")
TORCHRUN = "torch.distributed.run"

#: Environment variables read when the interpreter, torch or its libraries start: a child whose
#: value of one differs from the zygote's would not behave as a fresh `python -m trainer`.
IMPORT_TIME_ENV = ("PYTHON", "TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS", "CUDA", "NCCL",
                   "LD_", "MALLOC", "TRITON", "API_ENDPOINT_OVERRIDE")
#: What torchrun adds to a rank's environment under those prefixes, read when the rank's
#: distributed code runs, never at import: a rank that differs from its agent only in these is forked.
TORCHRUN_RUNTIME_ENV = ("TORCHELASTIC_", "TORCH_NCCL_ASYNC_ERROR_HANDLING")


def import_time(env: dict[str, str]) -> dict[str, str]:
    """What the interpreter or torch reads at start, but PYTHONPATH (a child extends it)."""
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV) and k != "PYTHONPATH"}


def path_entries(env: dict[str, str]) -> list[str]:
    return [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


class ForkedPopen:
    """The ``subprocess.Popen`` face of a zygote's child (pid, poll, wait, returncode, signals):
    its exit status comes from the zygote, which reaps it."""

    def __init__(self, pid: int, exits: "queue.Queue[int]") -> None:
        self.pid, self._exits = pid, exits
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            with contextlib.suppress(queue.Empty):
                self.returncode = self._exits.get_nowait()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            try:
                self.returncode = self._exits.get(timeout=timeout)
            except queue.Empty:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0) from None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Replies:
    """The client's side of the replies: each request's pid, and each child's exit status, in
    the order the server sent them (a reused pid's earlier process was reaped, so reported, before)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._exits: dict[int, "queue.Queue[int]"] = {}
        self._started: dict[int, "queue.Queue[tuple[int, queue.Queue[int]]]"] = {}
        self._n = 0

    def expect(self) -> tuple[int, "queue.Queue[tuple[int, queue.Queue[int]]]"]:
        """A new request's id, and where its pid will arrive."""
        with self._lock:
            self._n += 1
            started: "queue.Queue[tuple[int, queue.Queue[int]]]" = queue.Queue()
            self._started[self._n] = started
            return self._n, started

    def running(self) -> int:
        """Children forked and not yet reaped."""
        with self._lock:
            return len(self._exits)

    def read(self, lines: IO[str]) -> None:
        for line in lines:
            msg = json.loads(line)
            with self._lock:
                if "pid" in msg:
                    self._exits[msg["pid"]] = exits = queue.Queue()
                    self._started.pop(msg["id"]).put((msg["pid"], exits))
                else:
                    self._exits.pop(msg["exit"]).put(msg["rc"])


def child(cmd: dict[str, Any], close: tuple[int, ...]) -> None:
    """The forked child: become ``python -m MODULE`` / ``python FILE`` as the request says, run it,
    and exit as that interpreter would."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in close:
            os.close(fd)
        if cmd["new_session"]:
            os.setsid()
        fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(fd, 0)
        os.close(fd)
        if cmd["out"] is not None:  # else the output this server was given (a rank's: its agent's)
            out = os.open(cmd["out"], os.O_WRONLY)
            err = os.open(cmd["err"], os.O_WRONLY) if cmd["err"] else out
            os.dup2(out, 1)
            os.dup2(err, 2)
            for fd in {out, err}:
                os.close(fd)
        sys.stdin = sys.__stdin__ = open(0, closefd=False)
        sys.stdout = sys.__stdout__ = open(1, "w", buffering=1, closefd=False)
        sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")
        for f in (sys.stdout, sys.stderr):
            f.reconfigure(write_through=True)  # what PYTHONUNBUFFERED=1 (or `-u`) gives a fresh interpreter
        os.chdir(cmd["cwd"])
        os.environ.clear()
        os.environ.update(cmd["env"])
        import tempfile
        tempfile.tempdir = None  # gettempdir() reads TMPDIR again
        if "numpy" in sys.modules:  # a fresh process seeds numpy's global generator from the OS
            sys.modules["numpy"].random.seed()
        script = cmd.get("script")
        # What a fresh interpreter puts first: the script's folder (`python FILE`), the cwd (`-m`).
        sys.path[0] = os.path.dirname(os.path.abspath(script)) if script else os.getcwd()
        # PYTHONPATH's entries beyond the zygote's own (a job's code directory): where a fresh
        # interpreter puts them, after the zygote's PYTHONPATH entries (sys.path[1:1 + n]).
        sys.path[1 + cmd["path_kept"]:1 + cmd["path_kept"]] = cmd["path_extra"]
        if script:
            sys.argv = [script, *cmd["argv"]]
            runpy.run_path(script, run_name="__main__")
        else:
            sys.argv = ["-m", *cmd["argv"]]
            if cmd["module"] == TORCHRUN:
                fork_ranks()
            runpy.run_module(cmd["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code & 0xFF
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        import traceback
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:
        import traceback
        traceback.print_exc()
    try:
        import atexit
        threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's own exit: threads, then atexit
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        if code == -signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code)


def serve(requests: int, replies: IO[str], reap_at_end: bool = False) -> None:
    """Fork a child per request line read from fd ``requests`` until it closes; report each pid and
    each exit on ``replies``. ``reap_at_end``: then wait for the children still running, so that
    their CPU time is this process's, and its parent's once it reaps this one (the suite's ledger)."""
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *a: None)
    print(json.dumps({"ready": os.getpid()}), file=replies)
    pending = b""
    while True:
        ready, _, _ = select.select([requests, wake_r], [], [])
        if wake_r in ready:
            while True:
                try:
                    if not os.read(wake_r, 512):
                        break
                except BlockingIOError:
                    break
        if requests in ready:
            chunk = os.read(requests, 1 << 16)
            if not chunk:
                break
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                cmd = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    child(cmd, close=(wake_r, wake_w, replies.fileno(), *([requests] if requests else [])))
                print(json.dumps({"pid": pid, "id": cmd["id"]}), file=replies)
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            print(json.dumps({"exit": pid, "rc": os.waitstatus_to_exitcode(status)}), file=replies)
    while reap_at_end:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        with contextlib.suppress(BrokenPipeError):
            print(json.dumps({"exit": pid, "rc": os.waitstatus_to_exitcode(status)}), file=replies)


def fork_ranks() -> None:
    """In torchrun's agent, before torchrun runs: fork this process's rank server (it has one thread
    now, the modules every rank imports and the agent's path, which a rank's PYTHONPATH must equal)
    and have torchrun's SubprocessHandler fork each rank it can reproduce from it."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    req_r, req_w = os.pipe()
    rep_r, rep_w = os.pipe()
    server = os.fork()
    if server == 0:
        try:
            os.close(req_w)
            os.close(rep_r)
            os.setsid()  # a signal to the agent's group is the agent's to pass on, as torchrun does
            serve(req_r, os.fdopen(rep_w, "w", buffering=1), reap_at_end=True)
        finally:
            os._exit(0)
    os.close(req_r)
    os.close(rep_w)
    replies = Replies()
    lines = os.fdopen(rep_r)
    assert "ready" in json.loads(lines.readline())
    threading.Thread(target=replies.read, args=(lines,), daemon=True).start()
    requests = os.fdopen(req_w, "w", buffering=1)

    def stop() -> None:  # at the agent's exit: the server ends once its ranks have (torchrun has
        requests.close()  # stopped them by then); reap it, never waiting for ever on a stuck one
        for _ in range(600):
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(server, os.WNOHANG)[0] == 0:
                    threading.Event().wait(0.1)
                    continue
            return

    import atexit
    atexit.register(stop)
    def fixed_at_start(env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        """What a rank's fork cannot change: its PYTHONPATH, and its import-time settings but those
        torchrun adds for it."""
        return path_entries(env), {k: v for k, v in import_time(env).items() if not k.startswith(TORCHRUN_RUNTIME_ENV)}

    agent = fixed_at_start(dict(os.environ))
    fresh = subprocess_handler.SubprocessHandler._popen

    def popen(handler: Any, args: tuple[str, ...], env: dict[str, str]) -> Any:
        module = args[3] if len(args) > 3 and list(args[:3]) == [sys.executable, "-u", "-m"] else None
        script = args[2] if module is None and len(args) > 2 and list(args[:2]) == [sys.executable, "-u"] \
            and args[2].endswith(".py") else None  # a test's own worker script (`torchrun FILE.py`)
        forkable = ((module in LAUNCHERS and module != TORCHRUN or script is not None)
                    and handler._stdout is None and handler._stderr is None and fixed_at_start(env) == agent)
        if not forkable:
            return fresh(handler, args, env)
        n, started = replies.expect()
        requests.write(json.dumps({"id": n, "module": module, "script": script,
                                   "argv": list(args[3:] if script else args[4:]), "env": env, "cwd": os.getcwd(),
                                   "new_session": True, "out": None, "err": None,
                                   "path_kept": 0, "path_extra": []}) + "\n")
        requests.flush()
        pid, exits = started.get(timeout=60)
        return ForkedPopen(pid, exits)

    subprocess_handler.SubprocessHandler._popen = popen  # type: ignore[method-assign]


def main() -> None:
    import torch  # noqa: F401  (what every trainer process would import)
    import torch._dynamo  # noqa: F401  (every optimizer's first step imports it)

    import trainer.checkpoint.checkpointer  # noqa: F401
    import trainer.cli  # noqa: F401
    import trainer.tasks.gpt  # noqa: F401
    import trainer.train  # noqa: F401

    # What the imports made is shared with every child, copy on write: frozen, a child's collector
    # never walks it (a full collection would touch every page of it, costing CPU and copies).
    import gc
    gc.collect()
    gc.freeze()
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)  # nothing a child inherits can write into the replies
    os.close(null)
    serve(0, replies)


if __name__ == "__main__":
    main()
