"""Each rank's own exit status, for the launcher that hides it.

torchrun exits 1 whenever a rank exits non-zero, so the unit around it could not tell a preempted
job (every rank saved and exited 75) or bad input (2) from a crash. With ``SPOTTRAIN_EXIT_DIR``
set (``trainer.sh`` sets it under torchrun), each process records its status there as
``rank-<LOCAL_RANK>``: removed when the process starts, so a rank that dies without recording
(SIGKILL) leaves no stale answer from an earlier round, and written atomically when it exits.
"""
from __future__ import annotations

import os
from pathlib import Path

ENV = "SPOTTRAIN_EXIT_DIR"


def _path() -> Path | None:
    folder = os.environ.get(ENV)
    if not folder:
        return None
    return Path(folder) / f"rank-{os.environ.get('LOCAL_RANK', '0')}"


def starting() -> None:
    """Forget this rank's status of an earlier round (a worker-group restart)."""
    path = _path()
    if path is not None:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def record(code: int) -> None:
    """Leave ``code`` for the launcher's wrapper; never raises (the exit itself matters more)."""
    path = _path()
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(f"{int(code)}\n")
        tmp.replace(path)
    except OSError:
        pass
