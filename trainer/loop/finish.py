"""How a session saves and how it ends: the periodic save, the final checkpoint, a pause, the
emergency save on a notice, the stop after a lost lease, and the stop after data workers that kept
dying; each returns the exit status.

The run is finished (exit 0) only once the final checkpoint is durable on every durable tier; a
pause exits 75 only once its checkpoint is. Both keep saving where a copy is missing, with growing
pauses, until ``durable_timeout_s``, then exit 74 (``_durably``); a notice meanwhile takes the
emergency path, whose deadline is the notice's budget: the node that got the earliest notice
closes first, so every rank counts from it. Rank 0 speaks for the job (the verdicts); the
checkpointer is called by rank 0 alone, or by every rank when its layout is sharded.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from trainer import EXIT_FAILED, EXIT_FINISHED, EXIT_NOT_DURABLE, EXIT_PREEMPTED, EXIT_SPEND_CAP, retry
from trainer.distributed import World
from trainer.loop.step import Job
from trainer.observe.bus import Bus
from trainer.observe.events import CheckpointSaved, Failed, Finished, Notice, Paused, Preempted, Progress

#: The durability retries' waits: 1 s doubling to a minute, no jitter (every rank decides together).
DURABLY = retry.Policy(first_s=1.0, cap_s=60.0, jitter=0.0)


class Finish:
    def __init__(self, cfg: Any, world: World, log: logging.Logger, *, ckpt: Any, job: Job, bus: Bus, health: Any,
                 preempt: Any, artifacts: Any, writers: Any, productive: Callable[[], float]) -> None:
        self.cfg, self.world, self.log, self.ckpt, self.job, self.bus = cfg, world, log, ckpt, job, bus
        self.health, self.preempt, self.artifacts, self.writers = health, preempt, artifacts, writers
        self.productive = productive
        self.stopping = False  # a notice came (on some rank): every rank stops
        self._saves = job.in_place or world.is_main  # the ranks that call the checkpointer

    # ------------------------------------------------------------------ saving
    def _write(self, step: int, **kw: Any) -> float:
        """Hand this step's state to the checkpointer: rank 0 alone, or every rank (sharded)."""
        snapshot = self.job.snapshot(step)
        return self.ckpt.save(step, snapshot, meta=self.job.meta(), **kw) if self._saves else 0.0

    def save(self, step: int) -> None:
        """A periodic save (in the background: the loop goes on)."""
        blocked = self._write(step)
        if self.world.is_main:
            self.bus.emit(CheckpointSaved(step, blocked, self.productive()))
            self.artifacts.sync_soon(after=self.ckpt.wait)  # in the background, once the checkpoint is written

    # ------------------------------------------------------------------ how a session ends
    def final(self, step: int, *, again: bool = False, noticed: bool = False) -> int:
        """The last checkpoint: the run is finished (exit 0) only once it is durable on every
        durable tier, else exit 74. A re-run of a finished job (``again``) saves it again, which
        writes it only where a copy is missing. A notice takes the emergency path."""
        t0 = time.monotonic()
        self.stopping = self.stopping or noticed
        durable = None if self.stopping else self._durably(step)
        if durable is None:  # a notice, during the last step or the save
            saved = self._emergency(step)
            if saved != "complete":
                return EXIT_FAILED if saved == "failed" else EXIT_PREEMPTED  # the next run finishes it
        elif not durable.ok:
            return self._not_durable(step, durable, "the final checkpoint")
        elif self.world.is_main:
            self.artifacts.sync()
        if self.world.is_node_leader:
            self.bus.emit(Finished(step, time.monotonic() - t0, self.productive(), again=again))
        if self.world.is_main:  # the run's own export (once; see trainer.export)
            self.health.exporting(step)
            self._export(step)
        self.health.finished()
        return EXIT_FINISHED

    def _export(self, step: int) -> None:
        """The run's export, given up at a notice: the final checkpoint is durable already, and
        the notice's window is for shutting down, not for an export (which ``python -m trainer
        export`` can write later; an interrupted one leaves no sidecar, so a re-run writes it)."""
        from trainer.export import auto_export

        abort, done = threading.Event(), threading.Event()

        def export() -> None:
            try:
                auto_export(self.cfg, step, self.log.getChild("export"), abort=abort)
            finally:
                done.set()

        threading.Thread(target=export, name="export", daemon=True).start()
        while not done.wait(0.1):
            if self.preempt.requested:
                abort.set()
                self.log.warning("event=export ok=0 step=%d interrupted=1 (a notice: the final checkpoint is "
                                 "durable; `python -m trainer export` writes the export by hand)", step)
                return

    def pause(self, step: int, *, cap: tuple[float, float] | None = None) -> int:
        """``stop_at_step`` reached: a checkpoint durable on every tier, then exit as if preempted.
        ``cap`` (cost so far, ``max_usd``): the spend cap reached instead: exit 77."""
        t0 = time.monotonic()
        durable = self._durably(step)
        if durable is None:  # a notice came meanwhile
            return EXIT_FAILED if self._emergency(step) == "failed" else EXIT_PREEMPTED
        if not durable.ok:
            return self._not_durable(step, durable, "the pause's checkpoint")
        if self.world.is_main:
            self.artifacts.sync()
        if self.world.is_node_leader:
            self.bus.emit(Paused(step, time.monotonic() - t0, self.productive()) if cap is None else
                          Paused(step, time.monotonic() - t0, self.productive(), reason="max_usd", cost_usd=cap[0],
                                 max_usd=cap[1]))
        return EXIT_PREEMPTED if cap is None else EXIT_SPEND_CAP

    def emergency(self, step: int) -> int:
        """A notice stopped the loop after ``step``: exit 75 once saved, 1 when nothing took it."""
        return EXIT_FAILED if self._emergency(step) == "failed" else EXIT_PREEMPTED

    def lost_lease(self, step: int) -> str:
        """Another trainer took the job's lease: no more remote writes (the guard refuses them);
        this one saves to its own disks and stops, exit 2 (a human must choose); the reason."""
        taker = self.writers.taken_by()
        if self.world.is_main:
            self.log.error("event=stopped reason=lease_lost step=%d taker=%s (another trainer writes this job "
                           "now; this one saves step %d to its own disks only and exits 2)", step, taker, step)
        self._write(step, every_tier=True)  # the guard refuses its remote copy
        if self._saves:
            self.ckpt.wait(timeout=self.cfg.durable_timeout_s)
        self.world.barrier()
        why = (f"gcs_uri: another trainer took this job's writer lease ({taker}); two trainers on one job "
               "would collide: stop one of them")
        self.bus.emit(Failed("lease_lost", why, step=step))
        return why

    def workers_failed(self, step: int, why: str) -> int:
        """The data workers (of some rank) kept dying: the state in memory, ``step`` just
        completed, durable on every tier as for a pause; then exit 1, which the VM's unit (or a
        pool's torchrun) restarts, new workers and all, from this checkpoint: nothing is lost. 74
        when it does not get durable (restarted too); a notice meanwhile takes the emergency path."""
        durable = self._durably(step)
        if durable is None:
            return EXIT_FAILED if self._emergency(step) == "failed" else EXIT_PREEMPTED
        if not durable.ok:
            return self._not_durable(step, durable, "the checkpoint after the data workers failed")
        if self.world.is_node_leader:
            self.bus.emit(Progress(step, self.productive()))  # the goodput ledger's productive time up to it
            self.bus.emit(Failed("data_workers", f"{why}; step {step} is saved and durable: the next session "
                                 "resumes from it with new workers", step=step))
        return EXIT_FAILED

    # ------------------------------------------------------------------ durability
    def _durably(self, step: int) -> Any:
        """Save ``step`` to every tier until it is durable on every durable tier (each attempt
        writes only the copies still missing) or ``durable_timeout_s`` has passed. Rank 0's
        verdict (a ``checkpointer.Durability``) on every rank, or None when a notice came first."""
        self.health.finishing(step)
        t0 = time.monotonic()
        deadline = t0 + self.cfg.durable_timeout_s
        again = retry.Backoff(DURABLY)
        while True:
            self._write(step, every_tier=True)
            notice, verdict = self._watched(lambda: self.ckpt.durable(step, deadline=deadline))
            if notice:
                return None
            if self.world.is_main:
                self.log.info("event=checkpoint_save step=%d blocked_s=%.4f final=1 durable=%d %s", step,
                              time.monotonic() - t0, verdict.ok, verdict.detail)
            delay = again.next()
            if verdict.ok or time.monotonic() + delay >= deadline:
                return verdict
            if self.world.is_main:
                self.log.warning("event=not_durable_yet step=%d missing=%s; saving again in %.0fs", step,
                                 ",".join(verdict.missing), delay)
            if self._watched(lambda: time.sleep(delay))[0]:
                return None

    def _watched(self, work: Callable[[], Any]) -> tuple[bool, Any]:
        """``work`` on the ranks that save while every rank watches for a notice."""
        notice, out = self.world.run_watching(work if self._saves else None, lambda: self.preempt.requested)
        self.stopping = self.stopping or notice
        return notice, out

    def _not_durable(self, step: int, durable: Any, what: str) -> int:
        detail = f"{what} (step {step}) is not durable after {self.cfg.durable_timeout_s:.0f}s: {durable.detail}"
        if self.world.is_node_leader:
            self.bus.emit(Failed("not_durable", detail, step=step))
        return EXIT_NOT_DURABLE

    def _emergency(self, step: int) -> str:
        """A notice on some node: the step in flight is done everywhere; make it durable within
        the budget of the node that got the earliest notice (its window closes first). Rank 0's
        verdict on every rank: "complete" (on every durable tier), "saved" (on a tier that
        outlives the VM) or "failed"."""
        t0 = time.monotonic()
        elapsed = self.world.max_float(self.preempt.seconds_since_notice())
        deadline = time.monotonic() + self.cfg.preemption_budget_s - elapsed
        if self.world.is_main:
            self.artifacts.abort()  # a copy in flight must not slow the checkpoint's upload
        snapshot = self.job.snapshot(step)
        if self.world.is_node_leader:
            self.bus.emit(Notice(self.preempt.reason or "another node", step))
        report = None
        if self._saves:
            report = self.ckpt.emergency_save(step, snapshot, deadline=deadline, meta=self.job.meta())
        verdict = "saved"
        main = report if self.world.is_main else None  # rank 0 saves (the whole-model layout) and reports
        if main is not None:
            verdict = "complete" if main.complete else "saved" if main.saved else "failed"
        verdict = self.world.broadcast(verdict)
        if self.world.is_node_leader:
            ok = _ok_in_log_order(self.ckpt.tiers, main) if main is not None else None
            self.bus.emit(Preempted(step, self.productive(), time.monotonic() - t0, ok=ok,
                                    seconds=main.seconds if main is not None else 0.0,
                                    detail=main.detail if main is not None else ""))
            self.bus.flush(deadline)
        if self.world.is_main and deadline - time.monotonic() > 1.0:
            self.artifacts.sync(deadline)  # only with the time the checkpoint left over
        return verdict


def _ok_in_log_order(tiers: Any, report: Any) -> dict[str, bool | None]:
    """The report's tiers for the ``event=preempted`` line and the ledger: the home tier first,
    then the remote ones, then the rest (persistent, gcs, local)."""
    order = [tiers.home] + tiers.remotes + [t for t in tiers if t is not tiers.home and not t.remote]
    return {t.name: report.ok.get(t.name) for t in order}
