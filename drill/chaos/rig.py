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
from drill.tiny_gpt import TASK_ARGS_TOML
from trainer import shutdown_window

REPO = Path(__file__).resolve().parents[2]
TASK = "drill.chaos.task:build"
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


def reference_name(nproc: int) -> str:
    return REFERENCE if nproc == 1 else f"{REFERENCE}-ws{nproc}"


def config() -> str:
    """The trainer's config file for every run of the matrix (and the reference)."""
    from trainer.config import RunConfig

    extra = ""
    if "durable_timeout_s" in RunConfig.model_fields:  # the trainer bounds its final save
        extra += f"durable_timeout_s = {DURABLE_TIMEOUT_S}\n"
    return _CONFIG.format(batch=BATCH, every=EVERY, budget=BUDGET_S, wait=WAIT_FOR_TIERS_S, ttl=LEASE_TTL_S,
                          extra=extra)


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
                 exit_dir: Path | None = None, nproc: int = 1) -> None:
        self.role = role
        self.log = log
        self.run_dir = run_dir
        self.exit_dir, self.nproc = exit_dir, nproc
        self.p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                  env=env, cwd=REPO, start_new_session=True)
        self.lines: list[str] = []
        self._cond = threading.Condition()
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


# ------------------------------------------------------------------------------------ the cell


@dataclass
class Rig:
    """One cell's VM(s), disks, bucket prefix and metadata server; a context manager."""

    root: Path
    emulator: StorageEmulator
    name: str
    env: dict[str, str]                  # the matrix's (the checkpoint key)
    nproc: int = 1                       # ranks on the VM (torchrun above 1)
    pd: SmallFs = field(init=False)
    ssd: SmallFs = field(init=False)
    proxy: FaultProxy = field(init=False)
    metadata: MetadataServer = field(init=False)
    trainers: list[Trainer] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self.dir = self.root / self.name
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True)
        self.park = self.dir / "park"
        self.park.mkdir()
        self.marker = self.dir / "RAN-ATTACKER-CODE"  # created by the forged checkpoints' payload if unpickled
        self.config_file = self.dir / "trainer.toml"
        self.config_file.write_text(config())
        self.uri = run_uri(self.emulator, self.name)
        self.pd = SmallFs(self.dir / "pd", PD_BYTES, fstype="ext4")
        self.ssd = SmallFs(self.dir / "ssd", SSD_BYTES)
        self.proxy = FaultProxy(self.emulator.host)
        self.metadata = MetadataServer(instance_name=f"chaos-{self.name}")

    def __enter__(self) -> "Rig":
        self.pd.__enter__()
        self.ssd.__enter__()
        self.proxy.start()
        self.metadata.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for t in self.trainers:
            t.kill()
        self.proxy.stop()
        self.metadata.stop()
        self.ssd.__exit__(None, None, None)
        self.pd.__exit__(None, None, None)

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
              local: bool = True) -> Trainer:
        """A trainer of the job; ``park``: the steps it parks at (see drill.chaos.task)."""
        for k in park:
            (self.park / f"hold-{k}").touch()
            (self.park / f"parked-{k}").unlink(missing_ok=True)
        launcher = [sys.executable] if self.nproc == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
            f"--nproc-per-node={self.nproc}", "--max-restarts=0"]  # as trainer.sh runs it
        argv = [*launcher, "-m", "trainer", "run", "--run-dir", str(run_dir or self.run_dir),
                "--steps", str(STEPS), "--seed", "0", "--health-port", "0", "--config", str(self.config_file),
                "--task", TASK, "--gcs-uri", self.uri]
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

    def other_run(self, stop_at: int) -> str:
        """Another run of the same experiment (same task, settings, data and checkpoint key; its own
        prefix and run dir), run until it has saved ``stop_at`` on every tier (a pause, or the
        final step): the source of a replay. Not one of the cell's trainers. Its prefix."""
        uri = f"{self.uri}-other-run"
        run_dir = self.dir / "other-run"
        argv = [sys.executable, "-m", "trainer", "run", "--run-dir", str(run_dir), "--steps", str(STEPS), "--seed", "0",
                "--health-port", "0", "--config", str(self.config_file), "--task", TASK, "--gcs-uri", uri,
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

    def next_boot(self, *, blank_pd: bool = False) -> None:
        """What a preempted Spot VM's replacement finds: a blank local SSD, the metadata flag down,
        and its persistent disk (blank if ``blank_pd``)."""
        self.metadata.reset()
        self.ssd.__exit__(None, None, None)
        self.ssd.__enter__()
        if blank_pd:
            self.pd.__exit__(None, None, None)
            self.pd.__enter__()

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
