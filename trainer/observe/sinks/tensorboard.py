"""TensorBoard as a sink (rank 0, ``tensorboard = true``): each step window's figures, the task's
own metrics (``train/NAME``), evaluations (``eval/NAME``) and the job's goodput and cost, in the
run dir's event files mirrored to the remote tier (``trainer.observe.tensorboard``).

The files are opened when the session knows where it continues (its ``Restored`` event): the
points of earlier sessions past that step are superseded there.
"""
from __future__ import annotations

from typing import Any

from trainer.observe.bus import BaseSink, SinkContext
from trainer.observe.events import Eval, Event, Goodput, Restored, Step
from trainer.observe.progress import WINDOW_FIGURES
from trainer.observe.sinks import register


def scalars(ev: Event) -> dict[str, float] | None:
    """The figures an event gives a chart, by name, at its ``step`` (None: none): a step window's,
    the task's own metrics (``train/NAME``), an evaluation's (``eval/NAME``), goodput and cost.
    The experiment trackers' sinks send the same."""
    if isinstance(ev, Step) and ev.window is not None:
        w = ev.window
        unit = "tokens_per_s" if "tokens_per_s" in w else "samples_per_s"
        points = {"train/loss": w["loss"], "lr": w["lr"], "throughput/steps_per_s": w["steps_per_s"],
                  f"throughput/{unit}": w[unit]}
        points.update({f"train/{k}": v for k, v in w.items() if k not in WINDOW_FIGURES})
        return points
    if isinstance(ev, Eval):
        return {f"eval/{k}": v for k, v in ev.values.items()}
    if isinstance(ev, Goodput):
        points = {"goodput/goodput": ev.goodput}
        if ev.cost_usd is not None:
            points["goodput/cost_usd"] = ev.cost_usd
        return points
    return None


class TensorBoardSink(BaseSink):
    name = "tensorboard"
    handles = (Restored, Step, Eval, Goodput)

    def __init__(self, ctx: SinkContext) -> None:
        self._ctx = ctx
        self._store: Any = None
        self.metrics: Any = None  # the writer, once the session restored

    def mirror_to(self, store: Any) -> None:
        self._store = store

    def handle(self, ev: Event) -> None:
        if isinstance(ev, Restored):
            from trainer.observe.tensorboard import Metrics

            cfg = self._ctx.cfg
            self.metrics = Metrics(self._ctx.run_dir, start_step=ev.step, store=self._store, session=self._ctx.session,
                                   upload_every_s=cfg.metrics_upload_every_s, log=self._ctx.log.getChild("metrics"))
        elif self.metrics is None:
            return
        else:
            points = scalars(ev)
            if points:
                self.metrics.scalars(ev.step, points)  # type: ignore[attr-defined]

    def close(self, timeout: float) -> bool:
        if self.metrics is None or self.metrics.close(timeout=timeout):
            return True
        self._ctx.log.warning("event=metrics_upload ok=0 detail=the last TensorBoard points reached only the run dir")
        return False


@register("tensorboard", default=True)
def make(ctx: SinkContext) -> TensorBoardSink | None:
    return TensorBoardSink(ctx) if ctx.is_main and ctx.cfg.tensorboard else None
