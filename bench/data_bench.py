"""Data loading, the trainer against a plain loop, and the data order's memory, side by side.

1. ``data_workers = 2`` against inline loading, in the real loop (`trainer.train.run`), on a task
   whose samples cost CPU to make (``CostlySamples``: a pure-Python hash chain per sample, the
   stand-in for decoding and augmenting) and a model whose step costs about as much. Goal: steps/s
   ratio >= 1.6 on 2 cores.
2. The trainer (defaults: TensorBoard on, automatic checkpoint interval, inline data) against a
   plain PyTorch loop of the same GPT, optimizer, schedule and data (a DataLoader with
   ``shuffle=True``, no workers). Goal: ratio >= 0.98.
3. Peak memory of the data order (``DataOrder`` making 10,000 micro-batches of 64) at n = 10^4
   and 10^10 (tracemalloc: the order is pure Python), next to the per-epoch ``torch.randperm``
   it replaced (its tensor alone: 8 bytes per sample). Goal: the same at both n.

The two variants of a comparison run back to back in each round, in alternating order, and the
ratio is taken per round (its median and range are reported): the load of a shared machine
drifts over minutes, and a ratio of two medians taken minutes apart would carry that drift.
"""
from __future__ import annotations

import argparse
import hashlib
import math
import os
import platform
import statistics
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import torch

from trainer.task import Task, TaskContext

GPT_ARGS = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64, "stride": 16}


class CostlySamples:
    """Samples that cost CPU to make: ``rounds`` chained sha256 per sample (about 1 us each)."""

    def __init__(self, n: int, dim: int, rounds: int):
        self.n, self.dim, self.rounds = n, dim, rounds

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        h = i.to_bytes(8, "little")
        for _ in range(self.rounds):
            h = hashlib.sha256(h).digest()
        g = torch.Generator().manual_seed(int.from_bytes(h[:8], "little") % 2**63)
        x = torch.randn(self.dim, generator=g)
        return x, x.sin()


def costly_task(ctx: TaskContext, rounds: int = 6000, dim: int = 256, width: int = 2048) -> Task:
    model = torch.nn.Sequential(torch.nn.Linear(dim, width), torch.nn.GELU(), torch.nn.Linear(width, width),
                                torch.nn.GELU(), torch.nn.Linear(width, dim))

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.f = model

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.mse_loss(self.f(x), y)

    net = Net()
    return Task(model=net, optimizer=torch.optim.AdamW(net.parameters(), lr=1e-3),
                dataset=CostlySamples(100_000, dim, rounds))


def _trainer(root: Path, steps: int, **kw: Any) -> tuple[float, float]:
    """(steps per wall second, steps per CPU second of the process) of the trainer's loop."""
    from trainer.config import RunConfig
    from trainer.train import run

    cfg = RunConfig(run_dir=Path(tempfile.mkdtemp(dir=root)), steps=steps, health_port=None,
                    watch_metadata=False, log_every_steps=10**9, **kw)
    out = run(cfg)
    assert out.code == 0, f"bench run failed: exit {out.code}"
    return out.steps_run / out.loop_s, out.steps_run / out.loop_cpu_s


def _plain(steps: int, batch_size: int) -> tuple[float, float]:
    """The same GPT task trained by a plain loop: what a user would write without the trainer."""
    from trainer.tasks.gpt import build

    torch.manual_seed(0)
    ctx = TaskContext(seed=0, steps=steps, device=torch.device("cpu"), rank=0, world_size=1)
    task = build(ctx, **GPT_ARGS)
    loader = torch.utils.data.DataLoader(task.dataset, batch_size=batch_size, shuffle=True, drop_last=True)
    model, opt, sched = task.model, task.optimizer, task.scheduler
    it = iter(loader)
    t0, cpu0 = time.monotonic(), time.process_time()
    for _ in range(steps):
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(loader)
            x, y = next(it)
        model.train()
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        float(loss.detach())
    return steps / (time.monotonic() - t0), steps / (time.process_time() - cpu0)


def order_peak_bytes(n: int, batches: int = 10_000, batch_size: int = 64) -> int:
    from trainer.data.sampler import DataOrder

    tracemalloc.start()
    order = DataOrder(n, seed=0, batch_size=batch_size)
    for _ in range(batches):
        order.next_indices()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak


def measure(rounds: int, workers_steps: int, plain_steps: int) -> dict[str, list[tuple[float, float]]]:
    import logging

    res: dict[str, list[tuple[float, float]]] = {"inline": [], "workers": [], "plain": [], "trainer": []}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        costly = dict(task="bench.data_bench:costly_task", batch_size=32)
        _trainer(root, 5, **costly, data_workers=2)  # warm-up: imports, allocator
        _plain(5, 16)
        for r in range(rounds):
            jobs = [("inline", lambda: _trainer(root, workers_steps, **costly)),
                    ("workers", lambda: _trainer(root, workers_steps, **costly, data_workers=2)),
                    ("plain", lambda: _plain(plain_steps, 16)),
                    ("trainer", lambda: _trainer(root, plain_steps, batch_size=16, task_args=GPT_ARGS))]
            for pair in (jobs[:2], jobs[2:]):  # each comparison back to back, alternating which first
                for name, job in pair[::-1] if r % 2 else pair:
                    res[name].append(job())
                    logging.getLogger().setLevel(logging.WARNING)
    return res


def table(res: dict[str, list[tuple[float, float]]], rounds: int, workers_steps: int, plain_steps: int) -> str:
    med = {k: statistics.median(w for w, _ in v) for k, v in res.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in res.items()}

    def ratio(a: str, b: str, i: int = 0) -> str:
        rs = sorted(x[i] / y[i] for x, y in zip(res[a], res[b]))
        return f"**{statistics.median(rs):.3f}** ({rs[0]:.2f}-{rs[-1]:.2f})"

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan
    small, big = order_peak_bytes(10**4), order_peak_bytes(10**10)
    lines = [
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, 1 torch thread per process, "
        f"torch {torch.__version__}, {rounds} rounds (median), load average {load:.1f} at the end",
        "",
        "| comparison | steps/s (median) | ratio per round: median (range) | goal |",
        "|---|---|---|---|",
        f"| costly samples, inline ({workers_steps} steps, batch 32) | {med['inline']:.2f} | 1 | |",
        f"| costly samples, `data_workers = 2` | {med['workers']:.2f} | {ratio('workers', 'inline')} | >= 1.6 |",
        f"| GPT {GPT_ARGS}, plain PyTorch loop ({plain_steps} steps, batch 16) | {med['plain']:.2f} | 1 | |",
        f"| same, the trainer at its defaults | {med['trainer']:.2f} | {ratio('trainer', 'plain')} | >= 0.98 |",
        f"| same, per CPU second of the process (plain {cpu['plain']:.2f}, trainer {cpu['trainer']:.2f}) "
        f"| | {ratio('trainer', 'plain', 1)} | |",
        "",
        "| data order | n = 10^4 | n = 10^10 | ratio |",
        "|---|---|---|---|",
        f"| keyed bijection (this order), peak bytes over 10,000 batches of 64 | {small:,} | {big:,} "
        f"| {big / small:.2f} |",
        f"| per-epoch `torch.randperm` (the old order), its int64 tensor | {8 * 10**4:,} | {8 * 10**10:,} "
        f"| {10**6:,} |",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--workers-steps", type=int, default=40)
    p.add_argument("--plain-steps", type=int, default=150)
    a = p.parse_args(argv or [])
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    t0 = time.monotonic()
    res = measure(a.rounds, a.workers_steps, a.plain_steps)
    print(table(res, a.rounds, a.workers_steps, a.plain_steps))
    print(f"\n(measured in {time.monotonic() - t0:.0f}s)")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
