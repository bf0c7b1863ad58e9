"""cdktn app: one TrainingStack per experiment file (`SPOTTRAIN_EXPERIMENTS` overrides which).

Bad experiment files print one line per problem on stderr and exit with status 2.
"""

from __future__ import annotations

import sys

from stacks.app import main

if __name__ == "__main__":
    sys.exit(main())
