"""One cell's world: the VM's disks, Cloud Storage behind the fault proxy, the metadata server, and
the real trainer processes run against them.

- **Disks**: the run dir is an ext4 on a loop device (`drill.small_fs.SmallFs`, the persistent disk:
  it fills, and its error path turns it read-only whatever is open); the local SSD is a tmpfs.
  A next boot always gets a blank local SSD (a preempted Spot VM is recreated); `blank_pd()` gives
  it a blank persistent disk too (a VM recreated in another zone, or a new disk).
- **Cloud Storage**: one gcp-storage-emulator for the whole matrix, a `drill.fault_proxy.FaultProxy`
  per cell in front of it and a prefix of its own; the trainer talks to the proxy, the harness's
  checks to the emulator directly (they are not subject to the faults).
- **The metadata server** (`drill.metadata_server`): `notice()` turns `instance/preempted` TRUE and
  sends SIGTERM, as GCE does at the start of a Spot VM's shutdown window; what is still running
  `WINDOW_S` later is powered off (SIGKILL).
- **Trainer processes**: `python -m trainer run` with the chaos config (`config()`), read line by
  line; with ``nproc`` 2, under `torchrun --standalone --nproc-per-node 2` (DDP, gloo on CPU: two
  ranks on one VM), whose exit status is the ranks' own when they agree (as `trainer.sh` reads it,
  `trainer.exit_status`). The harness synchronises on their log lines, on the task's park files
  (`drill.chaos.task`) and on the proxy's held requests, never on sleeps (timeouts are guards).
- **Two nodes** (``nodes`` 2): two VMs of a pool on loopback, each with its own persistent disk,
  local SSD and metadata server, sharing the bucket prefix (through the one fault proxy). Each
  node is a torchrun agent (`--nnodes 2`, one gloo rank, c10d rendezvous) joining the store of a
  coordinator that does not train (`python -m trainer rendezvous`), as the pooled `trainer.sh`
  runs it; a boot is both agents (a `Job`). The rendezvous ranks nodes by their address, so the
  rig gives each node its own (`--local-addr`, 127.0.0.x) and so picks which node gets rank 0:
  node a in the first run (its disk gets the checkpoints), node b on every next boot (node a,
  holding the newest, is then the non-leader). The node ranks the trainers log are read back
  (`Job.ranks`) and a cell checks them, not assumes them.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from drill.fault_proxy import FaultProxy
from drill.gcs_emulator import StorageEmulator
from drill.metadata_server import MetadataServer
from drill.procs import power_off
from drill.small_fs import SmallFs
from drill.tiny_gpt import MULTI_RANK_TASK_ARGS_TOML, TASK_ARGS_TOML
from trainer import shutdown_window

REPO = Path(__file__).resolve().parents[2]
TASK = "drill.chaos.task:build"
#: An own loop's job (`Rig.script`): examples/own_loop/train.py with the task's parking, and its
#: command line: BATCH samples a step, an epoch of 10 steps (its per-epoch scheduler steps twice).
SCRIPT = "drill/chaos/own_loop.py"
SCRIPT_ARGS = ("--batch-size", "4", "--samples", "40")
STEPS = 20          # the job's total steps
EVERY = 5           # periodic saves, every tier
BATCH = 4           # samples per step (the task parks by samples)
#: A Spot VM's shutdown window and its trainer's budget (`trainer.shutdown_window`: 30 s and 20 s),
#: scaled down so that a scenario takes seconds: 12 s and 8 s.
TIME_SCALE = 0.4
WINDOW_S = shutdown_window.window_s("spot") * TIME_SCALE  # notice -> power-off
BUDGET_S = shutdown_window.trainer_budget_s("spot") * TIME_SCALE  # preemption_budget_s
WAIT_FOR_TIERS_S = 40.0  # wait_for_tiers_s: start-up's bound on an unknown tier (then exit 69)
LEASE_TTL_S = 20.0  # lease_ttl_s: renewed every 5 s; a second writer gives up after two renewals
DURABLE_TIMEOUT_S = 10.0  # durable_timeout_s (where the trainer has it): the final save's bound
GUARD_S = 150.0     # a trainer without a notice that runs longer is hung: powered off, a violation
REFERENCE = "reference"  # the uninterrupted run's name
PD_BYTES = 32 << 20
SSD_BYTES = 8 << 20
#: The own loop's disks: its MNIST net (1.2 M parameters, Adadelta's two buffers) saves about
#: 14 MiB a step, three kept.
SCRIPT_PD_BYTES = 96 << 20
SCRIPT_SSD_BYTES = 48 << 20
NODES = ("a", "b")  # a two-node job's node names (SPOTTRAIN_NODE)

_CONFIG = """\
log_every_steps = 1
batch_size = {batch}
progress_every_s = 0.5
checkpoint_every_steps = {every}
preemption_budget_s = {budget}
wait_for_tiers_s = {wait}
lease_ttl_s = {ttl}
{extra}
""" + TASK_ARGS_TOML


def reference_name(nproc: int, nodes: int = 1, script: bool = False) -> str:
    if script:
        return f"{REFERENCE}-script" + (f"-ws{nproc}" if nproc > 1 else "")
    if nodes > 1:
        return f"{REFERENCE}-nodes{nodes}"
    return REFERENCE if nproc == 1 else f"{REFERENCE}-ws{nproc}"


def config(multi_rank: bool = False, script: bool = False) -> str:
    """The trainer's config file for every run of the matrix (and the reference); ``multi_rank``
    (torchrun, two nodes): the model of hundreds of tensors (``drill.tiny_gpt``); ``script``: an
    own loop's (no task arguments: its command line is ``SCRIPT_ARGS``)."""
    from trainer.config import RunConfig

    extra = ""
    if "durable_timeout_s" in RunConfig.model_fields:  # the trainer bounds its final save
        extra += f"durable_timeout_s = {DURABLE_TIMEOUT_S}\n"
    text = _CONFIG.format(batch=BATCH, every=EVERY, budget=BUDGET_S, wait=WAIT_FOR_TIERS_S, ttl=LEASE_TTL_S,
                          extra=extra)
    if script:
        return text.replace(TASK_ARGS_TOML, "")
    return text.replace(TASK_ARGS_TOML, MULTI_RANK_TASK_ARGS_TOML) if multi_rank else text


def key_env(folder: Path) -> dict[str, str]:
    """One checkpoint key for the whole matrix (the experiment's, as Secret Manager holds it on
    GCP), in the environment variable the trainer and `status` read (trainers without keys
    ignore it)."""
    path = folder / "checkpoint.key"
    if not path.exists():
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            f.write(os.urandom(32))
    return {"SPOTTRAIN_CHECKPOINT_KEY_FILE": str(path)}


def run_uri(emulator: StorageEmulator, name: str) -> str:
    """The bucket prefix of the cell (or reference run) ``name``."""
    return f"gs://{emulator.bucket}/chaos/{name}"


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    """This process's environment with ``values``, for what reads it (the storage client, the key)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ------------------------------------------------------------------------------------ processes


class Trainer:
    """One `python -m trainer run` process, its output read line by line (and copied to ``log``)."""

    def __init__(self, role: str, argv: list[str], env: dict[str, str], log: Path, run_dir: Path,
                 exit_dir: Path | None = None, nproc: int = 1, cond: threading.Condition | None = None) -> None:
        self.role = role
        self.log = log
        self.run_dir = run_dir
        self.exit_dir, self.nproc = exit_dir, nproc
        self.p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                  env=env, cwd=REPO, start_new_session=True)
        self.lines: list[str] = []
        self._cond = cond or threading.Condition()  # a job's nodes share one: it waits on any node's lines
        self._eof = False
        self.rc: int | None = None
        self.killed: str | None = None  # why the harness powered it off
        self.notice_at: float | None = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        with open(self.log, "a") as copy:
            for line in self.p.stdout:
                copy.write(line)
                copy.flush()
                with self._cond:
                    self.lines.append(line.rstrip("\n"))
                    self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def wait_for(self, pattern: str, timeout: float = GUARD_S) -> re.Match[str] | None:
        """The first line (already read or still to come) matching ``pattern``; None when the
        process ends or ``timeout`` passes first."""
        rx = re.compile(pattern)
        end = time.monotonic() + timeout
        seen = 0
        with self._cond:
            while True:
                for line in self.lines[seen:]:
                    m = rx.search(line)
                    if m:
                        return m
                seen = len(self.lines)
                left = end - time.monotonic()
                if self._eof or left <= 0:
                    return None
                self._cond.wait(left)

    def find(self, pattern: str) -> list[re.Match[str]]:
        rx = re.compile(pattern)
        with self._cond:
            return [m for m in (rx.search(line) for line in self.lines) if m]

    def alive(self) -> bool:
        return self.p.poll() is None

    def notice(self, metadata: MetadataServer) -> None:
        """A Spot preemption: the metadata flag, then the ACPI soft-off's SIGTERM."""
        self.notice_at = time.monotonic()
        metadata.preempt()
        with contextlib.suppress(ProcessLookupError):
            self.p.send_signal(signal.SIGTERM)

    def finish(self, guard: float = GUARD_S) -> int | None:
        """Wait for the exit: until the power-off after a notice, else until ``guard`` (hung)."""
        if self.rc is not None or self.killed is not None:
            return self.rc
        if self.notice_at is not None:
            left, why = self.notice_at + WINDOW_S - time.monotonic(), f"powered off {WINDOW_S:.0f}s after the notice"
        else:
            left, why = guard, f"hung: powered off after {guard:.0f}s"
        try:
            self.rc = self._ranks_status(self.p.wait(timeout=max(0.0, left)))
        except subprocess.TimeoutExpired:
            self.killed = why
            power_off(self.p.pid)
            self.p.wait()
            self.rc = None
        with self._cond:
            self._cond.wait_for(lambda: self._eof, 10)
        return self.rc

    def _ranks_status(self, rc: int) -> int:
        """torchrun's status, or the ranks' own when every rank recorded the same one (what
        `trainer.sh`'s ranks_status reads: torchrun exits 1 whenever a rank exits non-zero)."""
        if rc == 0 or self.exit_dir is None:
            return rc
        codes = [f.read_text().strip() for f in self.exit_dir.glob("rank-*")]
        agreed = len(codes) == self.nproc and len(set(codes)) == 1 and codes[0].isdigit()
        return int(codes[0]) if agreed else rc

    def kill(self) -> None:
        if self.alive():
            power_off(self.p.pid)
            self.p.wait()

    @property
    def exit(self) -> str:
        return "killed" if self.killed else "running" if self.rc is None else str(self.rc)

    @property
    def output(self) -> str:
        with self._cond:
            return "\n".join(self.lines)

    # What it logged -------------------------------------------------------------------------
    def restored(self) -> tuple[int, str] | None:
        """(step, path) of its `event=restore`, None when it never restored."""
        m = self.find(r"\bevent=restore step=(\d+)(?: tier=\S+ path=(\S+))?")
        return (int(m[0].group(1)), m[0].group(2) or "") if m else None

    def steps(self) -> list[int]:
        return [int(m.group(1)) for m in self.find(r"\bevent=step step=(\d+)/")]


class Job:
    """One boot of a two-node job: a torchrun agent per node (its own `Trainer`), read as one
    trainer would be. Its exit status is the nodes' when they agree (each node's is its ranks',
    as trainer.sh reads it), else 1 (a node failed); the table shows each node's when they differ.
    A notice reaches every node (each VM's metadata server, SIGTERM to each agent): a Spot pool
    preempted as a whole."""

    def __init__(self, role: str, nodes: "list[tuple[Node, Trainer]]", leader: str) -> None:
        self.role = role
        self.nodes = nodes
        self.leader = leader  # the node the rig meant to get rank 0 (its address sorts first)
        self.notice_at: float | None = None

    @property
    def node(self) -> dict[str, Trainer]:
        return {n.name: t for n, t in self.nodes}

    def ranks(self) -> dict[str, int]:
        """Each node's rank in the job's world (its last `event=start`, as the node leader logs it)."""
        out = {}
        for n, t in self.nodes:
            m = t.find(r"\bevent=start steps=\d+ world_size=\d+ node=\S+ node_rank=(\d+)")
            if m:
                out[n.name] = int(m[-1].group(1))
        return out

    @property
    def run_dir(self) -> Path:
        """The persistent disk of the node that held rank 0 (where the job's checkpoints are)."""
        rank0 = [name for name, rank in self.ranks().items() if rank == 0]
        return self.node[rank0[0] if rank0 else self.leader].run_dir

    def wait_for(self, pattern: str, timeout: float = GUARD_S) -> re.Match[str] | None:
        """The first line of any node matching ``pattern``; None when every node ended or
        ``timeout`` passes first."""
        rx = re.compile(pattern)
        end = time.monotonic() + timeout
        cond = self.nodes[0][1]._cond  # shared by the nodes (Rig.start)
        with cond:
            while True:
                for _, t in self.nodes:
                    for line in t.lines:
                        m = rx.search(line)
                        if m:
                            return m
                left = end - time.monotonic()
                if all(t._eof for _, t in self.nodes) or left <= 0:
                    return None
                cond.wait(left)

    def find(self, pattern: str) -> list[re.Match[str]]:
        return [m for _, t in self.nodes for m in t.find(pattern)]

    def alive(self) -> bool:
        return any(t.alive() for _, t in self.nodes)

    def notice(self, metadata: MetadataServer | None = None) -> None:
        self.notice_at = time.monotonic()
        for n, t in self.nodes:
            t.notice(n.metadata)

    def finish(self, guard: float = GUARD_S) -> int | None:
        for _, t in self.nodes:
            t.finish(guard)
        return self.rc

    def kill(self) -> None:
        for _, t in self.nodes:
            t.kill()

    @property
    def killed(self) -> str | None:
        return next((f"node {n.name} {t.killed}" for n, t in self.nodes if t.killed), None)

    @property
    def rc(self) -> int | None:
        codes = [t.rc for _, t in self.nodes]
        if any(c is None for c in codes):
            return None
        return codes[0] if len(set(codes)) == 1 else 1

    @property
    def exit(self) -> str:
        codes = [t.exit for _, t in self.nodes]
        return codes[0] if len(set(codes)) == 1 else " ".join(f"{n.name}:{t.exit}" for n, t in self.nodes)

    @property
    def output(self) -> str:
        return "\n".join(f"[node {n.name}] {line}" for n, t in self.nodes for line in t.output.splitlines())

    def restored(self) -> tuple[int, str] | None:
        """(step, path) of the job's `event=restore` (every node leader logs the same)."""
        got = [r for _, t in self.nodes if (r := t.restored()) is not None]
        return got[0] if got else None

    def steps(self) -> list[int]:
        return sorted({s for _, t in self.nodes for s in t.steps()})


# ------------------------------------------------------------------------------------ the cell


@dataclass
class Node:
    """One VM of a two-node job: its persistent disk, local SSD, metadata server, and the address
    its torchrun agent gives the rendezvous (which ranks nodes by it)."""

    name: str
    pd: SmallFs
    ssd: SmallFs
    metadata: MetadataServer
    addr: str = "127.0.0.1"

    @property
    def run_dir(self) -> Path:
        return self.pd.path


@dataclass
class Rig:
    """One cell's VM(s), disks, bucket prefix and metadata server; a context manager."""

    root: Path
    emulator: StorageEmulator
    name: str
    env: dict[str, str]                  # the matrix's (the checkpoint key)
    nproc: int = 1                       # ranks on the VM (torchrun above 1)
    nodes: int = 1                       # VMs of the job: 2 is a pool of two (one rank each)
    script: bool = False                 # the job is an own loop (`SCRIPT`), not the chaos task
    pd: SmallFs = field(init=False)
    ssd: SmallFs = field(init=False)
    proxy: FaultProxy = field(init=False)
    metadata: MetadataServer = field(init=False)
    trainers: list[Trainer] = field(default_factory=list, init=False)
    jobs: list[Job] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self.dir = self.root / self.name
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True)
        self.park = self.dir / "park"
        self.park.mkdir()
        self.marker = self.dir / "RAN-ATTACKER-CODE"  # created by the forged checkpoints' payload if unpickled
        self.config_file = self.dir / "trainer.toml"
        self.config_file.write_text(config(multi_rank=self.nproc > 1 or self.nodes > 1, script=self.script))
        self.uri = run_uri(self.emulator, self.name)
        self.proxy = FaultProxy(self.emulator.host)
        if self.nodes == 1:
            self.pd = SmallFs(self.dir / "pd", SCRIPT_PD_BYTES if self.script else PD_BYTES, fstype="ext4")
            self.ssd = SmallFs(self.dir / "ssd", SCRIPT_SSD_BYTES if self.script else SSD_BYTES)
            self.metadata = MetadataServer(instance_name=f"chaos-{self.name}")
            self.node_list: list[Node] = []
        else:
            self.node_list = [Node(n, SmallFs(self.dir / f"pd-{n}", PD_BYTES, fstype="ext4"),
                                   SmallFs(self.dir / f"ssd-{n}", SSD_BYTES),
                                   MetadataServer(instance_name=f"chaos-{self.name}-{n}")) for n in NODES[:self.nodes]]
            # The faults' disk, SSD and metadata are node a's: the first run's rank 0, whose disk
            # holds the checkpoints, and the non-leader of every next boot.
            first = self.node_list[0]
            self.pd, self.ssd, self.metadata = first.pd, first.ssd, first.metadata
            self.lead(first.name)
        self.rendezvous: subprocess.Popen[str] | None = None
        self.rendezvous_port = 0

    def __enter__(self) -> "Rig":
        for disks in [(self.pd, self.ssd)] if self.nodes == 1 else [(n.pd, n.ssd) for n in self.node_list]:
            for d in disks:
                d.__enter__()
        self.proxy.start()
        for m in [self.metadata] if self.nodes == 1 else [n.metadata for n in self.node_list]:
            m.start()
        if self.nodes > 1:
            self._start_rendezvous()
        return self

    def __exit__(self, *exc: object) -> None:
        for t in self.trainers:
            t.kill()
        if self.rendezvous is not None:
            self.rendezvous.terminate()
            try:
                self.rendezvous.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.rendezvous.kill()
                self.rendezvous.wait()
        self.proxy.stop()
        for m in [self.metadata] if self.nodes == 1 else [n.metadata for n in self.node_list]:
            m.stop()
        for disks in [(self.pd, self.ssd)] if self.nodes == 1 else [(n.pd, n.ssd) for n in self.node_list]:
            for d in reversed(disks):
                d.__exit__(None, None, None)

    def _start_rendezvous(self) -> None:
        """The coordinator that does not train: it holds the rendezvous store for every boot."""
        from drill.net import free_port

        self.rendezvous_port = free_port()
        self.rendezvous = subprocess.Popen(
            [sys.executable, "-m", "trainer", "rendezvous", "--host", "127.0.0.1", "--port", str(self.rendezvous_port)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
            cwd=REPO, start_new_session=True)
        assert self.rendezvous.stdout is not None
        for line in self.rendezvous.stdout:  # until it listens (or ends: then the agents fail, and say so)
            if "event=rendezvous_store" in line:
                break
        threading.Thread(target=self.rendezvous.stdout.read, daemon=True).start()  # drained

    def lead(self, name: str) -> None:
        """Node ``name`` gets rank 0 at the next start: the c10d rendezvous assigns ranks in the
        order of the nodes' addresses (then pids), and its address sorts first."""
        others = iter(range(2, 2 + len(self.node_list)))
        for n in self.node_list:
            n.addr = "127.0.0.1" if n.name == name else f"127.0.0.{next(others)}"

    @property
    def leader(self) -> str:
        return min(self.node_list, key=lambda n: n.addr).name

    @property
    def run_dir(self) -> Path:
        return self.pd.path

    # --- processes ------------------------------------------------------------------------
    def trainer_env(self, park: list[int] = ()) -> dict[str, str]:  # type: ignore[assignment]
        env = dict(os.environ)
        env.update(self.env)
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1",
                   STORAGE_EMULATOR_HOST=self.proxy.host, GOOGLE_CLOUD_PROJECT="spottrain-chaos",
                   GCE_METADATA_HOST=self.metadata.host)
        if park:
            env.update(CHAOS_PARK_DIR=str(self.park), CHAOS_PARK_STEPS=",".join(map(str, park)),
                       CHAOS_PARK_BATCH=str(BATCH))
        return env

    def start(self, role: str, *, park: list[int] = (), run_dir: Path | None = None,  # type: ignore[assignment]
              local: bool = True) -> Any:
        """A trainer of the job (a `Job` of both nodes when the rig has two); ``park``: the steps it
        parks at (see drill.chaos.task)."""
        for k in park:
            (self.park / f"hold-{k}").touch()
            (self.park / f"parked-{k}").unlink(missing_ok=True)
        if self.nodes > 1:
            return self._start_nodes(role, park)
        launcher = [sys.executable] if self.nproc == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
            f"--nproc-per-node={self.nproc}", "--max-restarts=0"]  # as trainer.sh runs it
        argv = [*launcher, *self._trainer_args(run_dir or self.run_dir)]
        if local:
            argv += ["--local-dir", str(self.ssd.path)]
        env, exit_dir = self.trainer_env(park), None
        if self.nproc > 1:
            exit_dir = self.dir / f"exit-{role.replace(' ', '-')}"
            env["SPOTTRAIN_EXIT_DIR"] = str(exit_dir)
        t = Trainer(role, argv, env, self.dir / f"{role.replace(' ', '-')}.log", run_dir or self.run_dir,
                    exit_dir, self.nproc)
        self.trainers.append(t)
        return t

    def _trainer_args(self, run_dir: Path) -> list[str]:
        return ["-m", "trainer", "run", "--run-dir", str(run_dir), "--steps", str(STEPS), "--seed", "0",
                "--health-port", "0", "--config", str(self.config_file), *self.job_args(), "--gcs-uri", self.uri]

    def job_args(self) -> list[str]:
        """What the job trains: the chaos task, or the own loop's script and its command line (as
        trainer.sh passes them)."""
        if self.script:
            return ["--script", SCRIPT, *(f"--script-arg={a}" for a in SCRIPT_ARGS)]
        return ["--task", TASK]

    def _start_nodes(self, role: str, park: list[int]) -> Job:
        """Both nodes' torchrun agents, as the pooled trainer.sh starts them on each VM (every node
        a client of the coordinator's store), with the rig's addresses. One rendezvous id per boot:
        an agent that ends closes its rendezvous for good (torchrun's shutdown), and a boot's
        agents are new ones, as on recreated VMs. ``--max-restarts=0``: where the pool's agent
        would restart a failed worker into a new round, the rig boots the whole job again."""
        cond = threading.Condition()
        slug = role.replace(" ", "-")
        started = []
        for n in self.node_list:
            exit_dir = self.dir / f"exit-{slug}-{n.name}"
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                    "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{self.rendezvous_port}",
                    f"--rdzv-id=chaos-{self.name}-{slug}",
                    "--rdzv-conf=is_host=false,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3",
                    "--max-restarts=0", f"--local-addr={n.addr}",
                    *self._trainer_args(n.run_dir), "--local-dir", str(n.ssd.path)]
            env = self.trainer_env(park)
            env.update(SPOTTRAIN_NODE=n.name, GCE_METADATA_HOST=n.metadata.host, SPOTTRAIN_EXIT_DIR=str(exit_dir),
                       TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")  # as the pooled trainer.sh sets it
            t = Trainer(f"{role} {n.name}", argv, env, self.dir / f"{slug}-{n.name}.log", n.run_dir, exit_dir, 1,
                        cond)
            self.trainers.append(t)
            started.append((n, t))
        job = Job(role, started, self.leader)
        self.jobs.append(job)
        return job

    def other_run(self, stop_at: int) -> str:
        """Another run of the same experiment (same task, settings, data and checkpoint key; its own
        prefix and run dir), run until it has saved ``stop_at`` on every tier (a pause, or the
        final step): the source of a replay. Not one of the cell's trainers. Its prefix."""
        uri = f"{self.uri}-other-run"
        run_dir = self.dir / "other-run"
        argv = [sys.executable, "-m", "trainer", "run", "--run-dir", str(run_dir), "--steps", str(STEPS), "--seed", "0",
                "--health-port", "0", "--config", str(self.config_file), *self.job_args(), "--gcs-uri", uri,
                "--stop-at-step", str(stop_at)]
        with open(self.dir / "other-run.log", "w") as log:
            rc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=self.trainer_env(), cwd=REPO,
                                timeout=GUARD_S).returncode
        if rc != (0 if stop_at == STEPS else 75):
            raise RuntimeError(f"the other run exited {rc} (see {self.dir / 'other-run.log'})")
        return uri

    def parked(self, t: Trainer, step: int, timeout: float = GUARD_S) -> bool:
        """Block until ``t`` parks at ``step`` (a file the task creates); False if it ends first."""
        flag, end = self.park / f"parked-{step}", time.monotonic() + timeout
        while not flag.exists():
            if not t.alive() or time.monotonic() > end:
                return False
            time.sleep(0.01)
        return True

    def release(self, step: int) -> None:
        (self.park / f"hold-{step}").unlink(missing_ok=True)

    def next_boot(self, *, blank_pd: bool = False, lead: str | None = None) -> None:
        """What a preempted Spot VM's replacement finds: a blank local SSD, the metadata flag down,
        and its persistent disk (blank if ``blank_pd``). Two nodes: both are replaced, and node
        ``lead`` (default b) leads from now on (node a, whose disk holds the first run's
        checkpoints, follows)."""
        vms = ([(n.metadata, n.ssd, n.pd) for n in self.node_list] if self.nodes > 1
               else [(self.metadata, self.ssd, self.pd)])
        for metadata, ssd, pd in vms:
            metadata.reset()
            ssd.__exit__(None, None, None)
            ssd.__enter__()
            if blank_pd:
                pd.__exit__(None, None, None)
                pd.__enter__()
        if self.nodes > 1:
            self.lead(lead or self.node_list[1].name)

    # --- what the tiers hold (read directly, never through the faults) --------------------
    def steps_in_bucket(self, uri: str | None = None) -> list[int]:
        """The steps with a manifest under ``uri`` (default: the cell's prefix), oldest first."""
        bucket, _, prefix = (uri or self.uri).removeprefix("gs://").partition("/")
        return sorted({int(b.name[len(prefix) + 1:].split("/")[0].removeprefix("step-"))
                       for b in self.client().list_blobs(bucket, prefix=prefix + "/step-")
                       if b.name.endswith("/manifest.json")})

    def client(self) -> Any:
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        return storage.Client(project="spottrain-chaos", credentials=AnonymousCredentials(),
                              client_options={"api_endpoint": self.emulator.host})

    def newest(self, tier: str, run_dir: Path | None = None) -> tuple[int | None, str | None]:
        """(step, model digest) of the newest checkpoint the trainer's own `status` accepts on
        ``tier`` alone: "gcs", or "persistent" (``run_dir``, default the cell's disk)."""
        from trainer.config import StatusConfig
        from trainer.status import collect

        where = {"gcs_uri": self.uri, "run_dir": self.dir / "no-run-dir"} if tier == "gcs" else {
            "run_dir": run_dir or self.run_dir}
        with _environ(STORAGE_EMULATOR_HOST=self.emulator.host, **self.env):  # the run's key
            s = collect(StatusConfig(**where))
        return s["latest_step"], s["model_digest"]
