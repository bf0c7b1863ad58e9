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
import subprocess
import sys
import tempfile
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
from tests.trainer.zygote import LAUNCHERS, ForkedPopen, Replies, import_time, path_entries

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
    """A process whose merged stdout/stderr is read line by line by a thread.

    A plain ``python -m trainer ...`` (``argv`` starts ``sys.executable, "-m", "trainer"``) is
    forked from the worker's zygote for its environment (``worker_zygote``, ``forkable``)
    instead (a ``ForkedProc``: same code path as ``python -m trainer``, real signals, exit status,
    process group, cwd and environment, without paying the torch import again). ``fork=False``
    keeps a fresh interpreter (a test of what start-up itself does); ``fork=True`` insists on the
    fork. ``SPOTTRAIN_TEST_NO_ZYGOTE=1`` turns the forks off for the whole run (to compare).
    torchrun (``-m torch.distributed.run``) is forked too: its agent, whose workers are still fresh
    ``python -m trainer`` children of it. Anything else stays a fresh interpreter: scripts, other
    commands."""

    #: Every Proc a test started, for `power_off_leftovers`.
    started: "weakref.WeakSet[Proc]" = weakref.WeakSet()

    def __new__(cls, argv: list[str], env: dict[str, str] | None = None, new_session: bool = False,
                fork: bool | None = None, **kw: Any) -> "Proc":
        if cls is Proc and fork is not False and forkable(argv, env):
            cls = ForkedProc
        elif cls is Proc and fork:
            raise ValueError(f"not a launch the zygote can fork: {argv[:4]}")
        return super().__new__(cls)

    def __init__(self, argv: list[str], env: dict[str, str] | None = None, new_session: bool = False,
                 fork: bool | None = None):
        self.argv = argv
        self.p: Any = self._start(argv, env or trainer_env(), new_session)
        Proc.started.add(self)
        self.lines: list[str] = []
        self._q: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _start(self, argv: list[str], env: dict[str, str], new_session: bool) -> Any:
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                env=env, cwd=REPO, start_new_session=new_session)

    def _stream(self) -> Any:
        """The merged output, as lines (a pipe here, a fifo in ForkedProc)."""
        assert self.p.stdout is not None
        return contextlib.nullcontext(self.p.stdout)

    def _read(self) -> None:
        with self._stream() as stream:
            for line in stream:
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
        try:
            rc = self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:  # say what it was doing: a hang is otherwise a bare pid
            raise AssertionError(f"{' '.join(self.argv[1:6])} ... still running after {timeout:g} s; its "
                                 f"output ends:\n{self.output[-4000:]}") from None
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
    base = trainer_env(WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), **{RANKS_STORE_PORT: str(store.port)},
                       **(env or {}))
    # A worker script (``python FILE ...``) is forked from the zygote, as a trainer launch is: each
    # rank is still a process of its own with its own store client and gloo group, without
    # importing torch again (about 2.5 CPU-seconds a rank).
    script = len(argv) > 1 and argv[0] == sys.executable and argv[1].endswith(".py")
    zygote = worker_zygote(base) if script and not os.environ.get(NO_ZYGOTE_ENV) else None
    procs: list[Proc] = []
    try:
        for r in range(nproc):
            env_r = dict(base, RANK=str(r), LOCAL_RANK=str(r))
            procs.append(ForkedProc(argv, env_r, zygote=zygote) if zygote else Proc(argv, env_r, fork=False))
        codes = [p.wait(timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
    outputs = [p.output for p in procs]
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


def start(run_dir: Path, steps: int, config: Path, *extra: str, env: dict[str, str] | None = None,
          fork: bool | None = None) -> Proc:
    """``python -m trainer run``: forked from the worker's zygote unless ``fork=False`` (see Proc)."""
    return Proc(run_args(run_dir, steps, config, *extra), env=env, fork=fork)


def run_to_end(run_dir: Path, steps: int, config: Path, *extra: str, env: dict[str, str] | None = None,
               fork: bool | None = None) -> Proc:
    p = start(run_dir, steps, config, *extra, env=env, fork=fork)
    rc = p.wait()
    assert rc == 0, p.output[-4000:]
    return p


# The gpt task whose loader can wait at a gate (tests/trainer/e2e/gate_task.py): the same weights.
GATE_TASK = "tests.trainer.e2e.gate_task:build"
NOTICE = r"event=preemption_notice reason="  # whichever signal or watch it heard first


def gated(gate: Path, steps: int, env: dict[str, str] | None = None, *, samples_per_step: int = 4) -> dict[str, str]:
    """``env`` (the trainer's by default) for a run of ``GATE_TASK`` whose loader (each process's,
    each data worker's) serves ``steps`` steps' samples, then waits while the file ``gate`` exists.

    A test that signals a run once it logs step N puts the gate a few steps past N: the run trains
    on as usual, and a test that reads the log late on a busy machine still finds it training,
    never finished before its signal."""
    gate.touch()
    return {**(env if env is not None else trainer_env()), "GATE_FLAG": str(gate),
            "GATE_AFTER": str(steps * samples_per_step)}


def open_gate_on_notice(p: "Proc", gate: Path, notice: str = NOTICE) -> None:
    """Once ``p`` heard its notice, open ``gate``: a run parked there completes the step in flight
    and saves it, as a run that was never held does."""
    p.wait_for(notice)
    gate.unlink()


def status(run_dir: Path, *extra: str, env: dict[str, str] | None = None, cli: bool = False) -> dict[str, Any]:
    """`python -m trainer status --json` (in this process unless ``cli``: torch is loaded here;
    with ``cli``, forked from the worker's zygote: see Proc)."""
    if not cli:
        from trainer.config import StatusConfig
        from trainer.status import collect

        opt = dict(zip(extra[::2], extra[1::2]))
        cfg = StatusConfig(run_dir=run_dir, gcs_uri=opt.get("--gcs-uri"), local_dir=opt.get("--local-dir"))
        return json.loads(json.dumps(collect(cfg), default=str))
    out = run_trainer(["status", "--run-dir", str(run_dir), "--json", *extra], env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


# --------------------------------------------------------------------------------------------
# A fork server (tests/trainer/zygote.py): importing torch costs 1.6-1.9 s of CPU per process on this
# box, so one "zygote" a pytest process imports torch and the trainer once and forks a child per
# trainer launch (and torchrun's agent forks its ranks from a server of its own).
# --------------------------------------------------------------------------------------------


class Zygote:
    """A fork server (``tests/trainer/zygote.py``); ``worker_zygote()`` is the pytest process's own."""

    def __init__(self, tmp: Path, env: dict[str, str] | None = None):
        self.tmp = tmp
        self.env = env or trainer_env()
        self.p = subprocess.Popen([sys.executable, "-m", "tests.trainer.zygote"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, bufsize=1, env=self.env, cwd=REPO)
        self._lock = threading.Lock()
        self._replies = Replies()
        assert self.p.stdout is not None
        first = json.loads(self.p.stdout.readline())
        assert "ready" in first, first
        threading.Thread(target=self._replies.read, args=(self.p.stdout,), daemon=True).start()

    def fork(self, args: list[str], env: dict[str, str], new_session: bool = False,
             err: bool = False, module: str = "trainer",
             script: Path | None = None) -> tuple[ForkedPopen, Path, Path | None]:
        """Fork a child running ``python -m MODULE *args`` (a module of ``LAUNCHERS``), or with
        ``script`` ``python SCRIPT *args`` (a test's own worker script): its Popen face, the fifo
        its output goes to (stdout and, unless ``err``, stderr) and, with ``err``, its stderr's fifo."""
        assert script is not None or module in LAUNCHERS, module
        n, started = self._replies.expect()
        out = self.tmp / f"out-{n}.fifo"
        os.mkfifo(out)
        err_fifo = self.tmp / f"err-{n}.fifo" if err else None
        if err_fifo is not None:
            os.mkfifo(err_fifo)
        kept = len(path_entries(self.env))
        cmd = {"module": module, "script": str(script) if script else None, "argv": args, "env": env,
               "cwd": str(REPO), "new_session": new_session, "id": n,
               "out": str(out), "err": str(err_fifo) if err_fifo else None,
               "path_kept": kept, "path_extra": path_entries(env)[kept:]}
        assert self.p.stdin is not None
        with self._lock:
            self.p.stdin.write(json.dumps(cmd) + "\n")
            self.p.stdin.flush()
        pid, exits = started.get(timeout=TIMEOUT)
        return ForkedPopen(pid, exits), out, err_fifo

    def spawn(self, args: list[str], env: dict[str, str], new_session: bool = False) -> "ForkedProc":
        """``python -m trainer *args``, forked from this zygote."""
        return ForkedProc([sys.executable, "-m", "trainer", *args], env, new_session, zygote=self)

    def run(self, args: list[str], env: dict[str, str], timeout: float = TIMEOUT) -> "subprocess.CompletedProcess[str]":
        """``subprocess.run([python, -m, trainer, *args], capture_output=True, text=True)``, forked."""
        popen, out, err = self.fork(args, env, err=True)
        assert err is not None
        texts: dict[Path, str] = {}

        def drain(path: Path) -> None:
            with open(path) as f:
                texts[path] = f.read()

        readers = [threading.Thread(target=drain, args=(f,), daemon=True) for f in (out, err)]
        for r in readers:
            r.start()
        try:
            rc = popen.wait(timeout)
        except subprocess.TimeoutExpired:
            power_off(popen.pid)
            raise
        for r in readers:
            r.join(timeout=10)
        return subprocess.CompletedProcess([sys.executable, "-m", "trainer", *args], rc, texts.get(out, ""),
                                           texts.get(err, ""))

    def running(self) -> int:
        """How many of its children have not ended."""
        return self._replies.running()

    def close(self) -> None:
        if self.p.stdin is not None:
            self.p.stdin.close()
        self.p.wait(timeout=60)


#: The worker's zygotes by ``_zygote_key``, the least recently used first.
_worker_zygotes: dict[tuple[Any, ...], Zygote] = {}
NO_ZYGOTE_ENV = "SPOTTRAIN_TEST_NO_ZYGOTE"
#: Zygotes one pytest process keeps at most (one for each environment a fork cannot change; most
#: workers need one, a few tests' import-time settings another); beyond, the least recently used
#: one with no child running is closed for the new one, and while each has one, launches start fresh.
MAX_ZYGOTES = 4


def _zygote_key(env: dict[str, str]) -> tuple[Any, ...]:
    """What a child's zygote must have been started with: the environment's import-time part and
    the PYTHONPATH a child extends (the repository's, when the launch's starts with it)."""
    path = path_entries(env)
    base = path[:1] if path[:1] == [str(REPO)] else path
    return tuple(sorted(import_time(env).items())), tuple(base)


def worker_zygote(env: dict[str, str] | None = None) -> Zygote | None:
    """This pytest process's zygote for launches with ``env`` (default ``trainer_env()``), started
    on first use (again if it died): one per environment a fork cannot change (a test, or code a
    test ran in this process, may set TORCH_*, PYTHONHASHSEED, ...), at most ``MAX_ZYGOTES``: a new
    one replaces the least recently used with no child running (None while every one has one).
    ``close_worker_zygote`` (the trainer conftest's session teardown) stops them."""
    env = env or trainer_env()
    key = _zygote_key(env)
    zygote = _worker_zygotes.pop(key, None)
    if zygote is None or zygote.p.poll() is not None:
        if len(_worker_zygotes) >= MAX_ZYGOTES:
            idle = next((k for k, z in _worker_zygotes.items() if not z.running()), None)
            if idle is None:
                return None
            _worker_zygotes.pop(idle).close()
        base = {k: v for k, v in env.items() if k != "PYTHONPATH"}
        if key[1]:
            base["PYTHONPATH"] = os.pathsep.join(key[1])
        zygote = Zygote(Path(tempfile.mkdtemp(prefix="zygote-")), base)
    _worker_zygotes[key] = zygote  # the most recently used last
    return zygote


def close_worker_zygote() -> None:
    for zygote in _worker_zygotes.values():
        zygote.close()
    _worker_zygotes.clear()


#: Commands that set an environment variable torch reads at import before they import it, which a
#: child of the zygote (torch loaded) cannot honour: `rendezvous-id` sets TORCH_CPP_LOG_LEVEL=FATAL
#: so that c10d's C++ log does not add a stack trace to its one line.
FRESH_COMMANDS = ("rendezvous-id",)


def forkable(argv: list[str], env: dict[str, str] | None = None) -> bool:
    """Whether ``argv`` (with ``env``, default ``trainer_env()``) is a plain ``python -m trainer``
    (or another of ``LAUNCHERS``) that the worker's zygote can fork in place of a fresh interpreter."""
    if argv[:2] != [sys.executable, "-m"] or len(argv) < 3 or argv[2] not in LAUNCHERS \
            or any(argv[3:4] == [c] for c in FRESH_COMMANDS) \
            or os.environ.get(NO_ZYGOTE_ENV):
        return False
    return worker_zygote(env) is not None  # one started with what the fork cannot change (``_zygote_key``)


def run_trainer(args: list[str], env: dict[str, str] | None = None, timeout: float = TIMEOUT,
                fork: bool | None = None) -> "subprocess.CompletedProcess[str]":
    """``python -m trainer *args`` to its end, stdout and stderr apart (``subprocess.run``'s
    ``capture_output``): forked from the worker's zygote when it can be (``fork`` as in ``Proc``)."""
    argv, env = [sys.executable, "-m", "trainer", *args], env or trainer_env()
    if fork is not False and forkable(argv, env):
        return _zygote(env).run(args, env, timeout)
    if fork:
        raise ValueError(f"not a launch the zygote can fork: {args[:1]}")
    return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout)


def _zygote(env: dict[str, str] | None) -> Zygote:
    zygote = worker_zygote(env)
    assert zygote is not None, "forkable() said a zygote would fork it"
    return zygote


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
    """A Proc forked from a zygote (the worker's unless given): see Proc and tests/trainer/zygote.py."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None, new_session: bool = False,
                 fork: bool | None = None, zygote: Zygote | None = None):
        self.zygote = zygote or _zygote(env)
        super().__init__(argv, env, new_session)

    def _start(self, argv: list[str], env: dict[str, str], new_session: bool) -> Any:
        if argv[0] == sys.executable and argv[1].endswith(".py"):  # a test's worker script (``run_ranks``)
            self.p, self.fifo, _ = self.zygote.fork(argv[2:], env, new_session, script=Path(argv[1]))
        else:
            assert argv[:2] == [sys.executable, "-m"], argv
            self.p, self.fifo, _ = self.zygote.fork(argv[3:], env, new_session, module=argv[2])
        return self.p

    def _stream(self) -> Any:
        return open(self.fifo)  # blocks until the child opens its end


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
