"""`python -m trainer`: see trainer.cli."""
from __future__ import annotations

import sys

from trainer import exit_status
from trainer.cli import main

if __name__ == "__main__":
    exit_status.starting()
    try:
        code = main()
    except SystemExit as e:  # argparse's usage errors exit 2 from inside main()
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    exit_status.record(code)
    sys.exit(code)
