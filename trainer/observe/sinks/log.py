"""The log line: each event as the ``event=NAME key=value`` line journald, Cloud Logging, the drill
and the tests read (``trainer.observe.progress`` sets the format up), and the live line on a
terminal.

Rank 0 speaks for the job: the step lines, evaluations, checkpoint saves, the emergency save's
verdict and a final checkpoint that is not durable are logged where they are known, on rank 0;
what a node's session did (its restore, a notice during start-up, how it ended, a failure) every
rank that emits it logs.
"""
from __future__ import annotations

import logging
from typing import Any

from trainer import EXIT_NOT_DURABLE
from trainer.observe.bus import BaseSink, SinkContext
from trainer.observe.events import (CapacityWait, CheckpointSaved, CheckpointsSetAside, DataWorkersDied, Eval, Event,
                                    Failed, Finished, InitFrom, Paused, Preempted, Restored, Stalled, Step, StepsChanged,
                                    NOT_DURABLE, TierFailing, TierOk)
from trainer.observe.progress import WINDOW_FIGURES, LiveLine
from trainer.observe.sinks import register


class LogSink(BaseSink):
    name = "log"
    handles = (Step, Eval, CheckpointSaved, Restored, StepsChanged, InitFrom, Preempted, Paused, Finished, Failed,
               TierFailing, TierOk, Stalled, CapacityWait, DataWorkersDied, CheckpointsSetAside)

    def __init__(self, log: logging.Logger, *, main: bool, stream: Any = None) -> None:
        self.log, self.main = log, main
        self.live = LiveLine(stream)
        self._rate = 0.0  # steps/s of the last window, for the live line

    def handle(self, ev: Event) -> None:
        getattr(self, "_" + type(ev).__name__.lower())(ev)

    def _say(self, level: int, named: Event | str, fmt: str, *args: Any) -> None:
        """One ``event=NAME ...`` line: NAME the event's ``line`` (``trainer.observe.events``)."""
        name = named if isinstance(named, str) else named.line
        self.log.log(level, "event=" + name + " " + fmt, *args)

    def _step(self, ev: Step) -> None:
        w = ev.window
        if w is not None:
            self._rate = w["steps_per_s"]
            unit = "tokens_per_s" if "tokens_per_s" in w else "samples_per_s"
            extra = "".join(f" {k}={v:.4g}" for k, v in w.items() if k not in WINDOW_FIGURES)
            self._say(logging.INFO, ev, "step=%d/%d loss=%.4f lr=%.3e steps_per_s=%.2f %s=%.0f eta_s=%.0f%s",
                      ev.step, ev.total, w["loss"], w["lr"], w["steps_per_s"], unit, w[unit], w["eta_s"], extra)
        self.live.draw(ev.step, ev.total, ev.loss, self._rate)

    def _eval(self, ev: Eval) -> None:
        self._say(logging.INFO, ev, "step=%d %s batches=%d seconds=%.3f", ev.step,
                  " ".join(f"{k}={v:.4f}" for k, v in ev.values.items()), ev.batches, ev.seconds)

    def _checkpointsaved(self, ev: CheckpointSaved) -> None:
        self._say(logging.INFO, ev, "step=%d blocked_s=%.4f", ev.step, ev.blocked_s)

    def _restored(self, ev: Restored) -> None:
        if ev.tier:
            self._say(logging.INFO, ev, "step=%d tier=%s path=%s seconds=%.3f world_size=%d", ev.step, ev.tier,
                      ev.path, ev.seconds, ev.world_size)
        else:
            self._say(logging.INFO, ev, "step=0 (no checkpoint: starting %s)", ev.fresh_from or "fresh")

    def _stepschanged(self, ev: StepsChanged) -> None:
        self._say(logging.WARNING, ev, "step=%d from=%d to=%d (extend_steps)", ev.step, ev.before, ev.after)

    def _initfrom(self, ev: InitFrom) -> None:
        self._say(logging.INFO, ev, "source=%s step=%d location=%s layout=%s optimizer=%d digest=%s",
                  ev.source, ev.step, ev.location, ev.layout, ev.optimizer, ev.digest)

    def _preempted(self, ev: Preempted) -> None:
        if ev.ok is not None:  # rank 0's verdict on the emergency save: the home tier's as 0/1 first
            oks = list(ev.ok.items())
            fields = " ".join([f"{oks[0][0]}_ok={int(bool(oks[0][1]))}"] + [f"{t}_ok={v}" for t, v in oks[1:]])
            self._say(logging.WARNING, ev, "step=%d %s seconds=%.3f detail=%s", ev.step, fields, ev.seconds,
                      ev.detail)
        elif ev.step is None:
            self._say(logging.WARNING, ev, "step=none detail=%s", ev.detail)
        elif ev.detail:
            self._say(logging.WARNING, ev, "step=%d detail=%s", ev.step, ev.detail)

    def _paused(self, ev: Paused) -> None:
        if ev.reason == "max_usd":
            self._say(logging.WARNING, ev, "reason=max_usd step=%d cost_usd=%.6g max_usd=%.6g (the spend cap: run "
                      "again with a higher max_usd to continue)", ev.step, ev.cost_usd or 0.0, ev.max_usd or 0.0)
        else:
            self._say(logging.WARNING, ev, "step=%d (stop_at_step; run again without it to continue)", ev.step)

    def _finished(self, ev: Finished) -> None:
        self._say(logging.INFO, ev, "step=%d%s", ev.step, f" ({Finished.AGAIN})" if ev.again else "")

    def _failed(self, ev: Failed) -> None:
        if ev.reason == "exception":
            self._say(logging.ERROR, ev, "reason=exception\n%s", ev.trace or ev.detail)
        elif ev.reason == "not_durable":
            if self.main:
                self._say(logging.ERROR, NOT_DURABLE, "step=%d detail=%s; exit %d: run the same command again, it "
                          "writes the missing copies", ev.step, ev.detail, EXIT_NOT_DURABLE)
        elif ev.reason == "lease_lost":
            pass  # logged when it was found out (event=stopped), before the save to the own disks
        else:
            self._say(logging.ERROR, ev, "reason=%s %s", ev.reason, ev.detail)

    def _tierfailing(self, ev: TierFailing) -> None:
        from trainer.checkpoint.checkpointer import describe_failing

        self._say(logging.WARNING, ev, "tier=%s %s", ev.tier, describe_failing(
            {ev.tier: {"since": ev.since, "failures": ev.failures, "error": ev.error}}))

    def _checkpointssetaside(self, ev: CheckpointsSetAside) -> None:
        # A warning a log-based alert can match: someone must look at the objects set aside.
        self._say(logging.WARNING, ev, "saved_before=%d steps=%s (started from scratch beside "
                  "checkpoints nobody can vouch for as this run's: %s; %s)", int(ev.saved_before),
                  ",".join(map(str, ev.steps)), ev.found, ev.record)

    def _tierok(self, ev: TierOk) -> None:
        self._say(logging.INFO, ev, "tier=%s", ev.tier)

    def _stalled(self, ev: Stalled) -> None:
        self._say(logging.WARNING, ev, "step=%d seconds=%.0f (no step completed for that long: the health check "
                  "answers stalled, so the group recreates the VM)", ev.step, ev.seconds)

    def _dataworkersdied(self, ev: DataWorkersDied) -> None:
        what = ("new workers start at the position: nothing lost" if ev.restarted else
                "given up: the step finishes with batches made in the trainer, which then saves and exits 1 to be "
                "restarted")
        self._say(logging.WARNING, ev, "step=%d consumed=%d died=%s deaths=%d restarted=%d (%s)", ev.step,
                  ev.consumed, ev.died, ev.deaths, ev.restarted, what)

    def _capacitywait(self, ev: CapacityWait) -> None:
        waited = "unknown" if ev.waited_s is None else f"{ev.waited_s:.0f}"
        self._say(logging.INFO, ev, "zone=%s provisioning=%s waited_s=%s", ev.zone, ev.provisioning, waited)

    def close(self, timeout: float) -> bool:
        self.live.close()
        return True


@register("log", default=True)
def make(ctx: SinkContext) -> LogSink:
    return LogSink(ctx.log, main=ctx.is_main)
