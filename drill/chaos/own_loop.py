"""The chaos matrix's own loop: examples/own_loop/train.py (pytorch/examples' MNIST-style script with
its `# spottrain` lines), run as it is by ``python -m trainer run --script drill/chaos/own_loop.py``.
The only difference is the parking of drill.chaos.task: with ``CHAOS_PARK_DIR`` and
``CHAOS_PARK_STEPS`` set, the example's dataset is wrapped in `ParkingDataset`, so that the harness
injects a fault at an exact step of the script's own loop. The script's command line (its
``script_args``) is the example's.
"""
from __future__ import annotations

import os
import runpy
from pathlib import Path

from drill.chaos.task import PARK_BATCH, PARK_DIR, PARK_STEPS, ParkingDataset

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "own_loop" / "train.py"


def main() -> None:
    example = runpy.run_path(str(EXAMPLE), run_name="own_loop_example")  # defines, does not train
    names = example["main"].__globals__  # the namespace the example's main() reads its names from
    folder, steps = os.environ.get(PARK_DIR), os.environ.get(PARK_STEPS)
    if folder and steps:
        dataset = names["Strokes"]
        names["Strokes"] = lambda n: ParkingDataset(dataset(n), Path(folder), [int(s) for s in steps.split(",")],
                                                    int(os.environ.get(PARK_BATCH, "1")))
    example["main"]()


if __name__ == "__main__":
    main()
