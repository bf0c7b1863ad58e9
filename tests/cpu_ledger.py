"""The suite's CPU ledger (`pytest --cpu-ledger FILE`): each test's CPU seconds, its own and its
processes'.

The 2-core machine's suite is bound by CPU, not by waiting, so wall seconds (tests/durations.json)
say little about what to cut. Around each test (setup, call, teardown) the worker sums user + system
time over its process tree read from /proc: every live descendant's own time plus what it has reaped
(`cutime`/`cstime`), so a trainer forked by the zygote, a torchrun rank or a boot script's child all
count to the test that ran while they did. A process reparented away from the tree before it ends (a
double-forked daemon) is not counted; a worker's long-lived helpers (its emulator, its zygote) count
to the tests during which they worked. The controller merges the workers' rows into FILE.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

import pytest

_TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: str) -> tuple[int, float] | None:
    """(parent pid, CPU seconds of the process and what it has reaped), None once it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = raw[raw.rindex(b")") + 2:].split()  # the name may hold spaces and parentheses
    utime, stime, cutime, cstime = (int(f) for f in fields[11:15])
    return int(fields[1]), (utime + stime + cutime + cstime) / _TICK


def tree_cpu(root: int) -> float:
    """CPU seconds of `root` and its live descendants, each with what it has reaped."""
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(entry)) is not None:
            parent[int(entry)], cpu[int(entry)] = st
    total = 0.0
    for pid, seconds in cpu.items():
        p = pid
        while p not in (root, 0, 1) and p in parent:
            p = parent[p]
        if p == root:
            total += seconds
    return total


def plain_nodeid(nodeid: str) -> str:
    """The node id without the ``@group`` suffix xdist's loadgroup appends (durations and the
    ledger are kept by the test, whichever lane ran it)."""
    return nodeid.split("@")[0] if "@" in nodeid.rpartition("::")[2] else nodeid


_rows: dict[str, float] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any) -> Iterator[None]:
    if not item.config.getoption("--cpu-ledger"):
        yield
        return
    before = tree_cpu(os.getpid())
    yield
    _rows[plain_nodeid(item.nodeid)] = round(tree_cpu(os.getpid()) - before, 2)


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = session.config.getoption("--cpu-ledger")
    if not path:
        return
    workerinput = getattr(session.config, "workerinput", None)
    if workerinput is not None:  # a worker leaves its rows beside FILE; the controller merges them
        Path(f"{path}.{workerinput['workerid']}").write_text(json.dumps(_rows))
        return
    rows = dict(_rows)
    for part in sorted(Path(path).parent.glob(f"{Path(path).name}.*")):
        rows.update(json.loads(part.read_text()))
        part.unlink()
    Path(path).write_text(json.dumps(dict(sorted(rows.items(), key=lambda kv: -kv[1])), indent=0) + "\n")
