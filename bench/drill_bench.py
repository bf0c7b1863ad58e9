"""The preemption drill's cost: wall time of `make demo`'s drill and what each preemption took.

Side by side in one run: the uninterrupted reference against the same job preempted twice (one
wiped disk), each emergency save against the 30 s Spot window, and the goodput the drill measured.
Needs root (namespaces, loop devices); prints a note and no table otherwise.
"""
from __future__ import annotations

import os
import platform
import time

from drill.drill import DrillConfig, run_drill


def _machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} CPUs, Linux {platform.release()}, Python {platform.python_version()}"


def main() -> None:
    if os.geteuid() != 0:
        print("drill_bench: skipped (needs root for namespaces and loop devices)")
        return
    cfg = DrillConfig(steps=200, preemptions=2, wipe_disk_after=(1,), seed=0)
    t0 = time.monotonic()
    r = run_drill(cfg, say=lambda s: None)
    total = time.monotonic() - t0
    g = r.status.get("goodput", {})
    print(f"machine: {_machine()}; `python -m drill --steps 200 --wipe-disk-round 1` (2 preemptions)\n")
    print("| measure | value | ratio |")
    print("|---|---|---|")
    print(f"| whole drill (reference + drill + status) | {total:.1f} s | |")
    print(f"| reference run, uninterrupted | {r.reference_s:.1f} s | 1.00 |")
    print(f"| preempted run, 3 VMs | {r.drill_s:.1f} s | {r.drill_s / r.reference_s:.2f} x reference |")
    for p in r.preemptions:
        save = p.save_s if p.save_s is not None else float("nan")
        print(f"| preemption {p.index}: emergency save (notice -> durable) | {save:.2f} s | "
              f"{save / cfg.window_s:.1%} of the {cfg.window_s:g} s window |")
        print(f"| preemption {p.index}: unit stopped after notice | {p.unit_stopped_s or float('nan'):.2f} s | "
              f"{(p.unit_stopped_s or float('nan')) / cfg.window_s:.1%} of the window |")
    print(f"| goodput of the preempted job | {100 * g.get('goodput', 0):.1f}% | |")
    print(f"| digest equal to the reference | {'yes' if r.ok else 'NO'} | |")
