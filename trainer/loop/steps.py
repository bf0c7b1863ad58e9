"""The steps of a session, handed out one at a time: the one place each promise between two steps lives.

``Steps`` is what both loops iterate: the bundled one (``trainer.train``) and a user's own
(``trainer.run``). ``for step in steps:`` yields the index of each step still to train, from the
restored one on; the body trains it (and says its loss with ``report``); between two steps
``Steps`` keeps every promise once for both (and starts every step with no gradients: they are in
no checkpoint, so none may cross a step boundary): the step's events and health beat, the flags every
rank agrees on in one all-reduce (a notice, a save due, a lost lease, the spend cap, data workers
given up), the checkpoint at the configured cadence, the progress and goodput, and, when the
iteration ends, the save and the exit status of how it ended (``outcome``): the emergency save on a
notice, the final checkpoint, a pause, a lost lease.

Before the first step it starts a ``trainer.loop.undeclared.Guard`` over what the job declared;
after the first step the guard refuses state the job changed but never declared.
"""
from __future__ import annotations

import math
import time
from typing import Any, Iterator

from trainer import EXIT_BAD_INPUT, EXIT_PREEMPTED
import torch

from trainer.loop.named_state import unwrap
from trainer.loop.step import Job
from trainer.loop.undeclared import Guard, Undeclared


class Steps:
    """One session's steps; see the module docstring. ``outcome`` is (exit status, reason) once
    the iteration ended."""

    def __init__(self, s: Any, job: Job, start: int, *, evaluator: Any = None):
        self.s, self.job, self.start = s, job, start
        self.evaluator = evaluator
        self.outcome: tuple[int, str] | None = None
        self.done = start
        self.loop_s = self.loop_cpu_s = 0.0
        self._loss: float = math.nan
        self._metrics: dict[str, float] = {}

    def report(self, loss: Any, metrics: dict[str, Any] | None = None) -> None:
        """The step's loss (a number or a one-element tensor) and the job's own metrics, for the
        step's event; the last report of a step counts."""
        self._loss = float(loss.detach()) if hasattr(loss, "detach") else float(loss)
        self._metrics = {k: float(v.detach()) if hasattr(v, "detach") else float(v) for k, v in (metrics or {}).items()}

    def __iter__(self) -> Iterator[int]:
        s, cfg, world, job, start = self.s, self.s.cfg, self.s.world, self.job, self.start
        if start >= cfg.steps:  # finished before: the final checkpoint where a copy is missing
            self.outcome = (s.finish.final(start, again=True), "")
            return
        if s.noticed_before_training(start):
            self.outcome = (EXIT_PREEMPTED, "")
            return
        if cfg.stop_at_step is not None and start >= cfg.stop_at_step:
            if world.is_main:
                s.log.warning("event=stop_at_step stop_at_step=%d step=%d (already there: pausing at once)",
                              cfg.stop_at_step, start)
            self.outcome = (s.finish.pause(start), "")
            return
        cap = s.spend_cap(check=True) if cfg.max_usd is not None else None
        if cap is not None:
            self.outcome = (s.finish.pause(start, cap=cap), "")
            return
        guard = Guard(job.declared(), before_update=job.before_update)
        try:
            yield from self._run(guard)
        finally:
            guard.close()

    def _run(self, guard: Guard) -> Iterator[int]:
        s, cfg, world, job, start = self.s, self.s.cfg, self.s.world, self.job, self.start
        t_loop, cpu_loop = time.monotonic(), time.process_time()
        done, stop, lost, capped, starved = start, False, False, False, False
        guard.before_first_step()
        batches = job.batches
        for step in range(start, cfg.steps):
            self._loss, self._metrics = math.nan, {}
            t0 = time.monotonic()
            # Gradients are in no checkpoint, so none may cross a step boundary: a GAN's generator
            # update leaves gradients on the discriminator that its next update would otherwise add
            # to, in an uninterrupted run only.
            for opt in job.optimizers.values():
                opt.zero_grad(set_to_none=True)
            yield step
            s.productive_s += time.monotonic() - t0
            done = self.done = step + 1
            if step == start:
                guard.after_first_step()  # exit 2 before anything is saved
            s.completed(done, self._loss, job.lr, self._metrics)
            stop, due, lost, capped, starved = world.any_flags(
                s.preempt.requested, world.is_main and s.ckpt.due(done), s.writers.lost, s.capped is not None,
                batches is not None and batches.failure is not None)
            if not (stop or lost) and self.evaluator is not None and self.evaluator.due(done):
                s.evaluated(done, self.evaluator())
            if stop or lost or capped or starved or done == cfg.steps or done == cfg.stop_at_step:
                break
            if due:
                self._replicas_agree(done)
                s.finish.save(done)
            s.progress(done)
        self.loop_s, self.loop_cpu_s = time.monotonic() - t_loop, time.process_time() - cpu_loop
        s.loop_over()
        if done > start and not lost:
            self._replicas_agree(done)

        if done < cfg.steps and stop:
            self.outcome = (s.finish.emergency(done), "")
        elif lost:
            self.outcome = (EXIT_BAD_INPUT, s.finish.lost_lease(done))
        elif capped and done < cfg.steps:
            self.outcome = (s.finish.pause(done, cap=s.spend_cap()), "")
        elif starved and done < cfg.steps and done != cfg.stop_at_step:  # data workers that kept dying
            why = (batches.failure if batches is not None else None) or "the data workers of another rank kept dying"
            self.outcome = (s.finish.workers_failed(done, why), "")
        elif done < cfg.steps:
            self.outcome = (s.finish.pause(done), "")
        else:
            self.outcome = (s.finish.final(done, noticed=stop), "")

    def _replicas_agree(self, done: int) -> None:
        """Under DDP every rank holds the same weights; a job that trains a model outside its
        wrapper (an unwrapped ``model.module`` in the step) lets them drift apart while rank 0's
        checkpoint looks fine. Checked before every save, on every rank together (exit 2)."""
        world, job = self.s.world, self.job
        if not world.distributed or job.in_place:
            return
        mine = [(name, float(sum(torch.sum(p.detach(), dtype=torch.float64) for p in unwrap(m).parameters())))
                for name, m in job.models.items()]
        sums = world.gather(mine)
        why = None
        if sums is not None:
            drifted = sorted({name for other in sums[1:] for (name, a), (_, b) in zip(sums[0], other) if a != b})
            if drifted:
                why = (f"after step {done} the ranks hold different weights of {', '.join(drifted)}: a model trained "
                       "outside its DDP wrapper (gradients not all-reduced); call the models the step is handed "
                       "(s.models), or run.wrap(model) in your own loop, never model.module")
        why = world.broadcast(why)
        if why is not None:
            raise Undeclared(why)
