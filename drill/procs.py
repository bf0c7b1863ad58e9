"""Process trees, for the stand-ins of a VM losing power outside a PID namespace (the tests and
the benchmarks): torchrun starts its workers in sessions of their own, so killing an agent's
process group spares them; these helpers find and kill the whole tree."""
from __future__ import annotations

import contextlib
import os
import signal


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{entry}/stat") as f:
                children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def power_off(pid: int) -> None:
    """SIGKILL ``pid`` and every descendant at once."""
    for p in [pid, *descendants(pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
