"""`python -m drill.chaos`: run the chaos matrix (or `--cells`/`CHAOS_CELLS` a part of it) and print
its table. Exit 0 when every cell kept the promise, 1 when one did not, 2 on bad input or without
root (real filesystems are mounted)."""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m drill.chaos", description=__doc__)
    p.add_argument("--cells", default=os.environ.get("CHAOS_CELLS", ""),
                   help="comma-separated FAULT:MOMENT globs, e.g. 'gcs-*:startup,pd-full' (default: "
                        "$CHAOS_CELLS, else every cell)")
    p.add_argument("--list", action="store_true", help="list the cells (and why some are n/a) and exit")
    p.add_argument("--fault-model", action="store_true", help="print RELIABILITY.md's fault model table and exit")
    p.add_argument("--keep", type=Path, help="keep every cell's disks' images, logs and results in this directory")
    p.add_argument("--markdown", type=Path, help="also write the report to this file")
    p.add_argument("--record", type=Path, metavar="RELIABILITY.md",
                   help="write the report and the fault model into this file's marked blocks (a full run)")
    a = p.parse_args(argv)

    from drill.chaos.faults import FAULTS
    from drill.chaos.matrix import cells

    if a.fault_model:
        from drill.chaos.report import fault_model

        print(fault_model())
        return 0
    if a.record and a.cells:
        print("chaos: --record is for a full run (without --cells/CHAOS_CELLS)", file=sys.stderr)
        return 2
    selected = cells(a.cells)
    if not selected:
        print(f"chaos: no cell matches {a.cells!r}; faults: {', '.join(FAULTS)}; moments: "
              "startup, periodic, emergency, final, restore", file=sys.stderr)
        return 2
    if a.list:
        for key, moment in selected:
            na = FAULTS[key].na.get(moment)
            print(f"{key}:{moment}" + (f"  n/a: {na}" if na else ""))
        return 0
    from drill.small_fs import SmallFs

    if not (SmallFs.possible("ext4") and SmallFs.possible("tmpfs")):
        print("chaos: needs root (it mounts real ext4 and tmpfs disks; loop devices)", file=sys.stderr)
        return 2

    from drill.chaos.matrix import run_matrix
    from drill.chaos.report import summary

    workdir = a.keep or Path(tempfile.mkdtemp(prefix="spottrain-chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    t0, load = time.monotonic(), os.getloadavg()
    try:
        results = run_matrix(selected, workdir, log=lambda line: print(line, file=sys.stderr, flush=True))
    finally:
        if a.keep is None:
            shutil.rmtree(workdir, ignore_errors=True)
    command = "make chaos" + (f" CHAOS_CELLS={a.cells}" if a.cells else "")
    report = summary(results, time.monotonic() - t0, command, load)
    print(report)
    if a.markdown:
        a.markdown.write_text(report + "\n")
    if a.record:
        from drill.chaos.report import embed, fault_model

        a.record.write_text(embed(embed(a.record.read_text(), "results", report), "fault-model", fault_model()))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
