"""The suite's order and how xdist's workers share it: the recorded timings, the fast tier, the
multi-process group's lanes, the longest-first order and the scheduler that keeps the cores busy.

tests/durations.json holds each test's wall seconds (setup, call and teardown) and CPU seconds (its
process tree's, `tests/cpu_ledger.py`) from a whole run, `[wall, cpu]` (`pytest -n 3
--record-durations`). With it:

- **The fast tier** (`-m fast`, `make test-fast`: configuration, stacks, units) is every test
  outside SLOW_PATHS (the end-to-end trainer runs, the VM drills, the benchmarks, the walkthrough)
  that the file does not record at FAST_S seconds or more; a new test there runs in the inner loop
  until the file is recorded again.
- **The longest first.** The collection is ordered by blocks: an `xdist_group` by its total, any
  other test with its module by the module's total (a module's tests stay together, in their order).
  The scheduler hands out each block whole, in that order, so a 4-minute drill never starts last
  while the other workers idle, and a module-scoped fixture is set up once.
- **Lanes.** The tests that start several processes each (`MULTI`) are dealt into one lane fewer
  than the workers, so that at most that many run at once.
- **Waiting beside computing.** Many tests mostly wait (on a VM's timers, a lease's TTL, a
  retry's backoff). Three of them at once on two cores leave the cores idle, and in the order by
  length they came together (the VM tests of similar lengths, the small timer tests at the end).
  `CpuAwareScheduling` keeps `workers - cores` *light* blocks (under LIGHT of a core busy in the
  recorded run) running beside the others: a worker takes the longest light block while fewer than
  that run elsewhere, else the longest block that computes, so that the light ones are spread over
  the run instead of filling its end. A block of LONG_S or more starts by its length whatever it is.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

import pytest
from xdist.scheduler import LoadGroupScheduling

from tests.cpu_ledger import MEASURE, cpu_rows, plain_nodeid

DURATIONS = Path(__file__).with_name("durations.json")
FAST_S = 2.0
SLOW_PATHS = ("tests/trainer/e2e/", "tests/bench/", "tests/test_walkthrough.py", "tests/drill/test_drill.py",
              "tests/drill/test_pool_drill.py", "tests/drill/test_lifecycle.py", "tests/drill/test_logs_drill.py",
              "tests/drill/test_boot_scripts.py", "tests/drill/test_chaos.py")
#: The group of the tests that start several processes each (torchrun's ranks, a pool's VMs):
#: several of them at once would crowd the cores until their waits time out. With more than two
#: workers its modules are dealt into lanes (``MULTI-1``, ``MULTI-2``, ...), one fewer than the
#: workers, each a group of its own: at most that many run at once, one worker stays free of them,
#: and no lane is a third of the suite that one worker runs alone.
MULTI = "torchrun"
#: A block whose CPU seconds were under this share of its wall seconds mostly waits (a lease's TTL,
#: a VM's timers, a retry's backoff): the suite's lightest computing blocks used 0.4-0.5 of a core
#: while three workers shared two cores, its waiting ones 0.03-0.37.
LIGHT = 0.4
#: A block this long (a lane, the pool drill, a module of VM drills) goes first by its length, light
#: or not: the suite runs for about 900 s, and such a block started late would run on alone.
LONG_S = 100.0


# --- the recorded timings --------------------------------------------------------------------------
def timings() -> dict[str, tuple[float, float | None]]:
    """Node id -> (wall seconds, CPU seconds) from tests/durations.json (CPU None where a run
    recorded wall seconds only)."""
    raw: dict[str, Any] = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    return {k: (float(v), None) if isinstance(v, (int, float)) else (float(v[0]), float(v[1]))
            for k, v in raw.items()}


def _block(plain: str, group: str | None) -> str:
    """The block of the test `plain` (a node id without a group suffix) in `group`."""
    return f"group:{group}" if group is not None else plain.partition("::")[0]


def block_of(nodeid: str) -> str:
    """The block a test is ordered and scheduled with: its xdist group (the ``@group`` suffix
    loadgroup gives its node id), else its module."""
    plain = plain_nodeid(nodeid)
    return _block(plain, nodeid[len(plain) + 1:] if plain != nodeid else None)


def _block_seconds(nodeids: Iterable[str],
                   known: dict[str, tuple[float, float | None]]) -> dict[str, tuple[float, float | None]]:
    """Block -> (wall, CPU) seconds, the sums of its tests' (CPU None when a test's is not known;
    a test the file does not know counts FAST_S of wall)."""
    out: dict[str, tuple[float, float | None]] = {}
    for nodeid in nodeids:
        block = block_of(nodeid)
        w, c = known.get(plain_nodeid(nodeid), (FAST_S, None))
        wall, cpu = out.get(block, (0.0, 0.0))
        out[block] = (wall + w, None if cpu is None or c is None else cpu + c)
    return out


def light_blocks(nodeids: Iterable[str], known: dict[str, tuple[float, float | None]]) -> set[str]:
    """The blocks that mostly waited in the recorded run (CPU under LIGHT of their wall). A block
    with a test the file does not know, or knows without CPU, counts as computing."""
    return {b for b, (wall, cpu) in _block_seconds(nodeids, known).items() if cpu is not None and cpu < LIGHT * wall}


def long_blocks(nodeids: Iterable[str], known: dict[str, tuple[float, float | None]]) -> set[str]:
    """The blocks of LONG_S or more: they start in order of length, whatever their kind, so that
    none starts late and runs on alone."""
    return {b for b, (wall, _) in _block_seconds(nodeids, known).items() if wall >= LONG_S}


# --- collection: the fast tier, the lanes, the longest first ---------------------------------------
def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--record-durations", action="store_true",
                     help=f"write every test's wall and CPU seconds (setup + call + teardown) into {DURATIONS.name}")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"fast: the inner loop's tier (`make test-fast`): outside the "
                                       f"end-to-end paths, under {FAST_S:g} s in tests/{DURATIONS.name}")
    # Keep the order below: xdist would otherwise sort the groups by their count of tests.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    if config.getoption("--record-durations"):
        config.stash[MEASURE] = True


def _group(item: pytest.Item) -> str | None:
    """The test's xdist group (its closest `xdist_group` marker's name), None outside any."""
    marker = item.get_closest_marker("xdist_group")
    if marker is None:
        return None
    return marker.args[0] if marker.args else marker.kwargs.get("name", "")


def _base_id(item: pytest.Item) -> str:
    """The node id without the `@group` suffix xdist's loadgroup appends."""
    group = _group(item)
    return item.nodeid if group is None else item.nodeid.removesuffix(f"@{group}")


def _workers(config: pytest.Config) -> int:
    """How many xdist workers run the suite (0 without xdist)."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        return int(workerinput["workercount"])
    n = getattr(config.option, "numprocesses", None)
    return n if isinstance(n, int) else 0


def _deal_into_lanes(items: list[pytest.Item], known: dict[str, float], lanes: int) -> None:
    """Put each module of the ``MULTI`` group into one of ``lanes`` groups, longest module first
    into the lane with the fewest seconds so far (the same on every worker: the same collection
    and durations)."""
    seconds: dict[str, float] = {}
    multi = [item for item in items if _group(item) == MULTI]
    for item in multi:
        module = _base_id(item).partition("::")[0]
        seconds[module] = seconds.get(module, 0.0) + known.get(_base_id(item), FAST_S)
    load = [0.0] * lanes
    lane_of: dict[str, int] = {}
    for module in sorted(seconds, key=lambda m: (-seconds[m], m)):
        lane_of[module] = min(range(lanes), key=lambda i: (load[i], i))
        load[lane_of[module]] += seconds[module]
    for item in multi:
        item.add_marker(pytest.mark.xdist_group(f"{MULTI}-{lane_of[_base_id(item).partition('::')[0]] + 1}"))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    known = {k: wall for k, (wall, _) in timings().items()}
    if (lanes := _workers(config) - 1) > 1:
        _deal_into_lanes(items, known, lanes)
    total: dict[str, float] = {}  # a block's seconds
    blocks = []
    for item in items:
        base = _base_id(item)
        seconds = known.get(base)
        if not base.startswith(SLOW_PATHS) and (seconds is None or seconds < FAST_S):
            item.add_marker(pytest.mark.fast)
        # A block: an xdist group (one worker runs it whole), else a module, kept together so that a
        # module-scoped fixture is set up once a worker, never again for a test sorted apart.
        block = _block(base, _group(item))
        total[block] = total.get(block, 0.0) + (seconds if seconds is not None else FAST_S)
        blocks.append(block)
    # Longest block first; inside one, the collection's own order.
    order = sorted(range(len(items)), key=lambda i: (-total[blocks[i]], blocks[i], i))
    items[:] = [items[i] for i in order]


# --- distribution: waiting beside computing ---------------------------------------------------------
def next_unit(queue: list[str], running: list[str], light: set[str], light_at_once: int, long: set[str]) -> int:
    """Which queued unit (by its block, longest first) a worker takes, given the blocks the other
    workers run: the first when its block is long; else the first light one while fewer than
    `light_at_once` light ones run, the first that computes otherwise (the first of either kind when
    the other is used up)."""
    if queue[0] in long:
        return 0
    want_light = sum(b in light for b in running) < light_at_once
    return next((i for i, block in enumerate(queue) if (block in light) == want_light), 0)


class CpuAwareScheduling(LoadGroupScheduling):
    """xdist's loadgroup with two changes: a test outside any group goes with its module (one worker
    runs the module whole, so that a module-scoped fixture, a synthesis or a deployment, is made
    once, never again on each worker that took one of its tests), and `next_unit` chooses which unit
    a worker takes next (module docstring)."""

    def __init__(self, config: pytest.Config, log: Any = None,
                 known: dict[str, tuple[float, float | None]] | None = None, cores: int | None = None) -> None:
        super().__init__(config, log)
        self.known = timings() if known is None else known
        self.cores = len(os.sched_getaffinity(0)) if cores is None else cores
        self._light: set[str] | None = None
        self._long: set[str] = set()

    def _split_scope(self, nodeid: str) -> str:
        return block_of(nodeid)

    def _running(self, node: Any) -> str | None:
        """The block `node` runs now: its first unit with a test not yet done (a unit is a block)."""
        return next((scope for scope, unit in self.assigned_work[node].items() if not all(unit.values())), None)

    def _assign_work_unit(self, node: Any) -> None:
        if self._light is None:  # the collection is complete from the first assignment on
            self._light = light_blocks(self.collection or [], self.known)
            self._long = long_blocks(self.collection or [], self.known)
        running = [b for other in self.assigned_work if other is not node if (b := self._running(other)) is not None]
        queued = list(self.workqueue)
        light_at_once = max(1, len(self.nodes) - self.cores)
        pick = next_unit(queued, running, self._light, light_at_once, self._long)
        self.workqueue.move_to_end(queued[pick], last=False)
        super()._assign_work_unit(node)


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # optional: `-p no:xdist` (make soak) has no such hook
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") == "loadgroup":
        return CpuAwareScheduling(config, log)
    return None


# --- recording ----------------------------------------------------------------------------------------
_running: dict[str, float] = {}
_recorded: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    nodeid = plain_nodeid(report.nodeid)
    _running[nodeid] = _running.get(nodeid, 0.0) + report.duration
    if report.when == "teardown":  # only a test that ran to its end (an interrupted run's last do not)
        _recorded[nodeid] = _running.pop(nodeid)


def pytest_sessionfinish(session: pytest.Session) -> None:
    if not session.config.getoption("--record-durations") or hasattr(session.config, "workerinput"):
        return
    raw: dict[str, Any] = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    cpu = cpu_rows()
    raw.update({k: [round(v, 2), round(cpu.get(k, 0.0), 2)] for k, v in _recorded.items()})
    # One test a line, so that a recording's diff shows what changed.
    DURATIONS.write_text("{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in sorted(raw.items()))
                         + "\n}\n")


__all__ = ["CpuAwareScheduling", "DURATIONS", "FAST_S", "LIGHT", "LONG_S", "MULTI", "SLOW_PATHS", "block_of", "light_blocks",
           "long_blocks", "next_unit", "timings"]
