"""Evaluation during training, with its randomness isolated from the run.

Every ``eval_every_steps`` (and at the last step) the task's ``eval_dataset`` is evaluated over a
fixed prefix of ``eval_batches`` micro-batches per rank (rank r takes micro-batches r, r + world,
...; the same samples at every evaluation, so the curve compares like with like), or the task's
``evaluate(model)`` callable is called; the ranks' results are averaged.

Evaluation must not change the run: everything it could touch is put back afterwards, the RNG
state of Python, torch CPU, every CUDA device and numpy (a sampling eval callable, an eval set
that augments), and each module's train/eval mode; it runs under ``torch.no_grad``. So the
weights of a run are bit-identical with and without evaluation, and an evaluation may be added to,
or dropped from, a run between restarts.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator

import torch

from trainer.loop import state
from trainer.loop.named_state import unwrap
from trainer.data.batches import fetch
from trainer.task import loss_and_metrics


@contextlib.contextmanager
def isolated(model: torch.nn.Module) -> Iterator[None]:
    """Run the body in eval mode without a trace on the RNGs or the modules' modes."""
    rngs = state.rng_state()
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, training in modes:
            m.training = training
        state.set_rng_state(rngs)


class Evaluator:
    """Decides when to evaluate and computes the eval loss (a collective under DDP/FSDP)."""

    def __init__(self, task: Any, cfg: Any, step_fn: Any, world: Any, *, sharded: bool,
                 interrupted: Callable[[], bool]):
        """``cfg``: the RunConfig; ``step_fn``: the loop's step (its model, device, loss and autocast)."""
        self.dataset = getattr(task, "eval_dataset", None)
        self.evaluate = getattr(task, "evaluate", None)
        has_eval = self.dataset is not None or self.evaluate is not None
        self.every = cfg.eval_every_steps if has_eval else None
        self.batches, self.total, self.batch_size = cfg.eval_batches, cfg.steps, cfg.batch_size
        self.world, self.device, self.sharded = world, step_fn.device, sharded
        # DDP: the inner module (no collectives per forward); FSDP: the sharded model gathers.
        self.model = step_fn.model if sharded else unwrap(step_fn.model)
        self.loss_fn, self.autocast, self.interrupted = step_fn.loss_fn, step_fn.autocast, interrupted

    def due(self, step: int) -> bool:
        return self.every is not None and (step % self.every == 0 or step == self.total)

    def __call__(self) -> tuple[dict[str, float], int, float] | None:
        """``({"loss": ..}, batches per rank, seconds)`` averaged over the ranks; None when a
        preemption notice cut it short (a sharded model finishes it: its forwards are collectives)."""
        t0 = time.monotonic()
        with isolated(self.model):
            if self.evaluate is not None:
                out = self.evaluate(self.model)
                values, n, cut = (dict(out) if isinstance(out, dict) else {"loss": out}), 1, False
            else:
                values, n, cut = self._dataset_loss()
        values = {k: float(v) for k, v in values.items()}
        gathered = self.world.all_gather((values, cut))
        if any(c for _, c in gathered):
            return None
        mean = {k: sum(v[k] for v, _ in gathered) / len(gathered) for k in values}
        return mean, n, time.monotonic() - t0

    def _dataset_loss(self) -> tuple[dict[str, float], int, bool]:
        """The loss, and the task's own metrics (``loss_fn``'s ``(loss, {name: value})``), over the
        eval prefix."""
        assert self.dataset is not None  # ``due`` only with an eval set or an evaluate callable
        size, world = len(self.dataset), self.world
        sums: dict[str, Any] = {"loss": torch.zeros((), device=self.device, dtype=torch.float64)}
        n = 0
        for b in range(self.batches):
            if not self.sharded and self.interrupted():
                return {"loss": float("nan")}, n, True
            first = (b * world.size + world.rank) * self.batch_size
            batch = fetch(self.dataset, [(first + i) % size for i in range(self.batch_size)])
            batch = tuple(x.to(self.device, non_blocking=True) if torch.is_tensor(x) else x for x in batch)
            with self.autocast():
                loss, metrics = loss_and_metrics(self.loss_fn(self.model, batch))
                sums["loss"] += loss.detach().double()
                for name, value in metrics.items():
                    value = value.detach().double().reshape(()) if torch.is_tensor(value) else float(value)
                    sums[name] = sums.get(name, 0.0) + value
            n += 1
        return {name: float(total) / max(1, n) for name, total in sums.items()}, n, False
