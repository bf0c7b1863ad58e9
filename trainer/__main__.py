"""`python -m trainer`: see trainer.cli."""
from __future__ import annotations

import sys

from trainer import collector, startup_notice

if __name__ == "__main__":
    if sys.argv[1:2] == ["run"]:
        collector.pause()  # until torch and the trainer are loaded (trainer.collector)
        # Before any heavy import: a preemption notice from here on ends in exit 75 with a line,
        # not in death by signal (the other commands keep the default: SIGTERM stops them).
        startup_notice.install()
        startup_notice.hold("main")
    from trainer import exit_status
    from trainer.cli import main

    exit_status.starting()
    try:
        code = main()
    except SystemExit as e:  # argparse's usage errors exit 2 from inside main()
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    exit_status.record(code)
    sys.exit(code)
