"""The training loop: build the task, restore, train, checkpoint, stop cleanly on preemption.

Read ``run()`` top to bottom; the machinery sits behind small interfaces: ``Checkpointer``
(tiers, async saves, intervals), ``state`` (what exact resume needs), ``Preemption`` (the flag),
``Health``, ``Ledger`` (goodput), ``Progress`` (logs) and ``World`` (DDP collectives).

Under torchrun on several nodes, each node's local rank 0 (its "leader") runs that VM's health
server, metadata watcher and goodput ledger; global rank 0 speaks for the job and saves DDP
checkpoints. Every decision that changes control flow (stop, save, pause) is agreed on by all
ranks in one small all-reduce per step, so a notice on any node stops every node at the same step.
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

from trainer import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_FINISHED, EXIT_PREEMPTED
from trainer import distributed, gpu, placement, plain, state
from trainer import task as tasks
from trainer.checkpoint_key import KeyProblem
from trainer.config import RunConfig
from trainer.artifacts import Artifacts
from trainer.goodput import Ledger, node_name, session_start_fields
from trainer.health import Health, HealthServer, PortInUse
from trainer.init_from import InitFromError
from trainer.preemption import Preemption
from trainer.progress import Progress, setup_logging
from trainer.sampler import DataOrder


@dataclass
class Outcome:
    code: int
    steps_run: int = 0  # optimizer steps this session completed
    loop_s: float = 0.0  # wall seconds of the training loop (bench)
    reason: str = ""  # why, for a bad-input exit


def run(cfg: RunConfig, *, make_checkpointer: Callable[..., Any] | None = None,
        process_start: float | None = None) -> Outcome:
    process_start = process_start or time.time()
    world = distributed.init(cfg.collective_timeout_s)
    log = setup_logging(world.rank)
    if not world.is_node_leader:  # rank 0 speaks for the job, leaders for their node; others warn
        logging.getLogger().setLevel(logging.WARNING)
    preempt = Preemption(log.getChild("preemption"))
    preempt.install_signal_handlers()
    session = _Session(cfg, world, log, preempt, make_checkpointer, process_start)
    try:
        return session.run()
    except (state.ResumeMismatch, tasks.TaskError, BadWorld, gpu.UnsupportedGpu, PortInUse, InitFromError,
            KeyProblem, plain.NotPlainData) as e:
        log.error("event=failed reason=bad_input %s", e)
        session.record_failure("bad_input", str(e))
        return Outcome(EXIT_BAD_INPUT, reason=str(e))
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


class _Session:
    def __init__(self, cfg: RunConfig, world: distributed.World, log: logging.Logger, preempt: Preemption,
                 make_checkpointer: Callable[..., Any] | None, process_start: float):
        self.cfg, self.world, self.log, self.preempt = cfg, world, log, preempt
        self.make_checkpointer = make_checkpointer or _default_checkpointer
        self.process_start = process_start
        self.ckpt: Any = None
        self.ledger: Ledger | None = None
        self.server: HealthServer | None = None
        self.artifacts: Artifacts | None = None  # node leaders: ctx.artifacts_dir and its GCS copy
        self.health = Health(cfg.stall_timeout_s)
        self.productive_s = 0.0
        self.stopping = False  # some rank got a preemption notice: every rank stops
        self.sharded = cfg.parallelism == "fsdp"  # FSDP2: every rank saves its own shard

    def run(self) -> Outcome:
        cfg, world, log = self.cfg, self.world, self.log
        t_start = time.monotonic()
        torch.set_num_threads(cfg.threads)
        device = _device(cfg, world)
        gpu.check(device)  # a GPU this PyTorch has no kernels for: bad input, not a restart loop
        if cfg.deterministic:
            _deterministic(device)

        try:
            accum = cfg.accum_steps(world.size)
        except ValueError as e:
            raise BadWorld(f"global_batch_size: {e}") from None

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
            self.ledger = Ledger(cfg.run_dir, store=self.ckpt.gcs, log=log.getChild("goodput"))
            self.ledger.append("session_start", **session_start_fields(
                self.process_start, price_per_hour=cfg.price_per_hour,
                on_demand_price_per_hour=cfg.on_demand_price_per_hour, main=world.is_main,
                world_size=world.size))
            if cfg.watch_metadata:  # where this session runs, for the time spent without a VM
                where = placement.read()
                if where is not None:
                    self.ledger.append("placement", **where)
            # The task's artifacts come back first: a task may read them while it builds.
            self.artifacts = Artifacts(cfg.run_dir / "artifacts", self.ckpt.gcs, staging=cfg.run_dir,
                                       log=log.getChild("artifacts"))
            self.artifacts.restore()
        world.barrier()

        # Build the task: identical initial weights on every rank, then per-rank RNG streams.
        _seed(cfg.seed)
        ctx = tasks.TaskContext(seed=cfg.seed, steps=cfg.steps, device=device, rank=world.rank,
                                world_size=world.size, artifacts_dir=cfg.run_dir / "artifacts",
                                data_dir=cfg.data_dir)
        task = tasks.build(cfg.task, ctx, cfg.task_args)
        _seed((cfg.seed + 1_000_003 * world.rank) % 2**63)
        model = task.model
        if self.sharded:
            from trainer.sharded import shard

            model = shard(model, world, optimizer=task.optimizer)
        elif world.distributed:
            model = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[device.index] if device.type == "cuda" else None)
        data = DataOrder(len(task.dataset), seed=cfg.seed, batch_size=cfg.batch_size,
                         rank=world.rank, world_size=world.size)
        scaler = torch.amp.GradScaler("cuda") if device.type == "cuda" and cfg.precision == "fp16" else None
        fingerprint = cfg.fingerprint(dataset_len=len(task.dataset))
        if world.is_node_leader:
            log.info("event=start steps=%d world_size=%d node=%s node_rank=%d restart=%d accum=%d device=%s "
                     "task=%s %s", cfg.steps, world.size, node_name(), world.node_rank, world.restart_count,
                     accum, device, cfg.task, " ".join(f"{k}={v}" for k, v in task.info.items()))

        # Restore: the newest valid checkpoint any node holds; every rank gets the same state.
        t_restore = time.monotonic()
        saved, where = self._restore(model, task.optimizer)
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
        if start >= cfg.steps:
            log.info("event=finished step=%d (already complete)", start)
            if world.is_node_leader:
                self.ledger.append("finish", step=start, blocked_s=0.0, productive_s=0.0)
            self.health.finished()
            self._export(start)  # once: a no-op when the finished run's export is already there
            return Outcome(EXIT_FINISHED)
        if world.any_flags(self.preempt.requested)[0]:  # a notice during start-up: nothing new to save
            return self._stop_before_training(start)

        # The loop.
        self.preempt.step_completed(start)
        step_fn = _StepFn(cfg, accum, model, task, data, scaler, device, world)
        progress = Progress(log, total_steps=cfg.steps, start_step=start, every=cfg.log_every_steps,
                            tokens_per_step=task.tokens_per_sample * cfg.batch_size * accum * world.size)
        last_progress_event = time.monotonic()
        t_loop = time.monotonic()
        done = start
        for step in range(start, cfg.steps):
            t0 = time.monotonic()
            loss = step_fn()
            self.productive_s += time.monotonic() - t0
            done = step + 1
            self.preempt.step_completed(done)
            self.health.beat()
            if world.is_main:
                progress.update(done, loss, task.optimizer.param_groups[0]["lr"])

            stop, due = world.any_flags(self.preempt.requested, world.is_main and self.ckpt.due(done))
            self.stopping = stop
            if stop or done == cfg.steps or done == cfg.stop_at_step:
                break
            if due:
                self._save(done, model, task, scaler, data, fingerprint)
            if world.is_node_leader and time.monotonic() - last_progress_event >= cfg.progress_every_s:
                self.ledger.append("progress", step=done, productive_s=self.productive_s)
                last_progress_event = time.monotonic()
        loop_s = time.monotonic() - t_loop
        progress.close()

        if done < cfg.steps and self.stopping:
            code = self._emergency_save(done, model, task, scaler, data, fingerprint)
            return Outcome(code, done - start, loop_s)
        if done < cfg.steps:
            code = self._pause(done, model, task, scaler, data, fingerprint)
            return Outcome(code, done - start, loop_s)
        code = self._final_save(done, model, task, scaler, data, fingerprint)
        log.debug("session took %.1fs", time.monotonic() - t_start)
        return Outcome(code, done - start, loop_s)

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
        from trainer import init_from

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

    def _restore(self, model: Any, optimizer: Any) -> tuple[dict | None, tuple[str, str]]:
        """The newest valid checkpoint of the job, on every rank, and (tier, path) it came from.

        One process: its checkpointer restores. Several nodes: each node leader offers the newest
        step its own tiers hold (a node's disk may hold a checkpoint newer than GCS has: the
        previous rank 0 wrote it there before the world was re-formed), and the leader with the
        newest restores and broadcasts (rank 0 on a tie). Sharded: the sharded checkpointer loads
        every rank's shards in place (resharding) and hands out the replicated rest."""
        world = self.world
        if self.sharded:
            restored = self.ckpt.restore(model, optimizer)
            return (restored.state, (restored.tier, restored.path)) if restored else (None, ("", ""))
        if not world.distributed:
            restored = self.ckpt.restore()
            return (restored.state, (restored.tier, restored.path)) if restored else (None, ("", ""))
        offers = world.all_gather(self.ckpt.newest_valid_step() if self.ckpt is not None else None)
        best = max((s for s in offers if s is not None), default=None)
        src = 0 if best is None or offers[0] == best else offers.index(best)
        mismatch = None
        try:
            restored = self.ckpt.restore() if world.rank == src else None
        except state.ResumeMismatch as e:  # every rank must hear it, or the others wait below
            restored, mismatch = None, str(e)
        payload = world.broadcast(mismatch or (
            (restored.state, (restored.tier, f"{node_name()}:{restored.path}")) if restored else None), src=src)
        if isinstance(payload, str):
            raise state.ResumeMismatch(payload)
        saved, where = payload if payload is not None else (None, ("", ""))
        if saved is not None and world.is_main and src != 0:
            self.ckpt.mark_restored(int(saved["step"]))
        return saved, where

    def _write(self, step: int, snapshot: dict | None, args: tuple, **kw: Any) -> float:
        """Hand ``snapshot`` to the checkpointer: rank 0 alone, or every rank (sharded)."""
        if self.sharded:
            return self.ckpt.save(step, args[0], args[1].optimizer, extras=snapshot, meta=self._meta(args[-1]), **kw)
        if self.world.is_main:
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

    def _final_save(self, step: int, *args: Any) -> int:
        if self.stopping:  # the notice came during the last step: the deadline still holds
            return EXIT_FINISHED if self._emergency_save(step, *args) == EXIT_PREEMPTED else EXIT_FAILED
        blocked = self._save_and_wait(step, *args)
        if self.world.is_main:
            self.artifacts.sync()
        if self.world.is_node_leader:
            self.ledger.append("finish", step=step, blocked_s=blocked, productive_s=self.productive_s)
            self.log.info("event=finished step=%d", step)
        self.health.finished()
        self._export(step)
        return EXIT_FINISHED

    def _pause(self, step: int, *args: Any) -> int:
        """``stop_at_step`` reached: a checkpoint on every tier, then exit as if preempted."""
        blocked = self._save_and_wait(step, *args)
        if self.world.is_main:
            self.artifacts.sync()
        if self.world.is_node_leader:
            self.ledger.append("paused", step=step, blocked_s=blocked, productive_s=self.productive_s)
            self.log.warning("event=paused step=%d (stop_at_step; run again without it to continue)", step)
        return EXIT_PREEMPTED

    def _save_and_wait(self, step: int, *args: Any) -> float:
        """Save ``step`` to every tier and wait until it is durable; the seconds it took."""
        t0 = time.monotonic()
        snapshot = self._state(step, *args)
        self._write(step, snapshot, args, every_tier=True)
        if self.sharded or self.world.is_main:
            self.ckpt.wait()
        if self.world.is_main:
            self.log.info("event=checkpoint_save step=%d blocked_s=%.4f final=1", step, time.monotonic() - t0)
        self.world.barrier()
        return time.monotonic() - t0

    def _emergency_save(self, step: int, *args: Any) -> int:
        """A notice on some node: the step in flight is done everywhere; make it durable within
        the budget of the node that got the earliest notice (its window closes first)."""
        t0 = time.monotonic()
        elapsed = self.world.max_float(self.preempt.seconds_since_notice())
        deadline = time.monotonic() + self.cfg.preemption_budget_s - elapsed
        if self.world.is_main:
            self.artifacts.abort()  # a copy in flight must not slow the checkpoint's upload
        snapshot = self._state(step, *args)
        ok = True
        if self.world.is_node_leader:
            self.ledger.append("preemption_notice", step=step, reason=self.preempt.reason or "another node")
        if self.sharded:  # every rank writes its shard
            report = self.ckpt.emergency_save(step, args[0], args[1].optimizer, extras=snapshot,
                                              deadline=deadline, meta=self._meta(args[-1]))
        elif self.world.is_main:
            report = self.ckpt.emergency_save(step, snapshot, deadline=deadline, meta=self._meta(args[-1]))
        if self.world.is_main:
            ok = report.persistent_ok or bool(report.gcs_ok)
            self.log.warning("event=preempted step=%d persistent_ok=%d gcs_ok=%s seconds=%.3f detail=%s",
                             step, report.persistent_ok, report.gcs_ok, report.seconds, report.detail)
        ok = self.world.broadcast(ok)
        if self.world.is_node_leader:
            extra = {"persistent_ok": report.persistent_ok, "gcs_ok": report.gcs_ok} if self.world.is_main else {}
            self.ledger.append("preempted", step=step, productive_s=self.productive_s,
                               blocked_s=time.monotonic() - t0, **extra)
            self.ledger.flush(deadline - time.monotonic())
        if self.world.is_main and deadline - time.monotonic() > 1.0:
            self.artifacts.sync(deadline)  # only with the time the checkpoint left over
        return EXIT_PREEMPTED if ok else EXIT_FAILED

    def _stop_before_training(self, step: int) -> Outcome:
        self.log.warning("event=preempted step=%d detail=notice during start-up; checkpoint %d is already durable",
                         step, step)
        if self.ledger is not None:
            self.ledger.append("preemption_notice", step=step, reason=self.preempt.reason)
            self.ledger.append("preempted", step=step, productive_s=0.0, blocked_s=0.0)
        return Outcome(EXIT_PREEMPTED)

    def record_failure(self, reason: str, detail: str) -> None:
        if self.ledger is not None:
            with contextlib.suppress(Exception):
                self.ledger.append("failed", reason=reason, detail=detail[:500])

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.artifacts is not None:
            self.artifacts.close()
        if self.ckpt is not None:
            with contextlib.suppress(Exception):
                self.ckpt.close()
        if self.ledger is not None:
            # After a preemption notice the mirror gets what is left of the budget; otherwise
            # it may take its time (events only in the run dir are lost with the disk).
            notice = self.preempt.notice_monotonic
            budget = 30.0 if notice is None else notice + self.cfg.preemption_budget_s - time.monotonic()
            if not self.ledger.close(timeout=max(1.0, budget)):
                self.log.warning("event=ledger_mirror ok=0 detail=some goodput events reached only the run dir")


class _StepFn:
    """One optimizer step: ``grad_accum_steps`` micro-batches, clipping, mixed precision."""

    def __init__(self, cfg: RunConfig, accum: int, model: torch.nn.Module, task: tasks.Task, data: DataOrder,
                 scaler: Any, device: torch.device, world: distributed.World):
        self.cfg, self.accum, self.model, self.task, self.data = cfg, accum, model, task, data
        self.scaler, self.device, self.world = scaler, device, world
        self.loss_fn = task.loss_fn or (lambda m, batch: m(*batch))
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision)
        if device.type == "cuda" and dtype is not None:
            self.autocast: Callable[[], Any] = lambda: torch.autocast("cuda", dtype=dtype)
        else:
            self.autocast = contextlib.nullcontext

    def _sync(self, last: bool) -> Any:
        model = self.model
        if not self.world.distributed:
            return contextlib.nullcontext()
        if hasattr(model, "set_requires_gradient_sync"):  # FSDP2: a switch, not a context
            model.set_requires_gradient_sync(last)
            return contextlib.nullcontext()
        return contextlib.nullcontext() if last else model.no_sync()

    def _batch(self) -> tuple:
        samples = [self.task.dataset[i] for i in self.data.next_indices()]
        batch = torch.utils.data.default_collate(samples)
        batch = tuple(batch) if isinstance(batch, (list, tuple)) else (batch,)
        return tuple(b.to(self.device, non_blocking=True) if torch.is_tensor(b) else b for b in batch)

    def __call__(self) -> float:
        accum, model, opt = self.accum, self.model, self.task.optimizer
        model.train()
        total = torch.zeros((), device=self.device)
        for micro in range(accum):
            batch = self._batch()
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
    from trainer.sharded import ShardedCheckpointer

    return ShardedCheckpointer(run_dir=cfg.run_dir, local_dir=cfg.local_dir, gcs_uri=cfg.gcs_uri,
                               policies=cfg.tier_policies(), mtbf_s=cfg.mtbf_s, world=world,
                               log=logging.getLogger("trainer.checkpoint"),
                               collective_timeout_s=cfg.collective_timeout_s, key=cfg.checkpoint_key())


def _default_checkpointer(cfg: RunConfig) -> Any:
    from trainer.checkpointer import Checkpointer

    return Checkpointer(run_dir=cfg.run_dir, local_dir=cfg.local_dir, gcs_uri=cfg.gcs_uri,
                        policies=cfg.tier_policies(), mtbf_s=cfg.mtbf_s,
                        log=logging.getLogger("trainer.checkpoint"), key=cfg.checkpoint_key())
