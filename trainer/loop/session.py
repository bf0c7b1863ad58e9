"""One session of the job (one trainer process): what ``trainer.train.train`` drives, and what it
holds until it closes.

It owns the session's parts and their order: the start-up rule (a notice stops start-up at each
stage; a tier that cannot be read is waited for, ``trainer.checkpoint.tier_wait``), the machinery
one process per VM runs (the health server, the metadata watcher, the checkpointer, the sinks of the
run's events), the job's writers (``trainer.loop.writers``), building the task, the restore
(``trainer.loop.restore``) and putting its state back, the events of the loop, and closing
everything in the order the shutdown window allows.

Under torchrun on several nodes, each node's local rank 0 (its "leader") runs that VM's health
server, metadata watcher and goodput ledger; global rank 0 speaks for the job and saves
whole-model checkpoints (every rank saves its shard with the sharded layout).
"""
from __future__ import annotations

import logging
import os
import random
import time
from typing import Any, Callable, Sized, cast

import torch

from trainer import gpu, startup_notice
from trainer.cloud import vm_info
from trainer import task as tasks
from trainer.artifacts import Artifacts
from trainer.checkpoint import tier_wait
from trainer.checkpoint.checkpointer import describe_failing
from trainer.data.batches import Batches, WorkersDied
from trainer.data.sampler import DataOrder
from trainer.data.streaming import Stream
from trainer.distributed import World, node_name
from trainer.loop import parallel, precision, restore, rollback, state
from trainer.loop.finish import Finish
from trainer.loop.named_state import NamedStates
from trainer.loop.step import Job
from trainer.loop.writers import Writers
from trainer.observe import sinks
from trainer.observe.bus import Bus, SinkContext
from trainer.observe.events import (CapacityWait, CheckpointDurable, DataWorkersDied, Eval, Failed, Goodput, InitFrom,
                                    Notice, Preempted, Progress, Restored, SessionStarted, Stalled, Step, StepsChanged,
                                    TierFailing, TierOk, CheckpointsSetAside)
from trainer.observe.health import Health, HealthServer
from trainer.observe.ledger import new_session_id, session_start_fields
from trainer.observe.progress import Heartbeat, StepWindow


class BadWorld(Exception):
    """The settings cannot run at this world size (bad input: exit 2)."""


class StoppedDuringStartup(Exception):
    """A preemption notice came before the loop: stop at once (nothing trained, nothing to save)."""


class Session:
    def __init__(self, cfg: Any, world: World, log: logging.Logger, preempt: Any,
                 make_checkpointer: Callable[[Any], Any], process_start: float) -> None:
        self.cfg, self.world, self.log, self.preempt = cfg, world, log, preempt
        self.make_checkpointer, self.process_start = make_checkpointer, process_start
        # The process's start on the monotonic clock: the wall clock measures only the moments
        # before this one; a clock step after it changes no duration.
        self._mono_start = time.monotonic() - max(0.0, time.time() - process_start)
        self.session = new_session_id()
        self.context = SinkContext(cfg=cfg, run_dir=cfg.run_dir, session=self.session, rank=world.rank,
                                   is_main=world.is_main, is_node_leader=world.is_node_leader, log=log)
        self.bus = Bus(sinks.build(self.context, {}, only=("log",)), log=log)  # the log line from the first moment
        self.health = Health(cfg.stall_timeout_s, startup_grace_s=cfg.startup_grace_s)
        self.writers = Writers(cfg, world, log.getChild("lease"), started=process_start)
        self.ckpt: Any = None
        self.server: HealthServer | None = None
        self.artifacts: Artifacts | None = None  # node leaders: ctx.artifacts_dir and its remote copy
        self.batches: Batches | Stream | None = None
        self.finish: Finish | None = None
        self.waited_s = 0.0  # start-up's wait for unknown tiers so far (one bound for all of it)
        self.productive_s = 0.0
        self.start = self.done = 0  # the step this session restored, and how far it got
        self.restored = False  # it continues from a checkpoint (not step 0 or init_from's weights)
        self._window: StepWindow | None = None
        self._heartbeat: Heartbeat | None = None
        self._progress_at = time.monotonic()
        #: (cost so far, max_usd) once rank 0 saw the spend cap reached (``spend_cap``)
        self.capped: tuple[float, float] | None = None

    # ------------------------------------------------------------------ start-up
    def stop_if_noticed(self, point: str, when: str) -> None:
        """A notice so far stops start-up here, every rank together: nothing was trained yet."""
        startup_notice.hold(point, lambda: self.preempt.requested)
        if self.world.any_flags(self.preempt.requested)[0]:
            raise StoppedDuringStartup(f"{self.preempt.reason or 'on another rank'} {when}")

    def _probe_s(self) -> float:
        """How long one look at a tier may take while start-up waits (a share of the wait)."""
        return min(60.0, max(1.0, self.cfg.wait_for_tiers_s / 4))

    def until_known(self, attempt: Callable[[], Any]) -> Any:
        """``attempt()`` (collective) once every configured tier it reads answers: the lease, then
        the restore, within one ``wait_for_tiers_s`` between them (``trainer.checkpoint.tier_wait``)."""
        if self.ckpt is not None:
            self.ckpt.LIST_TIMEOUT_S = min(self.ckpt.LIST_TIMEOUT_S, self._probe_s())
        t0 = time.monotonic()
        try:
            return tier_wait.until_known(
                attempt, wait_s=self.cfg.wait_for_tiers_s, waited_before=self.waited_s, log=self.log,
                on_wait=self.health.waiting, sleep=self.preempt.wait, stop_requested=lambda: self.preempt.requested,
                agree=lambda give_up, stop: _pair(self.world.any_flags(give_up, stop)))
        finally:
            self.waited_s += time.monotonic() - t0
            self.health.starting()

    def hardware(self) -> tuple[torch.device, Any, int]:
        """The device, its mixed precision and the micro-batches per step at this world size."""
        cfg, world = self.cfg, self.world
        torch.set_num_threads(cfg.threads)
        device = (torch.device("cuda", world.local_rank)
                  if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()) else torch.device("cpu"))
        gpu.check(device)  # a GPU this PyTorch has no kernels for: bad input, not a restart loop
        mixed = precision.setup(cfg.precision, device, cfg.source_of("precision"))
        if cfg.deterministic:
            _deterministic(device)
        try:
            return device, mixed, cfg.accum_steps(world.size)
        except ValueError as e:
            raise BadWorld(f"global_batch_size: {e}") from None

    def open(self, sharded_checkpointer: Callable[[], Any]) -> None:
        """The run dir's lock; the checkpointer (every rank's when sharded, as they make it
        together); on each node leader the machinery one process per VM runs."""
        cfg, world, log = self.cfg, self.world, self.log
        self.writers.lock()
        if cfg.parallelism == "fsdp":
            self.ckpt = sharded_checkpointer()
        if not world.is_node_leader:
            return
        if cfg.health_port is not None:
            self.server = HealthServer(self.health, host=cfg.health_host, port=cfg.health_port,
                                       request=cfg.health_request, log=log.getChild("health")).start()
        if cfg.watch_metadata:
            self.preempt.watch_metadata()
        if self.ckpt is None:
            self.ckpt = self.make_checkpointer(cfg)
        for sink in sinks.build(self.context, cfg.sinks, only=None, skip=("log",)):
            self.bus.add(sink)
        if world.is_main:  # checkpoints per tier, for the timeline (`status --plot`)
            self.ckpt.on_durable = lambda tier, step: self.bus.emit(CheckpointDurable(tier, step))
        self.ckpt.on_tier_health = self._tier_health  # a tier that keeps failing: health, events
        self.health.degraded = lambda: describe_failing(self.ckpt.failing())
        self.health.on_stalled = lambda step, seconds: self.bus.emit(Stalled(step, seconds))
        self.health.watch()
        self.bus.emit(SessionStarted(**session_start_fields(
            self.process_start, price_per_hour=cfg.price_per_hour, on_demand_price_per_hour=cfg.on_demand_price_per_hour,
            main=world.is_main, world_size=world.size)))
        if cfg.watch_metadata:  # where this session runs, for the time spent without a VM
            where = vm_info.read()
            if where is not None:
                self.bus.emit(CapacityWait(**where, waited_s=_waited(cfg.run_dir, where.get("boot_time"),
                                                                      self.session)))

    def _tier_health(self, tier: str, failing: dict | None) -> None:
        """A checkpoint tier started failing, failed again, or works again (``failing`` None)."""
        self.bus.emit(TierOk(tier) if failing is None else TierFailing(tier, failing["since"], failing["failures"],
                                                                        failing["error"]))

    def take_lease(self) -> None:
        """The job's writer lease (nothing writes the job's remote tiers without it; a tier this
        trainer cannot read yet is waited for, not skipped); then the mirrors may start, and the
        task's artifacts come back (a task may read them while it builds)."""
        tiers = self.ckpt.tiers if self.ckpt is not None else None
        held = self.until_known(lambda: self.writers.take(tiers, sleep=self.preempt.wait, on_wait=self.health.waiting,
                                                          op_timeout_s=self._probe_s()))
        mirror = tiers.role("mirror") if tiers is not None else None
        if held and mirror is not None:
            self.bus.mirror_to(mirror.store)
        if self.world.is_node_leader:
            self.artifacts = Artifacts(self.cfg.run_dir / "artifacts", mirror.store if mirror is not None else None,
                                       staging=self.cfg.run_dir, log=self.log.getChild("artifacts"))
            self.artifacts.restore()
        self.world.barrier()
        self.stop_if_noticed("lease", "before the task was built")

    # ------------------------------------------------------------------ the job
    def build(self, device: torch.device, mixed: Any, accum: int) -> Job:
        """The task: identical initial weights on every rank, then per-rank RNG streams; the model
        under the run's parallelism, the data order and the batches."""
        cfg, world = self.cfg, self.world
        _seed(cfg.seed)
        ctx = tasks.TaskContext(seed=cfg.seed, steps=cfg.steps, device=device, rank=world.rank,
                                world_size=world.size, artifacts_dir=cfg.run_dir / "artifacts", data_dir=cfg.data_dir,
                                data_url=cfg.data_url)
        task = tasks.build(cfg.task, ctx, cfg.task_args)
        _seed((cfg.seed + 1_000_003 * world.rank) % 2**63)
        where = f"task {cfg.task}"
        states = NamedStates.declare(task.states, where=where, optimizers=[task.optimizer])
        states.check(where)
        if tasks.streaming(task.dataset):
            self.batches = Stream(task.dataset, batch_size=cfg.batch_size, workers=cfg.data_workers, device=device,
                                  seed=cfg.seed, log=self.log.getChild("data"))
            data: Any = self.batches
        else:
            data = DataOrder(len(cast(Sized, task.dataset)), seed=cfg.seed, batch_size=cfg.batch_size, rank=world.rank,
                             world_size=world.size)
            self.batches = Batches(task.dataset, data, workers=cfg.data_workers, device=device, seed=cfg.seed,
                                   log=self.log.getChild("data"), on_died=self._workers_died)
        job = self.adopt(task, states, data, self.batches, device=device, mixed=mixed, accum=accum,
                         dataset_len=getattr(data, "n", None), where=where)
        self.log_start(job, device, f"task={cfg.task} " + " ".join(f"{k}={v}" for k, v in task.info.items()))
        return job

    def adopt(self, task: tasks.Task, states: NamedStates, data: Any, batches: Any, *, device: torch.device,
              mixed: Any, accum: int, dataset_len: int | None, where: str,
              wrapped: dict[str, torch.nn.Module] | None = None) -> Job:
        """The job as the loop trains it: the main model and every other trained model under the
        run's parallelism (DDP on several ranks), bound to the checkpointer, and the session's saves
        and ends for it (``finish``). ``wrapped``: the trained models as an own loop wrapped them
        itself (``trainer.run``)."""
        cfg, world = self.cfg, self.world
        optimized = {id(p) for opt in [task.optimizer, *states.optimizers().values()]
                     for g in opt.param_groups for p in g["params"]}
        trained = states.trained_models(optimized)
        # Under fsdp every model among the states is sharded too (trained ones with their
        # optimizer), and the sharded layout saves their shards beside the main model's.
        plan = states.shard_plan(task.model, task.optimizer, where) if cfg.parallelism == "fsdp" else {}
        if wrapped is not None:
            models = dict(wrapped)
        else:
            models = {"model": parallel.wrap(task.model, world, parallelism=cfg.parallelism, device=device,
                                             optimizer=task.optimizer)}
            for n, (m, _, opt) in plan.items():
                sharded = parallel.shard(m, world, optimizer=opt)
                if n in trained:
                    models[n] = sharded
            models.update({n: parallel.wrap(m, world, parallelism="ddp", device=device, optimizer=None)
                           for n, m in trained.items() if n not in plan})
        model = models["model"]
        if self.ckpt is not None:  # the sharded layout saves and loads them in place
            self.ckpt.bind(model, task.optimizer, named=plan)
        fingerprint = cfg.fingerprint(dataset_len=dataset_len, device=device.type)
        if states.objects:
            fingerprint["states"] = states.fingerprint()
        if getattr(data, "per_rank", False):  # a stream's split over workers is its order: it must not change
            fingerprint["stream_workers"] = cfg.data_workers
        job = Job(task, model, data, batches, mixed.scaler, fingerprint, accum, world,
                  in_place=cfg.parallelism == "fsdp", states=states, models=models)
        if self.ckpt is not None:
            job.before_update = self.ckpt.before_update
        self.finish = Finish(cfg, world, self.log, ckpt=self.ckpt, job=job, bus=self.bus, health=self.health,
                             preempt=self.preempt, artifacts=self.artifacts, writers=self.writers,
                             productive=lambda: self.productive_s)
        return job

    def log_start(self, job: Job, device: torch.device, what: str) -> None:
        """The session's ``event=start`` line (node leaders), and the settings that change training
        whatever the job's code says, with where each came from (docs/porting.md)."""
        cfg, world = self.cfg, self.world
        if not world.is_node_leader:
            return
        self.log.info("event=start steps=%d world_size=%d node=%s node_rank=%d restart=%d accum=%d device=%s %s",
                      cfg.steps, world.size, node_name(), world.node_rank, world.restart_count, job.accum,
                      device, what)
        if cfg.script is None:
            self.log.info("event=training_settings grad_clip=%s (%s) precision=%s (%s) grad_accum_steps=%d "
                          "(the trainer applies these to the task's step)", cfg.grad_clip, cfg.source_of("grad_clip"),
                          cfg.precision, cfg.source_of("precision"), job.accum)
        else:
            self.log.info("event=training_settings precision=%s (%s; run.autocast()) (an own loop clips, scales and "
                          "accumulates itself: grad_clip is not applied)", cfg.precision, cfg.source_of("precision"))

    def restore(self, job: Job) -> int:
        """The newest valid checkpoint any node holds, on every rank (not while a tier is unknown:
        it may hold the newest), put back into the job; else ``init_from``'s weights; the step to
        continue from."""
        cfg, world = self.cfg, self.world
        t0 = time.monotonic()
        saved, (tier, path) = self.until_known(lambda: restore.newest(self.ckpt, world))
        self._refuse_rollback(saved)
        aside = self.ckpt.set_aside if self.ckpt is not None else None
        if aside is not None and world.is_main:  # the restore that set them aside ran on rank 0
            self.bus.emit(CheckpointsSetAside(aside.saved_before, list(aside.steps), "; ".join(aside.found)[:3000],
                                              aside.record[:1000]))
        start = 0
        if saved is not None:
            steps_changed = self._check_settings(saved, job.fingerprint)
            whole = not job.in_place  # sharded weights are already in place
            start = state.apply(saved, model=job.model if whole else None,
                                optimizer=job.task.optimizer if whole else None, scheduler=job.task.scheduler,
                                scaler=job.scaler, data=job.data, world=world, steps_changed=steps_changed,
                                source=f"step {saved.get('step')} on {tier} ({path})", states=job.states)
        elif cfg.init_from is not None:  # a new run seeded from another run's checkpoint
            job.fingerprint["init_from"] = self._init_from(job)
        seconds = time.monotonic() - t0
        self.start = self.done = start
        self.restored = saved is not None
        if world.is_node_leader:
            if saved is not None and state.saved_world_size(saved) != world.size:
                self.log.warning("event=world_size_change step=%d from=%d to=%d consumed=%d (RNG streams reseeded; "
                                 "the data position is in global samples)", start, state.saved_world_size(saved),
                                 world.size, getattr(job.data, "consumed", 0))
            self.bus.emit(Restored(start, seconds, world.size, max(0.0, time.monotonic() - self._mono_start - seconds),
                                   tier=tier if saved is not None else "", path=path if saved is not None else "",
                                   fresh_from="from init_from's weights" if cfg.init_from is not None else "fresh"))
        task, batch = job.task, int(job.fingerprint.get("batch_size", cfg.batch_size))  # an own loop's run.batches
        self._window = StepWindow(total_steps=cfg.steps, start_step=start, every=cfg.log_every_steps,
                                  tokens_per_step=task.tokens_per_sample * batch * job.accum * world.size,
                                  samples_per_step=batch * job.accum * world.size)
        self.preempt.step_completed(start)
        self._progress_at = time.monotonic()
        return start

    def _refuse_rollback(self, saved: dict | None) -> None:
        """Exit 2 on every rank when the restore went back past a step this run recorded durable
        in its bucket (``trainer.loop.rollback``)."""
        why = None
        if self.world.is_main and self.ckpt is not None:
            why, note = rollback.refusal(self.cfg.run_dir, restored_step=None if saved is None else int(saved["step"]),
                                         steps_seen=self.ckpt.steps_seen, tiers=[t.name for t in self.ckpt.tiers],
                                         allow=self.cfg.allow_rollback)
            if note is not None:
                self.log.warning(note)
        why = self.world.broadcast(why)
        if why is not None:
            raise state.ResumeMismatch(why)

    def _check_settings(self, saved: dict, fingerprint: dict) -> bool:
        """The checkpoint's settings against this run's (exit 2 on a difference); True when the
        run's total steps changed (``extend_steps``). Keeps the run's provenance (``init_from``)."""
        step = int(saved["step"])
        change = state.check_fingerprint(saved["fingerprint"], fingerprint, step=step, extend_steps=self.cfg.extend_steps)
        if self.world.is_main:
            for note in state.unrecorded(saved["fingerprint"], fingerprint) + state.check_versions(saved):
                self.log.warning(note)
        if "init_from" in saved["fingerprint"]:
            fingerprint["init_from"] = saved["fingerprint"]["init_from"]
        if self.cfg.init_from is not None and self.world.is_main:
            self.log.info("event=init_from skipped=1 detail=the run has its own checkpoint (step %d) and resumes "
                          "from it; init_from applies only to a run without one", step)
        if change is not None and self.world.is_node_leader:
            self.bus.emit(StepsChanged(step, *change))
        return change is not None

    def _init_from(self, job: Job) -> dict:
        from trainer.loop import init_from

        prov = init_from.apply(self.cfg, self.world, job.model, job.task.optimizer,
                               sharded_run=self.ckpt if job.in_place else None, log=self.log.getChild("init_from"))
        if self.world.is_node_leader:
            self.bus.emit(InitFrom(**prov))
        return prov

    def noticed_before_training(self, start: int) -> bool:
        """A notice during start-up stops the session before a step: nothing new to save."""
        startup_notice.hold("restore", lambda: self.preempt.requested)
        if not self.world.any_flags(self.preempt.requested)[0]:
            return False
        why = (f"notice during start-up; checkpoint {start} is already durable" if self.restored else
               "notice during start-up; no checkpoint yet, nothing was trained, nothing to save")
        self.bus.emit(Notice(self.preempt.reason, start))
        self.bus.emit(Preempted(start, 0.0, 0.0, detail=why))
        return True

    # ------------------------------------------------------------------ the loop's events
    def completed(self, step: int, loss: float, lr: float, metrics: dict[str, float]) -> None:
        """Step ``step`` is done: the health beat, the notice's step, the ``Step`` event (rank 0)."""
        self.done = step
        self.preempt.step_completed(step)
        self.health.beat(step)
        if self.world.is_main:
            window = self._window.add(step, loss, lr, metrics) if self._window is not None else None
            self.bus.emit(Step(step, self.cfg.steps, loss, lr, metrics, window))
        elif self.world.is_node_leader:  # another node of a pool: its own shipper's stall clock
            if self._heartbeat is None:
                self._heartbeat = Heartbeat(self.log, self.cfg.heartbeat_every_s)
            self._heartbeat.beat(step)

    def _workers_died(self, died: WorkersDied) -> None:
        """This rank's data workers died inside step ``done + 1`` (restarted at the position, or
        given up: the loop sees ``batches.failure`` after the step)."""
        self.bus.emit(DataWorkersDied(self.done, died.consumed, died.describe(), died.deaths, died.restarted))

    def evaluated(self, step: int, result: Any) -> None:
        if result is not None and self.world.is_main:
            values, batches, seconds = result
            self.bus.emit(Eval(step, values, batches, seconds))

    def progress(self, step: int, *, final: bool = False) -> None:
        """Every ``progress_every_s`` (node leaders): where the session stands, and on rank 0 the
        job's goodput so far. ``final``: the session's last word, goodput only."""
        if not final:
            if not self.world.is_node_leader or time.monotonic() - self._progress_at < self.cfg.progress_every_s:
                return
            self._progress_at = time.monotonic()
            self.bus.emit(Progress(step, self.productive_s))
        if self.world.is_main and (self.bus.wants(Goodput) or self.cfg.max_usd is not None):
            r = self._report()
            if self.bus.wants(Goodput):
                self.bus.emit(Goodput(step, r.goodput, r.cost.cost_so_far, r.cost.on_demand_equivalent))
            self._check_cap(r.cost.cost_so_far)

    def _report(self) -> Any:
        from trainer.observe.goodput import report
        from trainer.observe.ledger import LEDGER_DIR, LEDGER_FILE, read_events

        return report(read_events(self.cfg.run_dir / LEDGER_DIR / LEDGER_FILE))

    def _check_cap(self, cost: float | None) -> None:
        cap = self.cfg.max_usd
        if self.capped is None and cap is not None and cost is not None and cost >= cap:
            self.capped = (cost, cap)

    def spend_cap(self, *, check: bool = False) -> tuple[float, float] | None:
        """(cost so far, ``max_usd``) on every rank when the spend cap is reached, else None.
        ``check``: rank 0 reads the ledger now (at start; the loop's ``progress`` does it every
        ``progress_every_s``). Every rank must call it together."""
        if check and self.world.is_main and self.cfg.max_usd is not None:
            cost = self._report().cost.cost_so_far
            if cost is None:
                self.log.warning("event=max_usd_unknown max_usd=%.4f (no price_per_hour in the ledger: the cost, "
                                 "and so the spend cap, is unknown)", self.cfg.max_usd)
            self._check_cap(cost)
        return self.world.broadcast(self.capped)

    def loop_over(self) -> None:
        if self.batches is not None:
            self.batches.stop()  # the workers' prefetch is no longer needed: nothing competes with the save

    # ------------------------------------------------------------------ how it ends
    def failed(self, reason: str, detail: str, trace: str = "") -> None:
        self.bus.emit(Failed(reason, detail, trace=trace))

    def stopped_during_startup(self, why: str) -> None:
        self.bus.emit(Notice(self.preempt.reason or "another node"))
        self.bus.emit(Preempted(detail=f"notice during start-up ({why}); nothing was trained, nothing to save"))

    def close(self) -> None:
        if self.batches is not None:
            self.batches.close()
        self.health.close()
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
            self.ckpt.on_tier_health = None  # an abandoned upload may still report after the sinks closed
            try:
                self.ckpt.close(timeout=self.cfg.durable_timeout_s if notice is None
                                else max(0.0, end - time.monotonic()))
            except Exception:  # noqa: BLE001
                pass
        if self.done > self.start:
            try:
                self.progress(self.done, final=True)  # the session's last word: its goodput at its end
            except Exception:  # noqa: BLE001
                pass
        self.bus.close(end, floor=floor)
        self.writers.release(timeout=max(floor, min(10.0, end - time.monotonic())))


def _waited(run_dir: Any, boot_time: float | None, session: str) -> float | None:
    """Seconds between the previous session's last event in this run dir's ledger and this VM's
    boot (the time the job had no VM), or None when either is unknown."""
    if boot_time is None:
        return None
    from trainer.observe.ledger import LEDGER_DIR, LEDGER_FILE, read_events

    before = [float(e["t"]) for e in read_events(run_dir / LEDGER_DIR / LEDGER_FILE) if e["session"] != session]
    return max(0.0, float(boot_time) - max(before)) if before else None


def _pair(flags: list[bool]) -> tuple[bool, bool]:
    give_up, stop = flags
    return give_up, stop


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
