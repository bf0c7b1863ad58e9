"""`python -m trainer`: see trainer.cli."""
from __future__ import annotations

import sys

from trainer.cli import main

if __name__ == "__main__":
    sys.exit(main())
