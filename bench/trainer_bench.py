"""Trainer loop throughput with checkpointing against the same loop without it.

Runs the real loop in-process (`trainer.train.run`) on a bigger GPT than the test one, side by
side, alternating variants so that the load of the machine hits both alike:

- ``no checkpoints``: a checkpointer that is never due (the baseline);
- ``defaults``: the real Checkpointer with the default (automatic Young/Daly) interval: the first
  save comes 60 s after start, then every sqrt(2 x save cost x MTBF), so runs last over a minute;
- ``every N steps``: the real Checkpointer saving asynchronously every N steps (the worst case a
  user may configure), to show what one async snapshot costs the loop.

Goal: steps/s with checkpointing at the defaults / without >= 0.99.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

BENCH_TASK_ARGS = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64, "stride": 16}


class _NeverDue:
    """The same loop with checkpointing switched off."""

    stats: dict[str, Any] = {"saves": 0, "blocked_s_total": 0.0}
    LIST_TIMEOUT_S = 60.0
    layout = SimpleNamespace(in_place=False)  # whole-model: the loop loads what restore returns
    on_durable: Any = None  # the session sets these hooks on any checkpointer
    on_tier_health: Any = None
    steps_seen: set[int] | None = None  # no survey: nothing for the rollback guard to compare
    set_aside: Any = None  # nothing planted to set aside

    def __init__(self, tiers: Any) -> None:
        self.tiers = tiers

    def bind(self, model: Any, optimizer: Any, *, named: dict[str, Any] | None = None) -> None:
        pass

    def before_update(self, timeout: float | None = None) -> bool:
        return True

    def restore(self, *, download: bool = True) -> None:
        return None

    def due(self, step: int) -> bool:
        return False

    def wait(self) -> None:
        pass

    def save(self, step: int, state: dict, *, meta: dict | None = None, every_tier: bool = False) -> float:
        return 0.0  # the final save at the end of the run: outside the timed loop, skipped here

    def durable(self, step: int, *, deadline: float) -> Any:
        from trainer.checkpoint.checkpointer import Durability

        return Durability(step, {"persistent": "ok"})

    def failing(self) -> dict:
        return {}

    def close(self, timeout: float | None = None) -> bool:
        return True


def _one(variant: str, steps: int, every: int, root: Path) -> dict[str, Any]:
    from trainer.config import RunConfig
    from trainer.train import _default_checkpointer, run

    run_dir = Path(tempfile.mkdtemp(dir=root))
    cfg = RunConfig(run_dir=run_dir, steps=steps, health_port=None, watch_metadata=False,
                    log_every_steps=10**9, batch_size=16, task_args=BENCH_TASK_ARGS,
                    checkpoint_every_steps=every if variant == "every" else None)
    made: list[Any] = []

    def make(c: RunConfig) -> Any:
        made.append(_NeverDue(c.tier_table()) if variant == "none" else _default_checkpointer(c))
        return made[0]

    out = run(cfg, make_checkpointer=make)
    assert out.code == 0, f"bench run failed ({variant}): exit {out.code}"
    stats = made[0].stats
    return {"steps_per_s": out.steps_run / out.loop_s, "loop_s": out.loop_s,
            "saves": stats["saves"], "blocked_s": stats["blocked_s_total"]}


def measure(steps: int, rounds: int, every: int) -> dict[str, list[dict[str, Any]]]:
    import logging

    results: dict[str, list[dict[str, Any]]] = {"none": [], "defaults": [], "every": []}
    with tempfile.TemporaryDirectory() as tmp:
        _one("none", 20, every, Path(tmp))  # warm-up: allocator, caches, lazy imports
        order = list(results)
        for i in range(rounds):
            for variant in order[i % 3:] + order[:i % 3]:  # rotate: no variant always runs first
                results[variant].append(_one(variant, steps, every, Path(tmp)))
                logging.getLogger().setLevel(logging.WARNING)
    return results


def table(results: dict[str, list[dict[str, Any]]], steps: int, every: int) -> str:
    import torch

    base = statistics.median(r["steps_per_s"] for r in results["none"])
    names = {"none": "no checkpoints", "defaults": "checkpointing at the defaults (auto interval)",
             "every": f"async checkpoint every {every} steps"}
    mean_s = statistics.mean(r["loop_s"] for rs in results.values() for r in rs)
    lines = [
        f"Trainer loop, GPT {BENCH_TASK_ARGS} batch 16, {steps} steps x {len(results['none'])} rounds, "
        f"1 torch thread, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{mean_s:.0f} s per run",
        "",
        "| variant | steps/s (median) | ratio vs no checkpoints | saves per run | loop blocked by saves "
        "(s, median) | 1 - blocked/loop time |",
        "|---|---|---|---|---|---|",
    ]
    for key, rs in results.items():
        sps = statistics.median(r["steps_per_s"] for r in rs)
        blocked = statistics.median(r["blocked_s"] for r in rs)
        unblocked = statistics.median(1 - r["blocked_s"] / r["loop_s"] for r in rs)
        lines.append(f"| {names[key]} | {sps:.2f} | {sps / base:.3f} | {statistics.median(r['saves'] for r in rs):.0f} "
                     f"| {blocked:.3f} | {unblocked:.4f} |")
    lines += ["", "The ratio compares whole runs and carries the machine's noise (other jobs on shared "
              "cores); the last column is the loop's own cost of checkpointing, which noise does not inflate."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=450)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--every", type=int, default=25)
    a = p.parse_args(argv or [])  # `python -m bench` calls main() with its own argv in sys.argv
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.monotonic()
    results = measure(a.steps, a.rounds, a.every)
    print(table(results, a.steps, a.every))
    print(f"\n(measured in {time.monotonic() - t0:.0f}s)")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
