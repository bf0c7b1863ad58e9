"""What ends a command with exit status 2 and no traceback: `InputError` and its kinds.

A bad experiment file (`stacks.load.ExperimentError`), dependencies that are not locked or cannot
be fetched (`stacks.wheels.WheelsError`) and code that cannot be packed
(`stacks.delivery.DeliveryError`) each carry `lines`: one line per problem, naming the file (and
field) and what to do. Every entry point (main.py, `make demo`, `make deploy`, `make lock`, ...)
catches this one base, prints the lines on stderr and exits 2.
"""

from __future__ import annotations

import sys


class InputError(Exception):
    """Bad input or an unmet precondition; `lines` holds one human-readable line per problem."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__("\n".join(lines))
        self.lines = lines


def report(err: InputError) -> int:
    """Print the lines on stderr; the exit status (2)."""
    for line in err.lines:
        print(line, file=sys.stderr)
    return 2
