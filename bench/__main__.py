"""Run the benchmarks: `python -m bench [NAME ...]` (NAME is a module stem such as `synth_bench`).

Each benchmark module has a `main()` that prints a markdown table with the machine it ran on and
its ratios; BENCHMARKS.md records those tables with the command that produced them.
"""
from __future__ import annotations

import importlib
import os
import pkgutil
import sys
import tempfile
from pathlib import Path


def main(argv: list[str]) -> int:
    # The trainers the benchmarks start sign their checkpoints with a throwaway key of their own,
    # never the user's per-user default (trainer.checkpoint.key).
    if not os.environ.get("SPOTTRAIN_CHECKPOINT_KEY_FILE"):
        key = Path(tempfile.mkdtemp(prefix="spottrain-bench-key-")) / "checkpoint.key"
        key.write_bytes(os.urandom(32))
        key.chmod(0o600)
        os.environ["SPOTTRAIN_CHECKPOINT_KEY_FILE"] = str(key)
    here = Path(__file__).parent
    available = sorted(m.name for m in pkgutil.iter_modules([str(here)]) if m.name.endswith("_bench"))
    chosen = argv or available
    unknown = sorted(set(chosen) - set(available))
    if unknown:
        print(f"bench: unknown benchmark(s) {', '.join(unknown)}; available: {', '.join(available)}", file=sys.stderr)
        return 2
    for name in chosen:
        print(f"\n## {name}\n", flush=True)
        importlib.import_module(f"bench.{name}").main()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
