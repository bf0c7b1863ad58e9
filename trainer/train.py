"""The training loop: build the task, restore, train, checkpoint, stop cleanly on preemption.

Read ``run()`` top to bottom; the machinery sits behind small interfaces: ``Checkpointer``
(tiers, async saves, intervals), ``state`` (what exact resume needs), ``Preemption`` (the flag),
``Health``, ``Ledger`` (goodput), ``Progress`` (logs) and ``World`` (DDP collectives).
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
from trainer import distributed, state
from trainer import task as tasks
from trainer.config import RunConfig
from trainer.goodput import Ledger, session_start_fields
from trainer.health import Health, HealthServer
from trainer.preemption import Preemption
from trainer.progress import Progress, setup_logging
from trainer.sampler import DataOrder


@dataclass
class Outcome:
    code: int
    steps_run: int = 0  # optimizer steps this session completed
    loop_s: float = 0.0  # wall seconds of the training loop (bench)


def run(cfg: RunConfig, *, make_checkpointer: Callable[..., Any] | None = None,
        process_start: float | None = None) -> Outcome:
    process_start = process_start or time.time()
    world = distributed.init()
    log = setup_logging(world.rank)
    if not world.is_main:  # rank 0 speaks for the job; the others only warn
        logging.getLogger().setLevel(logging.WARNING)
    preempt = Preemption(log.getChild("preemption"))
    preempt.install_signal_handlers()
    session = _Session(cfg, world, log, preempt, make_checkpointer, process_start)
    try:
        return session.run()
    except (state.ResumeMismatch, tasks.TaskError) as e:
        log.error("event=failed reason=bad_input %s", e)
        session.record_failure("bad_input", str(e))
        return Outcome(EXIT_BAD_INPUT)
    except Exception as e:
        log.error("event=failed reason=exception\n%s", traceback.format_exc())
        session.record_failure("exception", f"{type(e).__name__}: {e}")
        return Outcome(EXIT_FAILED)
    finally:
        session.close()
        preempt.close()
        world.close()


class _Session:
    def __init__(self, cfg: RunConfig, world: distributed.World, log: logging.Logger, preempt: Preemption,
                 make_checkpointer: Callable[..., Any] | None, process_start: float):
        self.cfg, self.world, self.log, self.preempt = cfg, world, log, preempt
        self.make_checkpointer = make_checkpointer or _default_checkpointer
        self.process_start = process_start
        self.ckpt: Any = None
        self.ledger: Ledger | None = None
        self.server: HealthServer | None = None
        self.health = Health(cfg.stall_timeout_s)
        self.productive_s = 0.0

    def run(self) -> Outcome:
        cfg, world, log = self.cfg, self.world, self.log
        t_start = time.monotonic()
        torch.set_num_threads(cfg.threads)
        device = _device(cfg, world)
        if cfg.deterministic:
            _deterministic(device)

        # Machinery that only one process per job runs: health, checkpoints, the ledger.
        if world.is_main:
            if cfg.health_port is not None:
                self.server = HealthServer(self.health, host=cfg.health_host, port=cfg.health_port,
                                           request=cfg.health_request, log=log.getChild("health")).start()
            if cfg.watch_metadata:
                self.preempt.watch_metadata()
            self.ckpt = self.make_checkpointer(cfg)
            self.ledger = Ledger(cfg.run_dir, store=self.ckpt.gcs, log=log.getChild("goodput"))
            self.ledger.append("session_start", **session_start_fields(
                self.process_start, price_per_hour=cfg.price_per_hour,
                on_demand_price_per_hour=cfg.on_demand_price_per_hour))

        # Build the task: identical initial weights on every rank, then per-rank RNG streams.
        _seed(cfg.seed)
        ctx = tasks.TaskContext(seed=cfg.seed, steps=cfg.steps, device=device, rank=world.rank,
                                world_size=world.size)
        task = tasks.build(cfg.task, ctx, cfg.task_args)
        _seed((cfg.seed + 1_000_003 * world.rank) % 2**63)
        model = task.model
        if world.distributed:
            model = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[device.index] if device.type == "cuda" else None)
        data = DataOrder(len(task.dataset), seed=cfg.seed, batch_size=cfg.batch_size,
                         rank=world.rank, world_size=world.size)
        scaler = torch.amp.GradScaler("cuda") if device.type == "cuda" and cfg.precision == "fp16" else None
        fingerprint = cfg.fingerprint(world_size=world.size, dataset_len=len(task.dataset))
        if world.is_main:
            log.info("event=start steps=%d world_size=%d device=%s task=%s %s", cfg.steps, world.size, device,
                     cfg.task, " ".join(f"{k}={v}" for k, v in task.info.items()))

        # Restore: rank 0 finds the newest valid checkpoint, every rank gets the same state.
        t_restore = time.monotonic()
        restored = self.ckpt.restore() if world.is_main else None
        saved = world.broadcast(restored.state if restored is not None else None)
        start = 0
        if saved is not None:
            state.check_fingerprint(saved["fingerprint"], fingerprint)
            start = state.apply(saved, model=model, optimizer=task.optimizer, scheduler=task.scheduler,
                                scaler=scaler, data=data, world=world)
        restore_s = time.monotonic() - t_restore
        if world.is_main:
            if restored is not None:
                log.info("event=restore step=%d tier=%s path=%s seconds=%.3f", start, restored.tier,
                         restored.path, restore_s)
            else:
                log.info("event=restore step=0 (no checkpoint: starting fresh)")
            self.ledger.append("restore", step=start, seconds=restore_s,
                               startup_s=max(0.0, time.time() - self.process_start - restore_s))
        if start >= cfg.steps:
            log.info("event=finished step=%d (already complete)", start)
            if world.is_main:
                self.ledger.append("finish", step=start, blocked_s=0.0, productive_s=0.0)
            self.health.finished()
            return Outcome(EXIT_FINISHED)
        if self.preempt.requested:  # the notice came during start-up: nothing new to save
            return self._stop_before_training(start)

        # The loop.
        self.preempt.step_completed(start)
        step_fn = _StepFn(cfg, model, task, data, scaler, device, world)
        progress = Progress(log, total_steps=cfg.steps, start_step=start, every=cfg.log_every_steps,
                            tokens_per_step=task.tokens_per_sample * cfg.batch_size * cfg.grad_accum_steps * world.size)
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
            progress.update(done, loss, task.optimizer.param_groups[0]["lr"])

            stop, due = world.any_flags(self.preempt.requested, world.is_main and self.ckpt.due(done))
            if stop or done == cfg.steps:
                break
            if due:
                self._save(done, model, task, scaler, data, fingerprint)
            if world.is_main and time.monotonic() - last_progress_event >= cfg.progress_every_s:
                self.ledger.append("progress", step=done, productive_s=self.productive_s)
                last_progress_event = time.monotonic()
        loop_s = time.monotonic() - t_loop
        progress.close()

        if done < cfg.steps:
            code = self._emergency_save(done, model, task, scaler, data, fingerprint)
            return Outcome(code, done - start, loop_s)
        code = self._final_save(done, model, task, scaler, data, fingerprint)
        log.debug("session took %.1fs", time.monotonic() - t_start)
        return Outcome(code, done - start, loop_s)

    def _state(self, step: int, model: Any, task: tasks.Task, scaler: Any, data: DataOrder,
               fingerprint: dict) -> dict | None:
        return state.build(step=step, model=model, optimizer=task.optimizer, scheduler=task.scheduler,
                           scaler=scaler, data=data, fingerprint=fingerprint, world=self.world)

    def _meta(self, fingerprint: dict) -> dict:
        return {"world_size": self.world.size, "fingerprint": fingerprint}

    def _save(self, step: int, *args: Any) -> None:
        snapshot = self._state(step, *args)
        if not self.world.is_main:
            return
        blocked = self.ckpt.save(step, snapshot, meta=self._meta(args[-1]))
        self.log.info("event=checkpoint_save step=%d blocked_s=%.4f", step, blocked)
        self.ledger.append("checkpoint", step=step, blocked_s=blocked, productive_s=self.productive_s)

    def _final_save(self, step: int, *args: Any) -> int:
        if self.preempt.requested:  # the notice came during the last step: the deadline still holds
            return EXIT_FINISHED if self._emergency_save(step, *args) == EXIT_PREEMPTED else EXIT_FAILED
        snapshot = self._state(step, *args)
        if self.world.is_main:
            t0 = time.monotonic()
            self.ckpt.save(step, snapshot, meta=self._meta(args[-1]))
            self.ckpt.wait()
            blocked = time.monotonic() - t0
            self.log.info("event=checkpoint_save step=%d blocked_s=%.4f final=1", step, blocked)
            self.ledger.append("finish", step=step, blocked_s=blocked, productive_s=self.productive_s)
            self.log.info("event=finished step=%d", step)
        self.health.finished()
        self.world.barrier()
        return EXIT_FINISHED

    def _emergency_save(self, step: int, *args: Any) -> int:
        """Notice received: the step in flight is done; make it durable within the budget."""
        notice = self.preempt.notice_monotonic or time.monotonic()
        deadline = notice + self.cfg.preemption_budget_s
        snapshot = self._state(step, *args)
        ok = True
        if self.world.is_main:
            self.ledger.append("preemption_notice", step=step, reason=self.preempt.reason)
            report = self.ckpt.emergency_save(step, snapshot, deadline=deadline, meta=self._meta(args[-1]))
            ok = report.persistent_ok or bool(report.gcs_ok)
            self.log.warning("event=preempted step=%d persistent_ok=%d gcs_ok=%s seconds=%.3f detail=%s",
                             step, report.persistent_ok, report.gcs_ok, report.seconds, report.detail)
            self.ledger.append("preempted", step=step, productive_s=self.productive_s, blocked_s=report.seconds,
                               persistent_ok=report.persistent_ok, gcs_ok=report.gcs_ok)
            self.ledger.flush(deadline - time.monotonic())
        ok = self.world.broadcast(ok)
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

    def __init__(self, cfg: RunConfig, model: torch.nn.Module, task: tasks.Task, data: DataOrder,
                 scaler: Any, device: torch.device, world: distributed.World):
        self.cfg, self.model, self.task, self.data = cfg, model, task, data
        self.scaler, self.device, self.world = scaler, device, world
        self.loss_fn = task.loss_fn or (lambda m, batch: m(*batch))
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision)
        if device.type == "cuda" and dtype is not None:
            self.autocast: Callable[[], Any] = lambda: torch.autocast("cuda", dtype=dtype)
        else:
            self.autocast = contextlib.nullcontext

    def _batch(self) -> tuple:
        samples = [self.task.dataset[i] for i in self.data.next_indices()]
        batch = torch.utils.data.default_collate(samples)
        batch = tuple(batch) if isinstance(batch, (list, tuple)) else (batch,)
        return tuple(b.to(self.device, non_blocking=True) if torch.is_tensor(b) else b for b in batch)

    def __call__(self) -> float:
        accum, model, opt = self.cfg.grad_accum_steps, self.model, self.task.optimizer
        model.train()
        total = torch.zeros((), device=self.device)
        for micro in range(accum):
            batch = self._batch()
            last = micro == accum - 1
            # Under DDP, all-reduce gradients only on the last micro-batch.
            sync = contextlib.nullcontext() if last or not self.world.distributed else model.no_sync()
            with sync:
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


def _default_checkpointer(cfg: RunConfig) -> Any:
    from trainer.checkpointer import Checkpointer

    return Checkpointer(run_dir=cfg.run_dir, local_dir=cfg.local_dir, gcs_uri=cfg.gcs_uri,
                        policies=cfg.tier_policies(), mtbf_s=cfg.mtbf_s,
                        log=logging.getLogger("trainer.checkpoint"))
