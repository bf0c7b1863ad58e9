"""`python -m drill`: the local preemption drill (see drill/drill.py). Exit 0 when the final model
digest equals the uninterrupted reference run's, 1 when it differs or the drill fails, 2 on bad
input."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from drill.drill import DrillConfig, DrillFailure, check, render, run_drill

#: `--soak`: a longer run with more preemptions, two of them on a wiped disk.
SOAK = {"steps": 3000, "preemptions": 8, "wipe_disk_after": (3, 6)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m drill", description=__doc__)
    p.add_argument("--experiment", type=Path, default=DrillConfig.experiment, help="experiment TOML (default: the example)")
    p.add_argument("--preemptions", type=int, help="K preemptions (default 2; soak 8)")
    p.add_argument("--wipe-disk-round", type=int, action="append", dest="wipe",
                   help="after preemption N the next VM gets a blank disk (repeatable)")
    p.add_argument("--steps", type=int, help="total training steps (default 300; soak 3000)")
    p.add_argument("--seed", type=int, default=0, help="seeds the preemption moments")
    p.add_argument("--window", type=float, default=30.0, help="seconds from notice to hard power-off (default 30)")
    p.add_argument("--soak", action="store_true", help=f"the long setting: {SOAK}")
    p.add_argument("--keep", type=Path, help="keep VM state, journals and disks in this directory")
    a = p.parse_args(argv)
    base = dict(SOAK) if a.soak else {}
    for key, value in (("steps", a.steps), ("preemptions", a.preemptions)):
        if value is not None:
            base[key] = value
    if a.wipe is not None:
        base["wipe_disk_after"] = tuple(a.wipe)
    cfg = DrillConfig(experiment=a.experiment, seed=a.seed, window_s=a.window, workdir=a.keep, **base)
    from stacks.load import ExperimentError

    try:
        check(cfg)
        render(cfg, health_port=8471)  # the experiment file: validated before anything starts
    except ValueError as e:
        print(f"drill: {e}", file=sys.stderr)
        return 2
    except ExperimentError as e:
        print("\n".join(e.lines), file=sys.stderr)
        return 2
    except OSError as e:
        print(f"drill: {a.experiment}: {e.strerror or e}", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("drill: needs root (mount and PID namespaces, loop devices)", file=sys.stderr)
        return 2
    try:
        result = run_drill(cfg)
    except ValueError as e:
        print(f"drill: {e}", file=sys.stderr)
        return 2
    except DrillFailure as e:
        print(f"drill FAILED: {e}", file=sys.stderr)
        return 1
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
