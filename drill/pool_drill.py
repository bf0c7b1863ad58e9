"""The multi-node preemption drill (`python -m drill --nodes N`): a pool, preempted worker by worker.

1. The experiment gets the drill's `[pool]` (min_nodes 1, max_nodes N, a free rendezvous port;
   its other pool settings are kept, a missing section gets the defaults) and its real scripts
   are rendered through `stacks.boot.boot_props()`, as the stack renders them. One rendering per
   node differs only in the health port: the drill's VMs share the host's network namespace.
2. N drill VMs (`drill.sandbox`) share one GCS emulator (the bucket) and each has its own
   metadata server (`spottrain-role` = coordinator on the first, worker on the others), its own
   checkpoint disk and host name. They share the host's network namespace, so each VM gets a
   loopback address of its own (127.0.1.N) and every VM's image has an /etc/hosts naming them
   all, and the coordinator's DNS name (`coordinator.<experiment>.spottrain.internal`, a private
   Cloud DNS record on GCP) as the coordinator's address. Until the rendered trainer.sh sets
   TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (see TORCH_RDZV_WORKAROUND), the VM image sets it.
3. The on-demand coordinator is never preempted. Each round waits until all N nodes train, then
   preempts one Spot worker the GCE way (metadata `preempted` TRUE, ACPI soft-off, hard off when
   the window closes): every rank stops at the same step and rank 0 saves it; the survivors
   re-form the world with N - 1 nodes and resume from exactly that step. Then the worker is
   brought back (a VM booting the same scripts): its agent joins, the coordinator's agent stops
   its ranks for the membership change (another coordinated save) and N nodes train again.
4. At the end the world-size path is read from the coordinator's log (each session's world size
   and restore step) and replayed on the host with `torchrun --standalone --nproc-per-node=WS`
   and `--stop-at-step` at each boundary; the drill's final model digest must equal that run's.

The drill waits on journal lines and unit events, never on sleeps; timeouts are failure guards.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from drill.drill import (PREEMPTED_RE, STEP_RE, UNIT, Deployment, DrillConfig, DrillFailure, Rendered, _f, check,
                         control_job, iam_line, project_fake, render)
from drill.gcs_emulator import StorageEmulator
from drill.net import free_port

#: The drill's rendezvous_last_call_s: after a preemption the survivors wait this long for more
#: nodes before they go on (the experiment's value, 30 s by default, would only slow the drill).
LAST_CALL_S = 5
#: Steps per preemption the pool drill needs at least: a worker must boot and rejoin before the end.
MIN_STEPS_PER_ROUND = 200
#: torch 2.13 bug: with the rendezvous TCPStore shared (its default), an agent that stays rank 0
#: keeps its first round's MASTER_ADDR and never writes it for a later round, so a node that
#: joins later (a worker coming back) waits for it and both agents fail after 60 s
#: (DistStoreError on .../MASTER_ADDR and .../role_info/N). Opting out rebuilds it every round.
TORCH_RDZV_WORKAROUND = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
START_RE = re.compile(r"\bevent=start steps=\d+ world_size=(\d+) node=(\S+) node_rank=(\d+) restart=(\d+)")
RESTORE_LINE_RE = re.compile(r"\bevent=restore step=(\d+)(?: tier=(\S+))?")
PAUSED_RE = r"event=paused step={} "


@dataclass(frozen=True)
class Session:
    """One trainer process on the coordinator (torchrun starts one per rendezvous round)."""

    world_size: int
    restart: int
    resumed_from: int
    tier: str | None
    t: float = 0.0
    """Wall time of its restore line in the coordinator's journal."""


@dataclass
class PoolPreemption:
    index: int
    worker: str
    """The preempted node's host name."""
    resumed_from: int
    """Step the full world resumed from before this preemption."""
    world_size_before: int
    target_step: int = 0
    notice_after_step: int = 0
    saved_step: int | None = None
    saved_on: str | None = None
    """The node whose rank 0 wrote the coordinated save."""
    save_s: float | None = None
    persistent_ok: bool | None = None
    gcs_ok: str | None = None
    worker_exit: int | None = None
    off_s: float = 0.0
    killed: bool = False
    restored_step: int | None = None
    """The survivors' restore step."""
    restored_tier: str | None = None
    world_size_after: int | None = None
    wiped_after: bool = False
    rejoin_saved_step: int | None = None
    """The coordinated save when the worker came back (the agents' membership change)."""
    rejoin_restored_step: int | None = None
    world_size_rejoined: int | None = None
    recovered_s: float | None = None
    """Notice -> the survivors' restore logged (their world re-formed, state loaded)."""
    rejoin_s: float | None = None
    """The worker's power-on -> all nodes' restore logged (boot, rendezvous, membership save)."""
    rejoin_boot_t: float = 0.0

    @property
    def steps_lost(self) -> int | None:
        if self.saved_step is None or self.restored_step is None:
            return None
        return self.saved_step - self.restored_step


@dataclass
class PoolDrillResult:
    config: DrillConfig
    reference_digest: str | None
    digest: str | None
    status: dict[str, Any]
    preemptions: list[PoolPreemption] = field(default_factory=list)
    sessions: list[Session] = field(default_factory=list)
    segments: list[tuple[int, int, int]] = field(default_factory=list)
    """(world size, from step, to step) of the world-size path, as replayed by the reference."""
    reference_s: float = 0.0
    drill_s: float = 0.0
    workdir: Path | None = None
    worker_group_sizes: list[int] = field(default_factory=list)
    """The workers' group's target size after every change (the finish scales it to zero)."""
    coordinator_status: str | None = None
    """The coordinator VM's status once the pool finished (the finish stops it: TERMINATED)."""
    refusals: list[tuple[str, str, str]] = field(default_factory=list)
    """Calls outside the synthesized stack's grants (Google would refuse them): none when healthy."""
    control_runs: list[int] = field(default_factory=list)
    """The exit status of each execution of the control job."""
    alerts: dict[str, dict[str, int]] = field(default_factory=dict)
    """Node -> the alert policies of the pool's synthesized stack that fire on what it shipped
    (`drill.alert_eval`: condition title -> entries counted)."""
    longest_session_s: dict[str, float] = field(default_factory=dict)
    """Node -> its longest trainer session, from the first to the last entry it shipped."""

    @property
    def ok(self) -> bool:
        return (self.digest is not None and self.digest == self.reference_digest and not self.refusals
                and not any(self.control_runs))


# --- the pool ------------------------------------------------------------------------------------
def drill_pool(cfg: DrillConfig) -> Any:
    """The `[pool]` the drill deploys: the experiment's own settings (or the defaults) with
    min_nodes 1 (the coordinator trains on alone while workers are away), max_nodes N and a
    free rendezvous port (drill runs and tests share the host's network)."""
    from stacks.experiment import Pool
    from stacks.load import load_file

    exp = load_file(cfg.experiment).spec
    own = exp.pool.model_dump() if exp.pool is not None else {}
    if own and not own.get("coordinator_trains", True):
        raise ValueError("pool.coordinator_trains: the multi-node drill needs a coordinator that trains")
    return Pool.model_validate({**own, "min_nodes": 1, "max_nodes": cfg.nodes, "coordinator": True,
                                "coordinator_trains": True, "rendezvous_port": free_port(),
                                "rendezvous_last_call_s": LAST_CALL_S})


def check_pool(cfg: DrillConfig) -> None:
    check(cfg)
    if not 2 <= cfg.nodes <= 4:
        raise ValueError(f"nodes: {cfg.nodes}; allowed: 1 (one VM) or 2 to 4 (a pool: a coordinator and workers)")
    if cfg.steps < MIN_STEPS_PER_ROUND * (cfg.preemptions + 1):
        raise ValueError(f"steps: {cfg.steps} is too few for {cfg.preemptions} preemption(s) of a pool (each worker "
                         f"must come back before the end); allowed: at least {MIN_STEPS_PER_ROUND * (cfg.preemptions + 1)}")


class Pool:
    """The deployed pool: one bucket, a coordinator and workers (`Deployment`s sharing it)."""

    def __init__(self, cfg: DrillConfig, root: Path, image: Path, say: Callable[[str], None]) -> None:
        from stacks import gcp_rules as R
        from stacks.pool import COORDINATOR, ROLE_KEY, WORKER

        self.cfg, self.say = cfg, say
        pool = drill_pool(cfg)
        self.rendered: list[Rendered] = [
            render(cfg, free_port(), trainer_source=image / "trainer", code_dir=root / "code", pool=pool)
            for _ in range(cfg.nodes)]
        r0 = self.rendered[0]
        self.name = r0.name
        self.coordinator_host = f"coordinator.{r0.name}.{R.POOL_DOMAIN}"
        names = [f"{self.name}-coordinator"] + [f"{self.name}-worker-{i}" for i in range(1, cfg.nodes)]
        # What the VMs' resolver answers on GCP: every VM's own name (internal DNS; torchrun and
        # gloo resolve it) and the coordinator's private DNS record. Here each VM gets an address
        # of its own on the loopback network (127.0.1.N): torchrun tells nodes apart by
        # (fully qualified host name, pid), and VMs in PID namespaces of their own have equal pids.
        self.addresses = {h: f"127.0.1.{i + 1}" for i, h in enumerate(names)}
        hosts = root / "hosts"
        base = Path("/etc/hosts").read_text() if Path("/etc/hosts").exists() else "127.0.0.1 localhost\n"
        hosts.write_text(base.rstrip("\n") + "\n" + "".join(f"{a} {h}\n" for h, a in self.addresses.items())
                         + f"{self.addresses[names[0]]} {self.coordinator_host}\n")
        self.gcs = StorageEmulator(r0.bucket, log=root / "gcs-emulator.log")
        # Until the rendered scripts set it themselves, the drill's VM image sets it for every
        # unit (systemd's DefaultEnvironment), and says so.
        self.workaround = {} if all(k in r0.startup for k in TORCH_RDZV_WORKAROUND) else dict(TORCH_RDZV_WORKAROUND)
        if self.workaround:
            say("pool drill: NOTE the rendered trainer.sh does not set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1; without it "
                "a worker coming back hangs the rendezvous (torch 2.13); the drill's VM image sets it for now")
        # The project's APIs, with the grants of the pool's synthesized stack: the nodes start the
        # control job when the job is done, which stops the coordinator and scales the workers'
        # group (as the stack creates them) to zero.
        target = r0.props.scale
        self.compute = project_fake(r0)
        self.control: Any = None
        if target is not None:
            zone = target.location.split("/", 1)[1]
            self.compute.add_group(target.groups[0], zone=zone, instances=tuple(names[1:]),
                                   target_size=len(names) - 1)
            self.compute.add_instance(zone, names[0])
        self.nodes: list[Deployment] = []
        for i, (rendered, host) in enumerate(zip(self.rendered, names)):
            role = COORDINATOR if i == 0 else WORKER
            self.nodes.append(Deployment(root / host, rendered, cfg, say, image, gcs=self.gcs, hostname=host,
                                         attributes={ROLE_KEY: role, "enable-guest-attributes": "TRUE"},
                                         image_files={"/etc/hosts": hosts}, unit_environment=self.workaround,
                                         compute=self.compute))
            if target is not None:  # its metadata says the id Compute lists (stop markers are bound to it)
                self.nodes[-1].metadata.set_value("instance/id", self.compute.instance(zone, host).id)
        self.offsets: dict[str, tuple[int, int]] = {}
        self.rejoin_marks: dict[str, int] = {}
        """Journal ends when the last preempted worker was booted again."""
        self._stack = contextlib.ExitStack()

    @property
    def coordinator(self) -> Deployment:
        return self.nodes[0]

    @property
    def workers(self) -> list[Deployment]:
        return self.nodes[1:]

    def __enter__(self) -> "Pool":
        self.gcs.start()
        self._stack.callback(self.gcs.stop)
        self.compute.start()
        self.control = control_job(self.compute, self.rendered, self.gcs.host, self.nodes[0].image)
        if self.control is not None:
            self.control.__enter__()
            self._stack.callback(self.control.__exit__)
        self._stack.callback(self.compute.stop)
        for node in self.nodes:
            self._stack.enter_context(node)
        for name, path in self.rendered[0].uploads:  # what `cdktn deploy` uploads, once
            self.coordinator.upload(name, path.read_bytes())
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def boot(self, node: Deployment) -> None:
        self.offsets[node.hostname] = node.boot()

    def journals(self) -> dict[str, str]:
        return {n.hostname: n.vm.journal() for n in self.nodes if n.vm is not None}

    def marks(self) -> dict[str, int]:
        """Where every journal ends now (for 'lines after this moment')."""
        return {k: len(v) for k, v in self.journals().items()}

    def find(self, regex: re.Pattern[str], since: dict[str, int],
             accept: Callable[[re.Match[str]], bool] = lambda m: True) -> tuple[str, re.Match[str]] | None:
        """The first line matching in any node's journal after `since`: (node, match)."""
        for host, text in self.journals().items():
            for line in text[since.get(host, 0):].splitlines():
                m = regex.search(line)
                if m and accept(m):
                    return host, m
        return None

    def wait(self, find: Callable[[], Any], what: str) -> Any:
        """Poll `find` until it answers; fail fast when the coordinator's boot or trainer failed,
        and after the guard."""
        deadline = time.monotonic() + self.cfg.guard_s
        c = self.coordinator
        while True:
            c.check_unit(self.offsets[c.hostname][1])
            hit = find()
            if hit is not None:
                return hit
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- {n.hostname}\n{n.vm.tail(25)}" for n in self.nodes if n.vm is not None)
                raise DrillFailure(f"no {what} within {self.cfg.guard_s:g}s; journal tails:\n{tails}")
            time.sleep(0.05)  # polling files the VMs append to; not a synchronisation sleep

    def sessions(self) -> list[Session]:
        """The coordinator's trainer sessions since its boot: world size and restore step each."""
        c = self.coordinator
        out, pending = [], None
        for line in c.vm.journal()[self.offsets[c.hostname][0]:].splitlines():
            m = START_RE.search(line)
            if m:
                pending = (int(m.group(1)), int(m.group(4)))
                continue
            m = RESTORE_LINE_RE.search(line)
            if m and pending is not None:
                out.append(Session(pending[0], pending[1], int(m.group(1)), m.group(2), _wall(line)))
                pending = None
        return out

    def wait_session(self, index: int, world_size: int) -> tuple[int, Session]:
        """The first coordinator session at or after `index` with `world_size` (and its index)."""
        c = self.coordinator

        def find() -> tuple[int, Session] | None:
            e0 = self.offsets[c.hostname][1]
            finished = any(ev["event"] == "unit-exited" and ev["unit"] == UNIT for ev in c.vm.events()[e0:])
            hit = next(((i, s) for i, s in enumerate(self.sessions()) if i >= index and s.world_size == world_size),
                       None)
            if hit is None and finished:
                raise DrillFailure(f"the coordinator's trainer ended before {world_size} node(s) trained together "
                                   f"(a worker came back too late: give the drill more --steps)")
            return hit
        return self.wait(find, f"session at world size {world_size}")

    def wait_unit_finished(self, node: Deployment) -> None:
        e0 = self.offsets[node.hostname][1]
        node.vm.wait_event(lambda ev: ev["event"] == "unit-exited" and ev["unit"] == UNIT and ev["status"] == 0,
                           self.cfg.guard_s, since=e0, check=lambda: node.check_unit(e0))


def _wall(journal_line: str) -> float:
    """The wall time a journal line was written (its first word, the journal's UTC stamp)."""
    stamp = journal_line.split(" ", 1)[0]
    return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc).timestamp()


# --- the drill -----------------------------------------------------------------------------------
def run_pool_drill(cfg: DrillConfig, say: Callable[[str], None] = print) -> PoolDrillResult:
    check_pool(cfg)
    workdir = Path(cfg.workdir) if cfg.workdir else Path(tempfile.mkdtemp(prefix="spottrain-pool-drill-"))
    workdir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(cfg.seed)
    n = cfg.nodes
    try:
        image = workdir / "image"
        shutil.copytree(cfg.trainer_source, image / "trainer", dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        t0 = time.monotonic()
        preemptions: list[PoolPreemption] = []
        with Pool(cfg, workdir / "pool", image, say) as pool:
            say(f"pool drill: experiment {pool.name}, {n} nodes (on-demand coordinator + {n - 1} Spot worker(s)), "
                f"{cfg.steps} steps, {cfg.preemptions} preemption(s) (seed {cfg.seed}), {cfg.window_s:g} s window; "
                f"rendezvous at {pool.coordinator_host} -> {pool.addresses[pool.coordinator.hostname]}")
            for node in pool.nodes:
                pool.boot(node)
            seen = 0
            for i in range(1, cfg.preemptions + 1):
                idx, full = pool.wait_session(seen, n)
                seen = idx + 1
                if preemptions:
                    _rejoined(pool, preemptions[-1], full, n)
                worker = pool.workers[(i - 1) % len(pool.workers)]
                p = PoolPreemption(index=i, worker=worker.hostname, resumed_from=full.resumed_from,
                                   world_size_before=n)
                seen = _preempt(pool, worker, p, cfg, rng, seen, say)
                preemptions.append(p)
                if i in cfg.wipe_disk_after:
                    worker.disk.blank()
                    p.wiped_after = True
                say(f"  {worker.hostname} comes back" + (" (recreated, blank disk)" if p.wiped_after else ""))
                pool.rejoin_marks = pool.marks()
                p.rejoin_boot_t = time.time()
                pool.boot(worker)
            if preemptions:
                idx, full = pool.wait_session(seen, n)
                _rejoined(pool, preemptions[-1], full, n)
            say("the pool trains to the end ...")
            for node in pool.nodes:
                pool.wait_unit_finished(node)
            # Every node's trainer.sh stopped paying (stop_paying.sh) before its unit ended: the
            # control job it started has stopped the coordinator and scaled the workers to zero.
            pool.compute.join_jobs()
            for node in pool.nodes:
                node.finished_guest_attributes = node.metadata.guest_attributes()
                node.vm.power_off(cfg.window_s)
            status = pool.coordinator.status()
            sessions = pool.sessions()
            drill_s = time.monotonic() - t0
            props = pool.rendered[0].props
            target = props.scale
            sizes = [n for _, n in pool.compute.group(target.groups[0]).history] if target else []
            coordinator = pool.compute.instance(pool.coordinator.zone, pool.coordinator.hostname).status \
                if target else None
            refusals = list(pool.compute.refusals)
            runs = [r.returncode for r in pool.control.runs] if pool.control is not None else []
            alerts, longest = watched(pool)
            say(f"the finished pool stopped paying: workers' group sizes {sizes}, coordinator {coordinator}")
        segments = world_size_path(sessions, cfg.steps)
        say("reference: the same world-size path, replayed with torchrun --standalone: "
            + ", ".join(f"{ws} rank(s) {a}->{b}" for ws, a, b in segments))
        t1 = time.monotonic()
        ref_digest = replay(segments, props, workdir / "reference", image, cfg.experiment)
        result = PoolDrillResult(cfg, ref_digest, status.get("model_digest"), status, preemptions, sessions,
                                 segments, time.monotonic() - t1, drill_s, workdir, sizes, coordinator, refusals, runs,
                                 alerts, longest)
        say(report(result))
        return result
    finally:
        if not cfg.keep and not cfg.workdir:
            shutil.rmtree(workdir, ignore_errors=True)


def watched(pool: Pool) -> tuple[dict[str, dict[str, int]], dict[str, float]]:
    """What each node's shipped entries raise among the pool stack's alert policies, and each
    node's longest trainer session (first to last entry of one `jsonPayload.session`)."""
    from drill.alert_eval import evaluate
    from drill.drill import stack_json
    from drill.fake_observability import parse_time

    stack = stack_json(pool.rendered[0])
    alerts: dict[str, dict[str, int]] = {}
    longest: dict[str, float] = {}
    for node in pool.nodes:
        alerts[node.hostname] = {t: len(o.entries) for t, o in evaluate(stack, node.observability).items() if o.fired}
        spans: dict[str, list[Any]] = {}
        for e in node.observability.matching('jsonPayload.source="trainer"'):
            session = e["jsonPayload"].get("session")
            if session:
                spans.setdefault(session, []).append(parse_time(e["timestamp"]))
        longest[node.hostname] = max(((max(ts) - min(ts)).total_seconds() for ts in spans.values()), default=0.0)
    return alerts, longest


def _preempt(pool: Pool, worker: Deployment, p: PoolPreemption, cfg: DrillConfig, rng: random.Random, seen: int,
             say: Callable[[str], None]) -> int:
    """Preempt `worker` once the full world passed a seeded step; the coordinator's next session index."""
    left = cfg.preemptions - p.index + 1
    span = (cfg.steps - p.resumed_from) / (left + 1)
    p.target_step = min(cfg.steps - 1, p.resumed_from + max(10, int(span * rng.uniform(0.2, 0.6))))
    since = pool.marks()
    _, m = pool.wait(lambda: pool.find(STEP_RE, since, lambda m: int(m.group(1)) >= p.target_step),
                     f"step {p.target_step}")
    p.notice_after_step = int(m.group(1))
    interval_s = 10 / max(float(m.group(3)), 1e-3)
    time.sleep(rng.uniform(0.0, 0.9) * interval_s)  # the injected randomness, not a synchronisation
    say(f"round {p.index}: {p.world_size_before} nodes resumed from step {p.resumed_from}; "
        f"preempting {worker.hostname} after step {p.notice_after_step} ...")
    since = pool.marks()
    e0 = len(worker.vm.events())
    t_notice = time.time()
    worker.metadata.preempt()
    off = worker.vm.power_off(cfg.window_s)
    p.off_s, p.killed = float(off["seconds"]), bool(off["killed"])
    for ev in worker.vm.events()[e0:]:
        if ev["event"] == "unit-exited" and ev["unit"] == UNIT and p.worker_exit is None:
            p.worker_exit = ev["status"] if ev["code"] == "exited" else -ev["status"]
    host, saved = pool.wait(lambda: pool.find(PREEMPTED_RE, since), "coordinated save (event=preempted)")
    p.saved_step, p.saved_on = int(saved.group(1)), host
    if saved.group(4):
        p.persistent_ok, p.gcs_ok, p.save_s = saved.group(2) == "1", saved.group(3), float(saved.group(4))
    idx, after = pool.wait_session(seen, p.world_size_before - 1)
    p.restored_step, p.restored_tier, p.world_size_after = after.resumed_from, after.tier, after.world_size
    p.recovered_s = after.t - t_notice
    say(f"  notice -> every rank stopped; {host} saved step {p.saved_step} in {_f(p.save_s)} s; "
        f"{p.worker_exit=}; VM off after {p.off_s:.1f} s" + (" (KILLED)" if p.killed else "")
        + f"; {after.world_size} node(s) resumed from step {after.resumed_from} ({after.tier or '-'}) "
        f"{p.recovered_s:.1f} s after the notice")
    return idx + 1


def _rejoined(pool: Pool, p: PoolPreemption, full: Session, n: int) -> None:
    found = pool.find(PREEMPTED_RE, pool.rejoin_marks)
    p.rejoin_saved_step = int(found[1].group(1)) if found else None
    p.rejoin_restored_step, p.world_size_rejoined = full.resumed_from, full.world_size
    p.rejoin_s = full.t - p.rejoin_boot_t
    pool.say(f"  {p.worker} rejoined: membership change saved step {p.rejoin_saved_step}; "
             f"{n} nodes resumed from step {full.resumed_from}, {p.rejoin_s:.1f} s after its power-on")


# --- the reference -------------------------------------------------------------------------------
def world_size_path(sessions: list[Session], steps: int) -> list[tuple[int, int, int]]:
    """(world size, from, to) per session that made progress: each ran from its restore step to
    the next session's restore step (the last to the end)."""
    out = []
    for i, s in enumerate(sessions):
        end = sessions[i + 1].resumed_from if i + 1 < len(sessions) else steps
        if end > s.resumed_from:
            out.append((s.world_size, s.resumed_from, end))
    return out


def replay(segments: list[tuple[int, int, int]], props: Any, run_dir: Path, image: Path, experiment: Path) -> str:
    """Train the same world-size path on the host (torchrun --standalone per segment, paused with
    --stop-at-step at each boundary, all in one run dir); the final model digest."""
    from stacks.experiment import code_path
    from stacks.load import load_file

    user_code = load_file(experiment).spec.trainer.code_dir
    paths = [str(image)] + ([str(code_path(user_code))] if user_code is not None else [])
    env = {k: v for k, v in os.environ.items() if k != "STORAGE_EMULATOR_HOST"}
    # The VMs' settings that touch the numbers (one CPU thread); no metadata server: off GCE.
    env.update(PYTHONPATH=os.pathsep.join(paths), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               GCE_METADATA_HOST=f"127.0.0.1:{free_port()}")
    from trainer.checkpoint.key import create

    run_dir.parent.mkdir(parents=True, exist_ok=True)
    key = run_dir.parent / "reference-checkpoint.key"  # its own key: never the operator's default
    create(key)
    args = ["--run-dir", str(run_dir), "--steps", str(props.steps), "--task", props.task, "--health-port", "0",
            "--checkpoint-key-file", str(key),
            *(["--parallelism", props.parallelism] if props.parallelism else []), *props.args]
    if props.config:  # the VMs' [trainer.config] (task_args, batch size: what changes the numbers),
        # without the sinks the stack adds for the VMs (Cloud Monitoring, unreachable off GCE)
        from stacks.load import tomllib
        from stacks.trainer_config import to_toml

        own = {k: v for k, v in tomllib.loads(props.config).items() if k != "sinks"}
        (run_dir.parent / "reference.toml").write_text(to_toml(own))
        args += ["--config", str(run_dir.parent / "reference.toml")]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    for k, (ws, _, end) in enumerate(segments):
        last = k == len(segments) - 1
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ws}",
                "-m", "trainer", "run", *args, *([] if last else ["--stop-at-step", str(end)])]
        out = subprocess.run(argv, env=env, cwd=image, capture_output=True, text=True, timeout=3600)
        log = out.stdout + out.stderr
        (run_dir.parent / f"segment-{k}.log").write_text(log)
        ok = (out.returncode == 0 and f"event=finished step={end}" in log) if last else \
            re.search(PAUSED_RE.format(end), log) is not None  # torchrun reports the pause (75) as a failure
        if not ok:
            raise DrillFailure(f"reference segment {k} ({ws} rank(s) to step {end}) failed "
                               f"({out.returncode}):\n{log[-4000:]}")
    out = subprocess.run([sys.executable, "-m", "trainer", "status", "--run-dir", str(run_dir), "--json",
                          "--checkpoint-key-file", str(key)],
                         env=env, cwd=image, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise DrillFailure(f"trainer status of the reference failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout)["model_digest"]


def report(r: PoolDrillResult) -> str:
    lines = ["", f"## Pool preemption drill ({r.config.nodes} nodes)", "",
             "| # | worker | world before | resumed from | notice after step | saved step (node) | save s | "
             "worker exit | VM off s | world after | restored step | steps lost | notice -> survivors restored s | "
             "rejoin saved | rejoin restored | world rejoined | power-on -> rejoined s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in r.preemptions:
        lines.append(f"| {p.index} | {p.worker} | {p.world_size_before} | {p.resumed_from} | {p.notice_after_step} | "
                     f"{p.saved_step} ({p.saved_on}) | {_f(p.save_s)} | {p.worker_exit} | {p.off_s:.2f}"
                     f"{' KILLED' if p.killed else ''} | {p.world_size_after} | {p.restored_step} | "
                     f"{p.steps_lost if p.steps_lost is not None else '-'} | {_f(p.recovered_s)} | "
                     f"{p.rejoin_saved_step} | {p.rejoin_restored_step} | {p.world_size_rejoined} | {_f(p.rejoin_s)} |")
    lines += ["", "world-size path (coordinator's sessions): "
              + " -> ".join(f"{ws}@{a}" for ws, a, _ in r.segments) + f" -> end {r.config.steps}"]
    g = r.status.get("goodput", {})
    if g:
        lines.append(f"goodput {100 * g.get('goodput', 0):.1f}% of {float(g.get('wall_s') or 0):.1f} s wall; "
                     f"finished {'yes' if g.get('finished') else 'no'}; per node: "
                     + ", ".join(f"{k}: {v.get('sessions')} session(s), {v.get('preemptions')} preemption(s)"
                                 for k, v in sorted((g.get("nodes") or {}).items())))
    same = r.digest is not None and r.digest == r.reference_digest
    lines += [f"reference digest {r.reference_digest}", f"drill digest     {r.digest}",
              f"digest {'MATCHES' if same else 'DIFFERS'}: drill {r.drill_s:.1f} s, reference replay {r.reference_s:.1f} s",
              f"stopped paying: workers' group sizes {r.worker_group_sizes}, coordinator {r.coordinator_status}",
              iam_line(r.refusals, r.control_runs)]
    for node, fired in sorted(r.alerts.items()):
        lines.append(f"alerts on {node}'s log (longest trainer session {r.longest_session_s.get(node, 0):.0f} s): "
                     + (", ".join(f"{t} ({n})" for t, n in sorted(fired.items())) or "none"))
    return "\n".join(lines)


__all__ = ["PoolDrillResult", "PoolPreemption", "Session", "check_pool", "drill_pool", "replay", "report",
           "run_pool_drill", "world_size_path"]
