"""The training loop: build the task, restore, train, checkpoint, stop cleanly on preemption.

Read ``run()`` top to bottom; the machinery sits behind small interfaces: ``Checkpointer``
(tiers, async saves, intervals), ``state`` (what exact resume needs), ``Preemption`` (the flag),
``Health``, ``Ledger`` (goodput), ``Progress`` (logs), ``World`` (DDP collectives), ``Batches``
(the data, loaded inline or by workers), ``Evaluator`` and ``Metrics`` (TensorBoard), ``lease``
(one trainer per run dir and per GCS prefix) and ``tier_wait`` (no decision while a tier is unknown).

Under torchrun on several nodes, each node's local rank 0 (its "leader") runs that VM's health
server, metadata watcher and goodput ledger; global rank 0 speaks for the job and saves DDP
checkpoints. Every decision that changes control flow (stop, save, pause) is agreed on by all
ranks in one small all-reduce per step, so a notice on any node stops every node at the same step.

The run is finished (exit 0) only once the final checkpoint is durable on every durable tier; a
pause exits 75 only once its checkpoint is. Both keep saving where a copy is missing until
``durable_timeout_s``, then exit 74; a notice meanwhile takes the emergency path.
"""
from __future__ import annotations

import contextlib
import logging
import os
import random
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch

from trainer import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_FINISHED, EXIT_NOT_DURABLE, EXIT_PREEMPTED, EXIT_UNAVAILABLE
from trainer import distributed, gpu, placement, startup_notice
from trainer.checkpoint import host_copy
from trainer.checkpoint import state_codec as plain
from trainer.loop import parallel, precision
from trainer.loop import state
from trainer.checkpoint import tier_wait
from trainer import task as tasks
from trainer.checkpoint.key import KeyProblem
from trainer.checkpoint.checkpointer import describe_failing
from trainer.config import RunConfig
from trainer.artifacts import Artifacts
from trainer.data.batches import Batches
from trainer.loop.evaluation import Evaluator
from trainer.distributed import node_name
from trainer.observe.goodput import report
from trainer.observe.ledger import Ledger, read_events, session_start_fields
from trainer.observe.health import Health, HealthServer, PortInUse
from trainer.loop.init_from import InitFromError
from trainer.checkpoint.lease import FollowerLease, Lease, LeaseHeld, RunDirBusy, RunDirLock, holder_id
from trainer.observe.tensorboard import Metrics, NoMetrics
from trainer.loop.preemption import Preemption
from trainer.observe.progress import Progress, setup_logging
from trainer.data.sampler import DataOrder


@dataclass
class Outcome:
    code: int
    steps_run: int = 0  # optimizer steps this session completed
    loop_s: float = 0.0  # wall seconds of the training loop (bench)
    loop_cpu_s: float = 0.0  # CPU seconds of this process (all threads) during the loop (bench)
    reason: str = ""  # why, for a bad-input exit


def run(cfg: RunConfig, *, make_checkpointer: Callable[..., Any] | None = None,
        process_start: float | None = None) -> Outcome:
    process_start = process_start or time.time()
    world = distributed.init(cfg.collective_timeout_s)
    log = setup_logging(world.rank)
    if not world.is_node_leader:  # rank 0 speaks for the job, leaders for their node; others warn
        logging.getLogger().setLevel(logging.WARNING)
    startup_notice.hold("run")  # a notice here is remembered by start-up's own handlers, and adopted:
    preempt = Preemption(log.getChild("preemption"))
    preempt.install_signal_handlers()
    session = _Session(cfg, world, log, preempt, make_checkpointer, process_start)
    try:
        return session.run()
    except (state.ResumeMismatch, tasks.TaskError, BadWorld, gpu.UnsupportedGpu, PortInUse, InitFromError,
            RunDirBusy, LeaseHeld, KeyProblem, plain.NotPlainData, precision.UnsupportedPrecision,
            host_copy.Unsupported) as e:
        log.error("event=failed reason=bad_input %s", e)
        session.record_failure("bad_input", str(e))
        return Outcome(EXIT_BAD_INPUT, reason=str(e))
    except tier_wait.StillUnknown as e:
        log.error("event=failed reason=tier_unknown %s", e)
        session.record_failure("tier_unknown", str(e))
        return Outcome(EXIT_UNAVAILABLE)
    except (tier_wait.Stopped, StoppedDuringStartup) as e:
        log.warning("event=preempted step=none detail=notice during start-up (%s); nothing was trained, "
                    "nothing to save", e)
        session.record_startup_stop()
        return Outcome(EXIT_PREEMPTED)
    except Exception as e:
        log.error("event=failed reason=exception\n%s", traceback.format_exc())
        session.record_failure("exception", f"{type(e).__name__}: {e}")
        return Outcome(EXIT_FAILED)
    finally:
        session.close()
        preempt.close()
        world.close()


class BadWorld(Exception):
    """The settings cannot run at this world size (bad input: exit 2)."""


class StoppedDuringStartup(Exception):
    """A preemption notice came before the loop: stop at once (nothing trained, nothing to save)."""


class _Session:
    def __init__(self, cfg: RunConfig, world: distributed.World, log: logging.Logger, preempt: Preemption,
                 make_checkpointer: Callable[..., Any] | None, process_start: float):
        self.cfg, self.world, self.log, self.preempt = cfg, world, log, preempt
        self.make_checkpointer = make_checkpointer or _default_checkpointer
        self.process_start = process_start
        self.ckpt: Any = None
        self.ledger: Ledger | None = None
        self.run_lock: RunDirLock | None = None
        self.lease: Lease | FollowerLease | None = None  # the job's writer lease on GCS
        self.lease_decided = False
        self.waited_s = 0.0  # start-up's wait for unknown tiers so far (one bound for all of it)
        self.batches: Batches | None = None
        self.metrics: Metrics | NoMetrics = NoMetrics()
        self.server: HealthServer | None = None
        self.artifacts: Artifacts | None = None  # node leaders: ctx.artifacts_dir and its GCS copy
        self.health = Health(cfg.stall_timeout_s, startup_grace_s=cfg.startup_grace_s)
        self.productive_s = 0.0
        self.start = self.done = 0  # the step this session restored, and how far it got
        self.stopping = False  # some rank got a preemption notice: every rank stops
        self.sharded = cfg.parallelism == "fsdp"  # FSDP2: every rank saves its own shard

    def run(self) -> Outcome:
        cfg, world, log = self.cfg, self.world, self.log
        t_start = time.monotonic()
        self._stop_if_noticed("session", "before the run was set up")
        torch.set_num_threads(cfg.threads)
        device = _device(cfg, world)
        gpu.check(device)  # a GPU this PyTorch has no kernels for: bad input, not a restart loop
        mixed = precision.setup(cfg.precision, device, cfg.source_of("precision"))
        if cfg.deterministic:
            _deterministic(device)

        try:
            accum = cfg.accum_steps(world.size)
        except ValueError as e:
            raise BadWorld(f"global_batch_size: {e}") from None

        self._lock_run_dir()
        # Sharded state: every rank writes its shard, so every rank has a checkpointer (made by all
        # ranks together: it opens a process group of its own).
        if self.sharded:
            self.ckpt = _sharded_checkpointer(cfg, world)
        # Machinery that one process per VM runs: health, the metadata watcher, the ledger, and a
        # checkpointer (rank 0's saves; every leader's tiers are offered at restore).
        if world.is_node_leader:
            if cfg.health_port is not None:
                self.server = HealthServer(self.health, host=cfg.health_host, port=cfg.health_port,
                                           request=cfg.health_request, log=log.getChild("health")).start()
            if cfg.watch_metadata:
                self.preempt.watch_metadata()
            if self.ckpt is None:
                self.ckpt = self.make_checkpointer(cfg)
            self.ledger = Ledger(cfg.run_dir, log=log.getChild("goodput"))  # mirrored once the lease is held
            if world.is_main:  # checkpoints per tier, for the timeline (`status --plot`)
                ledger = self.ledger
                self.ckpt.on_durable = lambda tier, step: ledger.append("durable", tier=tier, step=step)
            self.ckpt.on_tier_health = self._tier_health  # a tier that keeps failing: health, ledger
            self.health.degraded = lambda: describe_failing(self.ckpt.failing())
            self.ledger.append("session_start", **session_start_fields(
                self.process_start, price_per_hour=cfg.price_per_hour,
                on_demand_price_per_hour=cfg.on_demand_price_per_hour, main=world.is_main,
                world_size=world.size))
            if cfg.watch_metadata:  # where this session runs, for the time spent without a VM
                where = placement.read()
                if where is not None:
                    self.ledger.append("placement", **where)
        # The job's writer lease first: nothing writes the job's GCS prefix without it, and a GCS
        # this trainer cannot read yet is waited for (trainer.checkpoint.tier_wait), not skipped.
        self._until_known(self._take_lease)
        if world.is_node_leader:
            # The task's artifacts come back first: a task may read them while it builds.
            self.artifacts = Artifacts(cfg.run_dir / "artifacts", self._mirror(), staging=cfg.run_dir,
                                       log=log.getChild("artifacts"))
            self.artifacts.restore()
        world.barrier()
        self._stop_if_noticed("lease", "before the task was built")

        # Build the task: identical initial weights on every rank, then per-rank RNG streams.
        _seed(cfg.seed)
        ctx = tasks.TaskContext(seed=cfg.seed, steps=cfg.steps, device=device, rank=world.rank,
                                world_size=world.size, artifacts_dir=cfg.run_dir / "artifacts",
                                data_dir=cfg.data_dir)
        task = tasks.build(cfg.task, ctx, cfg.task_args)
        _seed((cfg.seed + 1_000_003 * world.rank) % 2**63)
        model = parallel.wrap(task.model, world, parallelism=cfg.parallelism, device=device, optimizer=task.optimizer)
        if self.ckpt is not None:
            self.ckpt.bind(model, task.optimizer)  # the sharded layout saves and loads them in place
        data = DataOrder(len(task.dataset), seed=cfg.seed, batch_size=cfg.batch_size,
                         rank=world.rank, world_size=world.size)
        self.batches = Batches(task.dataset, data, workers=cfg.data_workers, device=device, seed=cfg.seed,
                               log=log.getChild("data"))
        scaler = mixed.scaler
        fingerprint = cfg.fingerprint(dataset_len=len(task.dataset), device=device.type)
        if world.is_node_leader:
            log.info("event=start steps=%d world_size=%d node=%s node_rank=%d restart=%d accum=%d device=%s "
                     "task=%s %s", cfg.steps, world.size, node_name(), world.node_rank, world.restart_count,
                     accum, device, cfg.task, " ".join(f"{k}={v}" for k, v in task.info.items()))

        # Restore: the newest valid checkpoint any node holds; every rank gets the same state.
        # Not while a tier is unknown (it may hold the newest), nor without the job's GCS lease.
        t_restore = time.monotonic()
        saved, where = self._until_known(lambda: self._restore(model, task.optimizer))
        start = 0
        if saved is not None:
            steps_changed = self._check_settings(saved, fingerprint)
            whole = not self.sharded  # sharded weights are already in place
            start = state.apply(saved, model=model if whole else None, optimizer=task.optimizer if whole else None,
                                scheduler=task.scheduler, scaler=scaler, data=data, world=world,
                                steps_changed=steps_changed,
                                source=f"step {saved.get('step')} on {where[0]} ({where[1]})")
        elif cfg.init_from is not None:  # a new run seeded from another run's checkpoint
            fingerprint["init_from"] = self._init_from(model, task.optimizer)
        restore_s = time.monotonic() - t_restore
        self.start = self.done = start
        if world.is_node_leader:
            if saved is not None:
                log.info("event=restore step=%d tier=%s path=%s seconds=%.3f world_size=%d", start, where[0],
                         where[1], restore_s, world.size)
                before = state.saved_world_size(saved)
                if before != world.size:
                    log.warning("event=world_size_change step=%d from=%d to=%d consumed=%d (RNG streams "
                                "reseeded; the data position is in global samples)", start, before,
                                world.size, data.consumed)
            else:
                log.info("event=restore step=0 (no checkpoint: starting %s)",
                         "from init_from's weights" if cfg.init_from is not None else "fresh")
            self.ledger.append("restore", step=start, seconds=restore_s, world_size=world.size,
                               startup_s=max(0.0, time.time() - self.process_start - restore_s))
        if start >= cfg.steps:  # finished before: write the final checkpoint where a copy is missing
            return Outcome(self._final_save(start, model, task, scaler, data, fingerprint, again=True))
        startup_notice.hold("restore", lambda: self.preempt.requested)
        if world.any_flags(self.preempt.requested)[0]:  # a notice during start-up: nothing new to save
            return self._stop_before_training(start, restored=saved is not None)
        if cfg.stop_at_step is not None and start >= cfg.stop_at_step:
            if world.is_main:
                log.warning("event=stop_at_step stop_at_step=%d step=%d (already there: pausing at once)",
                            cfg.stop_at_step, start)
            return Outcome(self._pause(start, model, task, scaler, data, fingerprint))

        # The loop.
        self.preempt.step_completed(start)
        step_fn = _StepFn(cfg, accum, model, task, self.batches, mixed, device, world)
        evaluator = Evaluator(task, cfg, step_fn, world, sharded=self.sharded,
                              interrupted=lambda: self.preempt.requested)
        if world.is_main and cfg.tensorboard:
            self.metrics = Metrics(cfg.run_dir, start_step=start, store=self._mirror(), session=self.ledger.session,
                                   upload_every_s=cfg.metrics_upload_every_s, log=log.getChild("metrics"))
        progress = Progress(log, total_steps=cfg.steps, start_step=start, every=cfg.log_every_steps,
                            tokens_per_step=task.tokens_per_sample * cfg.batch_size * accum * world.size,
                            samples_per_step=cfg.batch_size * accum * world.size)
        last_progress_event = time.monotonic()
        t_loop, cpu_loop = time.monotonic(), time.process_time()
        done, lost = start, False
        for step in range(start, cfg.steps):
            t0 = time.monotonic()
            loss = step_fn()
            self.productive_s += time.monotonic() - t0
            done = self.done = step + 1
            self.preempt.step_completed(done)
            self.health.beat()
            if world.is_main:
                self.metrics.scalars(done, progress.update(done, loss, task.optimizer.param_groups[0]["lr"]))

            stop, due, lost = world.any_flags(self.preempt.requested, world.is_main and self.ckpt.due(done),
                                              self._lease_lost())
            self.stopping = stop
            if not (stop or lost) and evaluator.due(done):
                self._evaluate(done, evaluator)
            if stop or lost or done == cfg.steps or done == cfg.stop_at_step:
                break
            if due:
                self._save(done, model, task, scaler, data, fingerprint)
            if world.is_node_leader and time.monotonic() - last_progress_event >= cfg.progress_every_s:
                self._progress(done)
                last_progress_event = time.monotonic()
        loop_s, loop_cpu_s = time.monotonic() - t_loop, time.process_time() - cpu_loop
        progress.close()
        self.batches.stop()  # the workers' prefetch is no longer needed: nothing competes with the save

        if done < cfg.steps and self.stopping:
            saved = self._emergency_save(done, model, task, scaler, data, fingerprint)
            return Outcome(EXIT_FAILED if saved == "failed" else EXIT_PREEMPTED, done - start, loop_s, loop_cpu_s)
        if lost:
            why = self._stop_for_lost_lease(done, model, task, scaler, data, fingerprint)
            return Outcome(EXIT_BAD_INPUT, done - start, loop_s, loop_cpu_s, reason=why)
        if done < cfg.steps:
            code = self._pause(done, model, task, scaler, data, fingerprint)
            return Outcome(code, done - start, loop_s, loop_cpu_s)
        code = self._final_save(done, model, task, scaler, data, fingerprint)
        log.debug("session took %.1fs", time.monotonic() - t_start)
        return Outcome(code, done - start, loop_s, loop_cpu_s)

    def _evaluate(self, step: int, evaluator: Evaluator) -> None:
        result = evaluator()
        if result is None or not self.world.is_main:
            return
        values, batches, seconds = result
        self.log.info("event=eval step=%d %s batches=%d seconds=%.3f", step,
                      " ".join(f"{k}={v:.4f}" for k, v in values.items()), batches, seconds)
        self.metrics.scalars(step, {f"eval/{k}": v for k, v in values.items()})

    def _progress(self, step: int) -> None:
        """A progress event in the ledger; rank 0 also charts the job's goodput and cost so far."""
        self.ledger.append("progress", step=step, productive_s=self.productive_s)
        self._chart_goodput(step)

    def _chart_goodput(self, step: int) -> None:
        if self.world.is_main and self.ledger is not None and isinstance(self.metrics, Metrics):
            r = report(read_events(self.ledger.path))
            points = {"goodput/goodput": r.goodput}
            if r.cost.cost_so_far is not None:
                points["goodput/cost_usd"] = r.cost.cost_so_far
            self.metrics.scalars(step, points)

    def _state(self, step: int, model: Any, task: tasks.Task, scaler: Any, data: DataOrder,
               fingerprint: dict) -> dict | None:
        whole = not self.sharded  # sharded: only the replicated rest; the shards go by DCP
        return state.build(step=step, model=model if whole else None, optimizer=task.optimizer if whole else None,
                           scheduler=task.scheduler, scaler=scaler, data=data, fingerprint=fingerprint,
                           world=self.world)

    def _meta(self, fingerprint: dict) -> dict:
        return {"world_size": self.world.size, "fingerprint": fingerprint}

    def _check_settings(self, saved: dict, fingerprint: dict) -> bool:
        """The checkpoint's settings against this run's (exit 2 on a difference); True when the
        run's total steps changed (``extend_steps``). Keeps the run's provenance (``init_from``)."""
        step = int(saved["step"])
        change = state.check_fingerprint(saved["fingerprint"], fingerprint, step=step,
                                         extend_steps=self.cfg.extend_steps)
        if self.world.is_main:
            for note in state.unrecorded(saved["fingerprint"], fingerprint) + state.check_versions(saved):
                self.log.warning(note)
        if "init_from" in saved["fingerprint"]:
            fingerprint["init_from"] = saved["fingerprint"]["init_from"]
        if self.cfg.init_from is not None and self.world.is_main:
            self.log.info("event=init_from skipped=1 detail=the run has its own checkpoint (step %d) and resumes "
                          "from it; init_from applies only to a run without one", step)
        if change is not None and self.world.is_node_leader:
            self.log.warning("event=steps_changed step=%d from=%d to=%d (extend_steps)", step, *change)
            self.ledger.append("steps_changed", step=step, **{"from": change[0], "to": change[1]})
        return change is not None

    def _init_from(self, model: Any, optimizer: Any) -> dict:
        from trainer.loop import init_from

        prov = init_from.apply(self.cfg, self.world, model, optimizer,
                               sharded_run=self.ckpt if self.sharded else None, log=self.log.getChild("init_from"))
        if self.world.is_node_leader:
            self.log.info("event=init_from source=%s step=%d location=%s layout=%s optimizer=%d digest=%s",
                          prov["source"], prov["step"], prov["location"], prov["layout"], prov["optimizer"],
                          prov["digest"])
            self.ledger.append("init_from", **prov)
        return prov

    def _export(self, step: int) -> None:
        """A finished run's own export (once; see trainer.export); rank 0 alone."""
        if self.world.is_main:
            from trainer.export import auto_export

            auto_export(self.cfg, step, self.log.getChild("export"))

    # ------------------------------------------------------------------ who writes, and from where
    def _lock_run_dir(self) -> None:
        """Node leaders lock their run dir; a second trainer there stops every rank (exit 2)."""
        busy: RunDirBusy | None = None
        if self.world.is_node_leader:
            try:
                self.run_lock = RunDirLock(self.cfg.run_dir, self.log.getChild("lease")).acquire(self.process_start)
            except RunDirBusy as e:
                busy = e
            except OSError as e:  # no run dir at all: nothing on it to protect; the tiers report it
                self.log.warning("event=run_dir_lock ok=0 error=%r", e)
        if self.world.any_flags(busy is not None)[0]:
            raise busy or RunDirBusy("run_dir: another node's run dir is in use by another trainer (see its log)")

    def _mirror(self) -> Any:
        """The store the ledger, TensorBoard and the artifacts are mirrored to (the ``mirror``
        tier's), or None."""
        tier = self.ckpt.tiers.role("mirror") if self.ckpt is not None else None
        return tier.store if tier is not None else None

    def _install_lease(self) -> None:
        """Every remote store of this process asks the lease before it writes (refused until held);
        the lease lives on the ``lease`` tier."""
        tier = self.ckpt.tiers.role("lease") if self.ckpt is not None else None
        if tier is None or self.lease is not None:
            return
        if self.world.is_main:
            self.lease = Lease(tier.store, holder=holder_id(self.cfg.run_dir), started=self.process_start,
                               ttl_s=self.cfg.lease_ttl_s, log=self.log.getChild("lease"),
                               op_timeout_s=self._probe_s())
        else:
            self.lease = FollowerLease()
        for remote in self.ckpt.tiers.remotes:
            remote.store.guard = self.lease.check

    def _probe_s(self) -> float:
        """How long one look at a tier may take while start-up waits (a share of the wait)."""
        return min(60.0, max(1.0, self.cfg.wait_for_tiers_s / 4))

    def _take_lease(self) -> None:
        """Rank 0 takes the job's writer lease (once); every rank learns the outcome together."""
        if self.lease_decided or self.cfg.gcs_uri is None:
            return
        self._install_lease()
        outcome: tuple[str, Any] | None = None
        if self.world.is_main:
            lease = self.lease
            assert isinstance(lease, Lease)
            try:
                lease.acquire(sleep=self.preempt.wait, on_wait=self.health.waiting)
                outcome = ("held", None)
            except tier_wait.TierUnknown as e:
                outcome = ("unknown", e.tiers)
            except LeaseHeld as e:
                outcome = ("busy", str(e))
            except InterruptedError as e:
                outcome = ("stopped", str(e))
        outcome = self.world.broadcast(outcome)
        kind, detail = outcome if outcome is not None else ("held", None)
        if kind == "unknown":
            raise tier_wait.TierUnknown(detail)
        if kind == "busy":
            raise LeaseHeld(detail)
        if kind == "stopped":
            raise tier_wait.Stopped(detail)
        self.lease_decided = True
        if isinstance(self.lease, FollowerLease):
            self.lease.granted = True
        if isinstance(self.lease, Lease):
            self.lease.start()
        if self.ledger is not None and self._mirror() is not None:
            self.ledger.mirror_to(self._mirror())

    def _until_known(self, attempt: Callable[[], Any]) -> Any:
        """``attempt()`` (collective) once every configured tier it reads answers: the lease, then
        the restore, within one ``wait_for_tiers_s`` between them. See ``trainer.checkpoint.tier_wait``."""
        if self.ckpt is not None:
            self.ckpt.LIST_TIMEOUT_S = min(self.ckpt.LIST_TIMEOUT_S, self._probe_s())
        t0 = time.monotonic()
        try:
            return tier_wait.until_known(
                attempt, wait_s=self.cfg.wait_for_tiers_s, waited_before=self.waited_s, log=self.log,
                on_wait=self.health.waiting, sleep=self.preempt.wait, stop_requested=lambda: self.preempt.requested,
                agree=lambda give_up, stop: tuple(self.world.any_flags(give_up, stop)))  # type: ignore[arg-type]
        finally:
            self.waited_s += time.monotonic() - t0
            self.health.starting()

    def _lease_lost(self) -> bool:
        return self.lease is not None and self.lease.lost is not None

    def _stop_for_lost_lease(self, step: int, *args: Any) -> str:
        """Another trainer took the job's lease: no more GCS writes (the guard refuses them);
        this one saves to its own disks and stops, exit 2 (a human must choose); the reason."""
        taker = self.lease.lost if self.lease is not None else None
        if isinstance(self.lease, FollowerLease) and taker is None:
            self.lease.lose("another trainer (rank 0 saw it)")
        if self.world.is_main:
            self.log.error("event=stopped reason=lease_lost step=%d taker=%s (another trainer writes this job "
                           "now; this one saves step %d to its own disks only and exits 2)", step, taker, step)
        self._save_and_wait(step, *args)
        why = (f"gcs_uri: another trainer took this job's writer lease ({taker}); two trainers on one job "
               "would collide: stop one of them")
        self.record_failure("lease_lost", why)
        return why

    def _restore(self, model: Any, optimizer: Any) -> tuple[dict | None, tuple[str, str]]:
        """The newest valid checkpoint of the job, on every rank, and (tier, path) it came from.

        One process: its checkpointer restores. Several nodes: each node leader offers the newest
        step its own tiers hold (a node's disk may hold a checkpoint newer than GCS has: the
        previous rank 0 wrote it there before the world was re-formed), and the leader with the
        newest restores and broadcasts (rank 0 on a tie). Sharded: the sharded checkpointer loads
        every rank's shards in place (resharding) and hands out the replicated rest."""
        world = self.world
        if self.sharded or not world.distributed:  # the checkpointer restores (every rank, sharded)
            restored = self.ckpt.restore()
            return (restored.state, (restored.tier, restored.path)) if restored else (None, ("", ""))
        # Each leader offers its newest step, or the tiers it cannot read: then every rank waits.
        offer: tuple[str, Any] | None = None
        if self.ckpt is not None:
            try:
                offer = ("step", self.ckpt.newest_valid_step())
            except tier_wait.TierUnknown as e:
                offer = ("unknown", e.tiers)
        offers = world.all_gather(offer)
        unknown = {f"{t} (rank {r})": why for r, o in enumerate(offers) if o and o[0] == "unknown"
                   for t, why in o[1].items()}
        if unknown:
            raise tier_wait.TierUnknown(unknown)
        steps = [o[1] if o else None for o in offers]
        best = max((s for s in steps if s is not None), default=None)
        src = 0 if best is None or steps[0] == best else steps.index(best)
        payload: tuple[str, Any] | None = None
        if world.rank == src:
            try:
                restored = self.ckpt.restore()
            except tier_wait.TierUnknown as e:
                payload = ("unknown", e.tiers)
            except state.ResumeMismatch as e:  # every rank must hear it, or the others wait below
                payload = ("mismatch", str(e))
            else:
                payload = ("state", (restored.state, (restored.tier, f"{node_name()}:{restored.path}"))
                           if restored else None)
        payload = world.broadcast(payload, src=src)
        assert payload is not None
        if payload[0] == "unknown":
            raise tier_wait.TierUnknown(payload[1])
        if payload[0] == "mismatch":
            raise state.ResumeMismatch(payload[1])
        saved, where = payload[1] if payload[1] is not None else (None, ("", ""))
        if saved is not None and world.is_main and src != 0:
            self.ckpt.mark_restored(int(saved["step"]))
        return saved, where

    def _write(self, step: int, snapshot: dict | None, args: tuple, **kw: Any) -> float:
        """Hand ``snapshot`` to the checkpointer: rank 0 alone, or every rank (sharded)."""
        if self.sharded or self.world.is_main:
            return self.ckpt.save(step, snapshot, meta=self._meta(args[-1]), **kw)
        return 0.0

    def _save(self, step: int, *args: Any) -> None:
        snapshot = self._state(step, *args)
        blocked = self._write(step, snapshot, args)
        if not self.world.is_main:
            return
        self.log.info("event=checkpoint_save step=%d blocked_s=%.4f", step, blocked)
        self.ledger.append("checkpoint", step=step, blocked_s=blocked, productive_s=self.productive_s)
        self.artifacts.sync_soon(after=self.ckpt.wait)  # in the background, once the checkpoint is written

    def _final_save(self, step: int, *args: Any, again: bool = False) -> int:
        """The last checkpoint: the run is finished (exit 0, ``event=finished``) only once it is
        durable on every durable tier, else exit 74. A re-run of a finished job (``again``) saves
        it again, which writes it only where a copy is missing. A notice takes the emergency path,
        whose deadline holds here too."""
        t0 = time.monotonic()
        durable = None if self.stopping else self._save_durably(step, *args)
        if durable is None:  # a notice, during the last step or the save
            saved = self._emergency_save(step, *args)
            if saved != "complete":
                return EXIT_FAILED if saved == "failed" else EXIT_PREEMPTED  # the next run finishes it
        elif not durable.ok:
            return self._not_durable(step, durable, "the final checkpoint")
        elif self.world.is_main:
            self.artifacts.sync()
        if self.world.is_node_leader:
            self.ledger.append("finish", step=step, blocked_s=time.monotonic() - t0, productive_s=self.productive_s)
            self.log.info("event=finished step=%d%s", step, " (already complete)" if again else "")
        self.health.finished()
        self._export(step)
        return EXIT_FINISHED

    def _pause(self, step: int, *args: Any) -> int:
        """``stop_at_step`` reached: a checkpoint durable on every tier, then exit as if preempted."""
        t0 = time.monotonic()
        durable = self._save_durably(step, *args)
        if durable is None:  # a notice came meanwhile
            return EXIT_FAILED if self._emergency_save(step, *args) == "failed" else EXIT_PREEMPTED
        if not durable.ok:
            return self._not_durable(step, durable, "the pause's checkpoint")
        if self.world.is_main:
            self.artifacts.sync()
        if self.world.is_node_leader:
            self.ledger.append("paused", step=step, blocked_s=time.monotonic() - t0, productive_s=self.productive_s)
            self.log.warning("event=paused step=%d (stop_at_step; run again without it to continue)", step)
        return EXIT_PREEMPTED

    def _save_durably(self, step: int, *args: Any) -> Any:
        """Save ``step`` to every tier until it is durable on every durable tier (each attempt
        writes only the copies still missing) or ``durable_timeout_s`` has passed. Rank 0's
        verdict (a ``checkpointer.Durability``) on every rank, or None when a notice came first."""
        self.health.finishing(step)
        t0 = time.monotonic()
        deadline = t0 + self.cfg.durable_timeout_s
        delay = 1.0
        while True:
            self._write(step, self._state(step, *args), args, every_tier=True)
            notice, verdict = self._watched(lambda: self.ckpt.durable(step, deadline=deadline))
            if notice:
                return None
            if self.world.is_main:
                self.log.info("event=checkpoint_save step=%d blocked_s=%.4f final=1 durable=%d %s", step,
                              time.monotonic() - t0, verdict.ok, verdict.detail)
            if verdict.ok or time.monotonic() + delay >= deadline:
                return verdict
            if self.world.is_main:
                self.log.warning("event=not_durable_yet step=%d missing=%s; saving again in %.0fs", step,
                                 ",".join(verdict.missing), delay)
            if self._watched(lambda: time.sleep(delay))[0]:
                return None
            delay = min(2 * delay, 60.0)

    def _save_and_wait(self, step: int, *args: Any) -> None:
        """Save ``step`` to every tier and wait for the writes, without a durability verdict (the
        lost lease's save: the guard refuses its GCS copy)."""
        self._write(step, self._state(step, *args), args, every_tier=True)
        if self.sharded or self.world.is_main:
            self.ckpt.wait(timeout=self.cfg.durable_timeout_s)
        self.world.barrier()

    def _watched(self, work: Callable[[], Any]) -> tuple[bool, Any]:
        """``work`` on rank 0 (every rank when sharded) while every rank watches for a notice."""
        notice, out = self.world.run_watching(work if self.sharded or self.world.is_main else None,
                                              lambda: self.preempt.requested)
        self.stopping = self.stopping or notice
        return notice, out

    def _not_durable(self, step: int, durable: Any, what: str) -> int:
        detail = f"{what} (step {step}) is not durable after {self.cfg.durable_timeout_s:.0f}s: {durable.detail}"
        if self.world.is_main:
            self.log.error("event=not_durable step=%d detail=%s; exit %d: run the same command again, it "
                           "writes the missing copies", step, detail, EXIT_NOT_DURABLE)
        if self.world.is_node_leader:
            self.ledger.append("failed", reason="not_durable", detail=detail[:500])
        return EXIT_NOT_DURABLE

    def _emergency_save(self, step: int, *args: Any) -> str:
        """A notice on some node: the step in flight is done everywhere; make it durable within
        the budget of the node that got the earliest notice (its window closes first). Rank 0's
        verdict on every rank: "complete" (on every durable tier), "saved" (on a tier that
        outlives the VM) or "failed"."""
        t0 = time.monotonic()
        elapsed = self.world.max_float(self.preempt.seconds_since_notice())
        deadline = time.monotonic() + self.cfg.preemption_budget_s - elapsed
        if self.world.is_main:
            self.artifacts.abort()  # a copy in flight must not slow the checkpoint's upload
        snapshot = self._state(step, *args)
        verdict = "saved"
        if self.world.is_node_leader:
            self.ledger.append("preemption_notice", step=step, reason=self.preempt.reason or "another node")
        if self.sharded or self.world.is_main:  # sharded: every rank writes its shard
            report = self.ckpt.emergency_save(step, snapshot, deadline=deadline, meta=self._meta(args[-1]))
        if self.world.is_main:
            verdict = "complete" if report.complete else "saved" if report.saved else "failed"
            self.log.warning("event=preempted step=%d persistent_ok=%d gcs_ok=%s local_ok=%s seconds=%.3f detail=%s",
                             step, report.persistent_ok, report.gcs_ok, report.local_ok, report.seconds, report.detail)
        verdict = self.world.broadcast(verdict)
        if self.world.is_node_leader:
            extra = {"persistent_ok": report.persistent_ok, "gcs_ok": report.gcs_ok,
                     "local_ok": report.local_ok} if self.world.is_main else {}
            self.ledger.append("preempted", step=step, productive_s=self.productive_s,
                               blocked_s=time.monotonic() - t0, **extra)
            self.ledger.flush(deadline - time.monotonic())
        if self.world.is_main and deadline - time.monotonic() > 1.0:
            self.artifacts.sync(deadline)  # only with the time the checkpoint left over
        return verdict

    def _tier_health(self, tier: str, failing: dict | None) -> None:
        """A checkpoint tier started failing, failed again, or works again (``failing`` None)."""
        if failing is None:
            self.log.info("event=tier_ok tier=%s", tier)
            if self.ledger is not None:
                self.ledger.append("tier_ok", tier=tier)
            return
        self.log.warning("event=tier_failing tier=%s %s", tier, describe_failing({tier: failing}))
        if self.ledger is not None:
            self.ledger.append("tier_failing", tier=tier, **failing)

    def _stop_if_noticed(self, point: str, when: str) -> None:
        """A notice so far stops start-up here, every rank together: nothing was trained yet."""
        startup_notice.hold(point, lambda: self.preempt.requested)
        if self.world.any_flags(self.preempt.requested)[0]:
            raise StoppedDuringStartup(f"{self.preempt.reason or 'on another rank'} {when}")

    def record_startup_stop(self) -> None:
        """The ledger's record of a start-up a notice stopped (once the ledger is open)."""
        if self.ledger is not None:
            with contextlib.suppress(Exception):
                # No step: this session restored none (a ledger step is always a whole number).
                self.ledger.append("preemption_notice", reason=self.preempt.reason or "another node")
                self.ledger.append("preempted", blocked_s=0.0)

    def _stop_before_training(self, step: int, *, restored: bool) -> Outcome:
        if restored:
            self.log.warning("event=preempted step=%d detail=notice during start-up; checkpoint %d is already "
                             "durable", step, step)
        else:
            self.log.warning("event=preempted step=%d detail=notice during start-up; no checkpoint yet, nothing "
                             "was trained, nothing to save", step)
        if self.ledger is not None:
            self.ledger.append("preemption_notice", step=step, reason=self.preempt.reason)
            self.ledger.append("preempted", step=step, productive_s=0.0, blocked_s=0.0)
        return Outcome(EXIT_PREEMPTED)

    def record_failure(self, reason: str, detail: str) -> None:
        if self.ledger is not None:
            with contextlib.suppress(Exception):
                self.ledger.append("failed", reason=reason, detail=detail[:500])

    def close(self) -> None:
        if self.batches is not None:
            self.batches.close()
        if self.server is not None:
            self.server.close()
        if self.artifacts is not None:
            self.artifacts.close()
        # After a preemption notice the uploads, the mirrors and the lease get what is left of the
        # budget (an upload still running is then abandoned), the ledger first; otherwise they may
        # take their time (what is only in the run dir is lost with the disk).
        notice = self.preempt.notice_monotonic
        end = time.monotonic() + 30.0 if notice is None else notice + self.cfg.preemption_budget_s
        # After a notice the power-off comes whatever we wait for: an exit with its status beats
        # a SIGKILL, so nothing gets time past the budget (GCS down made each take its floor).
        floor = 1.0 if notice is None else 0.0
        if self.ckpt is not None:
            self.ckpt.on_tier_health = None  # an abandoned upload may still report after the ledger closed
            with contextlib.suppress(Exception):
                self.ckpt.close(timeout=self.cfg.durable_timeout_s if notice is None
                                else max(0.0, end - time.monotonic()))
        if self.done > self.start:
            with contextlib.suppress(Exception):
                self._chart_goodput(self.done)  # the session's last word: its goodput at its end
        if self.ledger is not None:
            if not self.ledger.close(timeout=max(floor, end - time.monotonic())):
                self.log.warning("event=ledger_mirror ok=0 detail=some goodput events reached only the run dir")
        if not self.metrics.close(timeout=max(floor, end - time.monotonic())):
            self.log.warning("event=metrics_upload ok=0 detail=the last TensorBoard points reached only the run dir")
        if self.lease is not None:  # the next trainer of the job takes over at once
            with contextlib.suppress(Exception):
                self.lease.release(timeout=max(floor, min(10.0, end - time.monotonic())))
        if self.run_lock is not None:
            self.run_lock.release()


class _StepFn:
    """One optimizer step: ``grad_accum_steps`` micro-batches, clipping, mixed precision."""

    def __init__(self, cfg: RunConfig, accum: int, model: torch.nn.Module, task: tasks.Task, batches: Batches,
                 mixed: precision.MixedPrecision, device: torch.device, world: distributed.World):
        self.cfg, self.accum, self.model, self.task, self.batches = cfg, accum, model, task, batches
        self.scaler, self.device, self.world = mixed.scaler, device, world
        self.loss_fn = task.loss_fn or (lambda m, batch: m(*batch))
        self.autocast: Callable[[], Any] = mixed.autocast

    def _sync(self, last: bool) -> Any:
        model = self.model
        if not self.world.distributed:
            return contextlib.nullcontext()
        if hasattr(model, "set_requires_gradient_sync"):  # FSDP2: a switch, not a context
            model.set_requires_gradient_sync(last)
            return contextlib.nullcontext()
        return contextlib.nullcontext() if last else model.no_sync()

    def __call__(self) -> float:
        accum, model, opt = self.accum, self.model, self.task.optimizer
        model.train()
        total = torch.zeros((), device=self.device)
        for micro in range(accum):
            batch = self.batches.next()
            last = micro == accum - 1
            # Under DDP/FSDP, reduce gradients only on the last micro-batch.
            with self._sync(last):
                with self.autocast():
                    loss = self.loss_fn(model, batch) / accum
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            total += loss.detach()
        if self.cfg.grad_clip is not None:
            if self.scaler:
                self.scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), self.cfg.grad_clip)
        if self.scaler:
            self.scaler.step(opt)
            self.scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        if self.task.scheduler is not None:
            self.task.scheduler.step()
        return float(total)


def _seed(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def _deterministic(device: torch.device) -> None:
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    else:
        # Same switch without the public function's import of the compiler's config, which costs
        # more than a second of start-up on every restart.
        setter = getattr(torch._C, "_set_deterministic_algorithms", None)
        if setter is not None:
            setter(True, warn_only=True)
        else:
            torch.use_deterministic_algorithms(True, warn_only=True)


def _device(cfg: RunConfig, world: distributed.World) -> torch.device:
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", world.local_rank)
    return torch.device("cpu")


def _sharded_checkpointer(cfg: RunConfig, world: distributed.World) -> Any:
    from trainer.checkpoint.checkpointer import Checkpointer
    from trainer.checkpoint.sharded import Sharded

    why = host_copy.unavailable()
    if why is not None:  # every rank has the same PyTorch: every rank refuses, before any collective
        raise host_copy.Unsupported(f"{cfg.source_of('parallelism')}: parallelism: 'fsdp' cannot run here: "
                                    f"{why}; allowed: 'ddp', or an image with a newer PyTorch")
    key = cfg.checkpoint_key()
    if key is None:
        from trainer.checkpoint.sharded import NEEDS_KEY

        raise KeyProblem(NEEDS_KEY)  # before the collective that builds the layout's groups
    return Checkpointer(cfg.tier_table(), Sharded(world, run_dir=cfg.run_dir,
                                                  collective_timeout_s=cfg.collective_timeout_s),
                        key=key, mtbf_s=cfg.mtbf_s, log=logging.getLogger("trainer.checkpoint"))


def _default_checkpointer(cfg: RunConfig) -> Any:
    from trainer.checkpoint.checkpointer import Checkpointer

    return Checkpointer(cfg.tier_table(), key=cfg.checkpoint_key(), mtbf_s=cfg.mtbf_s,
                        log=logging.getLogger("trainer.checkpoint"))
