"""`python -m drill`: the local preemption drill (see drill/drill.py). Exit 0 when the final model
digest equals the uninterrupted reference run's, 1 when it differs or the drill fails, 2 on bad
input.

`--nodes N` (2 to 4) drills a multi-node pool instead (drill/pool_drill.py): an on-demand
coordinator that trains and N-1 Spot workers, each a drill VM booted from the experiment's real
pooled scripts (the drill's [pool]: min_nodes 1, max_nodes N), sharing one bucket; the workers
are preempted in turn and brought back; every preemption must be a coordinated save (no step
lost) and the final model must equal a run taking the same world-size path (replayed with
torchrun --standalone)."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from drill.drill import DrillConfig, DrillFailure, check, drill_wheels, render, run_drill
from drill.pool_drill import check_pool, drill_pool, run_pool_drill

#: `--soak`: a longer run with more preemptions, two of them on a wiped disk.
SOAK = {"steps": 3000, "preemptions": 8, "wipe_disk_after": (3, 6)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m drill", description=__doc__)
    p.add_argument("--experiment", default=str(DrillConfig.experiment),
                   help="the experiment to drill: a TOML file, or NAME for experiments/NAME.toml (default: the "
                        "example; `make drill EXPERIMENT=...`). Its machine's gpu_count sets the processes per VM "
                        "(drill/experiments/two-gpus.toml: torchrun with 2 ranks, gloo on CPU)")
    p.add_argument("--preemptions", type=int, help="K preemptions (default 2; soak 8)")
    p.add_argument("--wipe-disk-round", type=int, action="append", dest="wipe",
                   help="after preemption N the next VM gets a blank disk (repeatable)")
    p.add_argument("--steps", type=int, help="total training steps (default 300; soak 3000)")
    p.add_argument("--seed", type=int, default=0, help="seeds the preemption moments")
    p.add_argument("--window", type=float, default=DrillConfig.window_s,
                   help=f"seconds from notice to hard power-off (default {DrillConfig.window_s:g}, a Spot VM's)")
    p.add_argument("--soak", action="store_true", help=f"the long setting: {SOAK}")
    p.add_argument("--keep", type=Path, help="keep VM state, journals and disks in this directory")
    p.add_argument("--nodes", type=int, default=1,
                   help="training VMs: 1 (default) the single-VM drill; 2-4 a pool: an on-demand coordinator "
                        "and N-1 Spot workers, preempted in turn (a wiped disk is then the worker's)")
    a = p.parse_args(argv)
    base = dict(SOAK) if a.soak else {}
    for key, value in (("steps", a.steps), ("preemptions", a.preemptions)):
        if value is not None:
            base[key] = value
    if a.wipe is not None:
        base["wipe_disk_after"] = tuple(a.wipe)
    from stacks.errors import InputError, report
    from stacks.load import resolve

    try:
        experiment = resolve(a.experiment)
    except InputError as e:
        return report(e)
    cfg = DrillConfig(experiment=experiment, seed=a.seed, window_s=a.window, workdir=a.keep, nodes=a.nodes, **base)
    try:
        check(cfg) if cfg.nodes == 1 else check_pool(cfg)
        render(cfg, health_port=8471)  # the experiment file: validated before anything starts
        if cfg.nodes > 1:
            render(cfg, health_port=8471, pool=drill_pool(cfg))
        drill_wheels(cfg)  # the lock for the drill's Python, fetched before anything starts
    except ValueError as e:
        print(f"drill: {e}", file=sys.stderr)
        return 2
    except InputError as e:  # a bad experiment file, no lock for this Python, a failed fetch
        return report(e)
    except OSError as e:
        print(f"drill: {a.experiment}: {e.strerror or e}", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("drill: needs root (mount and PID namespaces, loop devices)", file=sys.stderr)
        return 2
    try:
        result = run_drill(cfg) if cfg.nodes == 1 else run_pool_drill(cfg)
    except ValueError as e:
        print(f"drill: {e}", file=sys.stderr)
        return 2
    except DrillFailure as e:
        print(f"drill FAILED: {e}", file=sys.stderr)
        return 1
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
