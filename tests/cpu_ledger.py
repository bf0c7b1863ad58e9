"""The suite's CPU ledger (`pytest --cpu-ledger FILE`): each test's CPU seconds, its own and its
processes'.

The 2-core machine's suite is bound by CPU, not by waiting, so wall seconds (tests/durations.json)
say little about what to cut. Around each test (setup, call, teardown) the worker sums user + system
time over its process tree read from /proc: every live descendant's own time plus what it has reaped
(`cutime`/`cstime`), so a trainer forked by the zygote, a torchrun rank or a boot script's child all
count to the test that ran while they did. A process reparented away from the tree before it ends (a
double-forked daemon) is not counted; a worker's long-lived helpers (its emulator, its zygote) count
to the tests during which they worked. Each test's teardown report carries its figure to the
controller, which writes FILE.
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
    # xdist's own test: an "@" after the last "]" (a parameter's id may hold one)
    return nodeid.rpartition("@")[0] if nodeid.rfind("@") > nodeid.rfind("]") else nodeid


#: Set by a plugin that needs the figures without a ledger file (`--record-durations`).
MEASURE = pytest.StashKey[bool]()
_USER_PROPERTY = "cpu_s"
_started = pytest.StashKey[float]()
_rows: dict[str, float] = {}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cpu-ledger", metavar="FILE", default=None,
                     help="write every test's CPU seconds, its own and its processes' (tests/cpu_ledger.py)")


def _measuring(config: pytest.Config) -> bool:
    return bool(config.getoption("--cpu-ledger") or config.stash.get(MEASURE, False))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any) -> Iterator[None]:
    if _measuring(item.config):
        item.stash[_started] = tree_cpu(os.getpid())
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    # The teardown's report carries the test's figure (setup, call and teardown) to the controller,
    # as xdist carries every report.
    if call.when == "teardown" and _started in item.stash:
        item.user_properties.append((_USER_PROPERTY, round(tree_cpu(os.getpid()) - item.stash[_started], 2)))
    yield


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    for name, value in report.user_properties:
        if name == _USER_PROPERTY:
            _rows[plain_nodeid(report.nodeid)] = float(value)


def cpu_rows() -> dict[str, float]:
    """Node id -> CPU seconds of every test this process has seen reported (the controller: all)."""
    return dict(_rows)


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = session.config.getoption("--cpu-ledger")
    if path and not hasattr(session.config, "workerinput"):
        Path(path).write_text(json.dumps(dict(sorted(_rows.items(), key=lambda kv: -kv[1])), indent=0) + "\n")
