"""Shared helpers for the trainer tests: a real trainer subprocess that is read line by line, and
a fork server for the many restarts. The fake GCE metadata server is the drill's
(``drill.metadata_server.MetadataServer``); free ports come from ``drill.net``."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import weakref
from pathlib import Path
from typing import Any

import pytest

# The attacker of the bucket (who can write it but does not hold the run's checkpoint key), shared
# with `make chaos`.
from drill.attacker import bucket_names, code_running_pickle, forge, forge_in_bucket  # noqa: F401
from drill.net import free_port
from drill.procs import power_off
from drill.tiny_gpt import MULTI_RANK_TASK_ARGS_TOML, TASK_ARGS_TOML

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 240.0  # a failure guard only: this box is small and shared
REFERENCE_STEPS = 40  # steps of the uninterrupted reference run (e2e conftest)

# Tiny model and short logging interval: every step logs a line the tests synchronise on.
TEST_CONFIG = """\
log_every_steps = 1
batch_size = 4
progress_every_s = 0.5
""" + TASK_ARGS_TOML


def run_key() -> Any:
    """The suite's checkpoint key (tests/conftest.py), as a ``trainer.checkpoint.key.CheckpointKey``."""
    from trainer.checkpoint.key import ENV, load

    return load(Path(os.environ[ENV]))


@dataclasses.dataclass(frozen=True)
class Policy:
    """One tier's cadence and retention, as the checkpoint tests write them."""

    every_steps: int | None = None
    every_seconds: float | None = None
    keep: int = 3


def checkpointer(*, run_dir: Path, local_dir: Path | None = None, gcs_uri: str | None = None, gcs_client: Any = None,
                 policies: dict[str, Policy] | None = None, layout: Any = None, **kw: Any) -> Any:
    """A ``Checkpointer`` over the tier table of these places (``trainer.checkpoint.tiers.tier_table``)."""
    from trainer.checkpoint.checkpointer import Checkpointer
    from trainer.checkpoint.tiers import Cadence, tier_table

    policies = policies or {}
    table = tier_table(run_dir, local_dir=local_dir, gcs_uri=gcs_uri, gcs_client=gcs_client,
                       cadence={k: Cadence(p.every_steps, p.every_seconds) for k, p in policies.items()},
                       keep={k: p.keep for k, p in policies.items()})
    return Checkpointer(table, layout, **kw)


def closed_metadata_host() -> str:
    """A loopback address nothing listens on: the watcher's 'off GCE' case, without DNS."""
    return f"127.0.0.1:{free_port()}"


def write_config(dir: Path, extra: str = "", *, multi_rank: bool = False) -> Path:
    """The suite's trainer config in ``dir`` with ``extra`` settings; ``multi_rank``: the model of
    hundreds of tensors every multi-rank test trains (``drill.tiny_gpt``)."""
    path = dir / "trainer.toml"
    config = TEST_CONFIG.replace(TASK_ARGS_TOML, MULTI_RANK_TASK_ARGS_TOML) if multi_rank else TEST_CONFIG
    head, _, tail = config.partition("[task_args]")
    path.write_text(head + extra + "\n[task_args]" + tail)
    return path


def trainer_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    env.setdefault("GCE_METADATA_HOST", closed_metadata_host())
    env.update(extra)
    return env


class Proc:
    """A subprocess whose merged stdout/stderr is read line by line by a thread."""

    #: Every Proc a test started, for `power_off_leftovers`.
    started: "weakref.WeakSet[Proc]" = weakref.WeakSet()

    def __init__(self, argv: list[str], env: dict[str, str] | None = None, new_session: bool = False):
        self.argv = argv
        self.p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                  env=env or trainer_env(), cwd=REPO, start_new_session=new_session)
        Proc.started.add(self)
        self.lines: list[str] = []
        self._q: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.lines.append(line.rstrip("\n"))
            self._q.put(line.rstrip("\n"))
        self._q.put(None)

    def wait_for(self, pattern: str, timeout: float = TIMEOUT) -> re.Match[str]:
        """Block until an output line matches ``pattern``; fail if the process ends first."""
        rx = re.compile(pattern)
        while True:
            try:
                line = self._q.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"no line matching {pattern!r} within {timeout}s:\n{self.output[-3000:]}")
            if line is None:
                self._q.put(None)
                raise AssertionError(f"process ended (rc={self.wait()}) before {pattern!r}:\n{self.output[-3000:]}")
            m = rx.search(line)
            if m:
                return m

    def seen(self, pattern: str) -> re.Match[str]:
        """A line already read that matches ``pattern`` (for lines that precede a waited-for one)."""
        for line in list(self.lines):
            m = re.search(pattern, line)
            if m:
                return m
        raise AssertionError(f"no line matching {pattern!r} so far:\n{self.output[-3000:]}")

    def seen_or_wait(self, pattern: str, timeout: float = TIMEOUT) -> re.Match[str]:
        """A line matching ``pattern``, already read or still to come (a background thread's line
        may land on either side of the line last waited for)."""
        try:
            return self.seen(pattern)
        except AssertionError:
            return self.wait_for(pattern, timeout)

    def signal(self, sig: int, group: bool = False) -> None:
        if group:
            os.killpg(self.p.pid, sig)
        else:
            self.p.send_signal(sig)

    def power_off(self) -> None:
        """SIGKILL the process and every descendant at once: a VM losing power. (torchrun starts
        its workers in sessions of their own, so killing the agent's group would spare them.)"""
        power_off(self.p.pid)

    def wait(self, timeout: float = TIMEOUT) -> int:
        rc = self.p.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return rc

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def kill(self) -> None:
        """Clean-up: the process and whatever it started (torchrun's workers outlive their agent)."""
        if self.p.poll() is None:
            self.power_off()
            self.p.wait()


#: The environment variable a rank of ``run_ranks`` finds the test's TCPStore port in.
RANKS_STORE_PORT = "SPOTTRAIN_TEST_STORE_PORT"


def run_ranks(argv: list[str], nproc: int, env: dict[str, str] | None = None, timeout: float = TIMEOUT) -> list[str]:
    """Run ``nproc`` real ranks of ``argv`` (a worker script that calls ``join_ranks``) with
    torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE), joined through a TCPStore that this
    process hosts (port 0: no race for a free port): what torchrun does, without its agent's
    start-up cost. Every rank must exit 0; their outputs, by rank."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world_size=nproc + 1, is_master=True, wait_for_workers=False)
    base = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc), **{RANKS_STORE_PORT: str(store.port)}, **(env or {}))
    procs = [subprocess.Popen(argv, env=dict(base, RANK=str(r), LOCAL_RANK=str(r)), cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(nproc)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    codes = [p.returncode for p in procs]
    assert codes == [0] * nproc, f"{argv[1:]} on {nproc} ranks exited {codes}:\n" + "\n".join(outputs)
    return outputs


def join_ranks() -> tuple[int, int]:
    """A rank of ``run_ranks`` joins the gloo process group: (rank, world size)."""
    import torch.distributed as dist

    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore("127.0.0.1", int(os.environ[RANKS_STORE_PORT]), is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size)
    return rank, size


def run_args(run_dir: Path, steps: int, config: Path, *extra: str, seed: int = 0) -> list[str]:
    return [sys.executable, "-m", "trainer", "run", "--run-dir", str(run_dir), "--steps", str(steps),
            "--seed", str(seed), "--health-port", "0", "--config", str(config), *extra]


def start(run_dir: Path, steps: int, config: Path, *extra: str, env: dict[str, str] | None = None) -> Proc:
    return Proc(run_args(run_dir, steps, config, *extra), env=env)


def run_to_end(run_dir: Path, steps: int, config: Path, *extra: str, env: dict[str, str] | None = None) -> Proc:
    p = start(run_dir, steps, config, *extra, env=env)
    rc = p.wait()
    assert rc == 0, p.output[-4000:]
    return p


def status(run_dir: Path, *extra: str, env: dict[str, str] | None = None, cli: bool = False) -> dict[str, Any]:
    """`python -m trainer status --json` (in this process unless ``cli``: torch is loaded here)."""
    if not cli:
        from trainer.config import StatusConfig
        from trainer.status import collect

        opt = dict(zip(extra[::2], extra[1::2]))
        cfg = StatusConfig(run_dir=run_dir, gcs_uri=opt.get("--gcs-uri"), local_dir=opt.get("--local-dir"))
        return json.loads(json.dumps(collect(cfg), default=str))
    out = subprocess.run([sys.executable, "-m", "trainer", "status", "--run-dir", str(run_dir), "--json", *extra],
                         capture_output=True, text=True, env=env or trainer_env(), cwd=REPO, timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


# --------------------------------------------------------------------------------------------
# A fork server for the many SIGKILL restarts: importing torch costs seconds per process on this
# box, so one "zygote" imports the trainer once and forks a fresh process per restart. Each child
# runs exactly what `python -m trainer` runs (trainer.cli.main) and is killed with real signals.
# --------------------------------------------------------------------------------------------

ZYGOTE_SRC = r"""
import json, os, select, sys
import torch, torch._dynamo  # noqa: F401  (what every trainer process would import)
import trainer.cli, trainer.train, trainer.checkpoint.checkpointer, trainer.tasks.gpt  # noqa: F401
out = os.fdopen(os.dup(1), "w", buffering=1)
children = set()
print(json.dumps({"ready": os.getpid()}), file=out)
while True:
    r, _, _ = select.select([sys.stdin], [], [], 0.02)
    if r:
        line = sys.stdin.readline()
        if not line:
            break
        cmd = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                fd = os.open(cmd["fifo"], os.O_WRONLY)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                sys.stdout = open(1, "w", buffering=1, closefd=False)
                sys.stderr = open(2, "w", buffering=1, closefd=False)
                os.environ.clear()
                os.environ.update(cmd["env"])
                sys.argv = ["trainer", *cmd["argv"]]
                code = trainer.cli.main(cmd["argv"])
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except BaseException:
                import traceback
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        children.add(pid)
        print(json.dumps({"pid": pid, "id": cmd["id"]}), file=out)
    for pid in list(children):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            children.discard(pid)
            print(json.dumps({"exit": pid, "rc": os.waitstatus_to_exitcode(status)}), file=out)
"""


class Zygote:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        env = trainer_env()
        self.p = subprocess.Popen([sys.executable, "-c", ZYGOTE_SRC], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, bufsize=1, env=env, cwd=REPO)
        self._lock = threading.Lock()
        self._pids: dict[int, "queue.Queue[int]"] = {}
        self._started: dict[int, "queue.Queue[int]"] = {}
        self._n = 0
        assert self.p.stdout is not None
        first = json.loads(self.p.stdout.readline())
        assert "ready" in first, first
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            msg = json.loads(line)
            with self._lock:
                if "pid" in msg:
                    self._pids[msg["pid"]] = queue.Queue()
                    self._started[msg["id"]].put(msg["pid"])
                else:
                    self._pids[msg["exit"]].put(msg["rc"])

    def spawn(self, argv: list[str], env: dict[str, str]) -> "ForkedProc":
        with self._lock:
            self._n += 1
            n = self._n
            self._started[n] = queue.Queue()
        fifo = self.tmp / f"out-{n}.fifo"
        os.mkfifo(fifo)
        proc = ForkedProc(self, fifo)
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps({"argv": argv, "env": env, "fifo": str(fifo), "id": n}) + "\n")
        self.p.stdin.flush()
        proc.pid = self._started[n].get(timeout=TIMEOUT)
        return proc

    def exit_queue(self, pid: int) -> "queue.Queue[int]":
        with self._lock:
            return self._pids[pid]

    def close(self) -> None:
        if self.p.stdin is not None:
            self.p.stdin.close()
        self.p.wait(timeout=60)


def power_off_leftovers() -> list[int]:
    """Power off every Proc still running (and its descendants), the pids: a test that failed
    before its end would leave its trainer running, parked by the gate task or waiting for a tier,
    for the rest of the session."""
    left = [p for p in list(Proc.started) if p.p.poll() is None]
    for proc in left:
        power_off(proc.p.pid)
    Proc.started = weakref.WeakSet()
    return [proc.p.pid for proc in left]


class ForkedProc(Proc):
    """Same interface as Proc, for a child of the Zygote."""

    def __init__(self, zygote: Zygote, fifo: Path):  # noqa: D107 (no super().__init__: no Popen)
        self.zygote, self.fifo, self.pid = zygote, fifo, 0
        self.lines = []
        self._q = queue.Queue()
        self._rc: int | None = None
        self._reader = threading.Thread(target=self._read_fifo, daemon=True)
        self._reader.start()

    def _read_fifo(self) -> None:
        with open(self.fifo) as f:  # blocks until the child opens its end
            for line in f:
                self.lines.append(line.rstrip("\n"))
                self._q.put(line.rstrip("\n"))
        self._q.put(None)

    def signal(self, sig: int, group: bool = False) -> None:
        os.kill(self.pid, sig)

    def wait(self, timeout: float = TIMEOUT) -> int:
        if self._rc is None:
            self._rc = self.zygote.exit_queue(self.pid).get(timeout=timeout)
        self._reader.join(timeout=10)
        return self._rc

    def kill(self) -> None:
        if self._rc is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            self.wait()


@pytest.fixture
def restore_logging():
    """Put the root logger back as it was: the trainer's setup_logging replaces its handlers."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)


class SleepClock:
    """A clock that moves only when the code under test sleeps through it: ``clock()`` is now,
    ``clock.sleep(s)`` records ``s`` in ``sleeps`` and advances (False: not interrupted)."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> bool:
        self.sleeps.append(s)
        self.now += s
        return False


def failing_shard_reads(kind: str, times: int) -> list[int]:
    """Make the next ``times`` reads of a DCP shard file in this process fail as a disk or the
    memory fails them: the file object DCP opened raises ``OSError(EIO)`` (``kind="eio"``: what a
    read(2) that meets a bad sector returns) or ``MemoryError`` (``"memory"``: its buffer cannot be
    allocated) from ``read``, inside DCP's own reader. Returns the count of reads still to fail.
    (No fault-injecting block device exists here: no device-mapper in this kernel.)"""
    import errno

    from torch.distributed.checkpoint import filesystem

    left = [times]
    create_stream = filesystem.FileSystem.create_stream

    class Failing:
        def __init__(self, stream: Any) -> None:
            self._s = stream

        def _fail(self) -> None:
            if left[0] > 0:
                left[0] -= 1
                if kind == "eio":
                    raise OSError(errno.EIO, os.strerror(errno.EIO))
                raise MemoryError()

        def read(self, *a: Any) -> Any:
            self._fail()
            return self._s.read(*a)

        def readinto(self, b: Any) -> Any:
            self._fail()
            return self._s.readinto(b)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._s, name)

    @contextlib.contextmanager
    def failing(self: Any, path: Any, mode: str) -> Any:
        with create_stream(self, path, mode) as stream:
            yield Failing(stream) if str(path).endswith(".distcp") and "r" in mode else stream

    filesystem.FileSystem.create_stream = failing  # type: ignore[method-assign]
    return left
