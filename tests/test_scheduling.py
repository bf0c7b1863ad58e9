"""tests/scheduling.py's lanes: with more than two xdist workers the multi-process group's modules
are dealt into groups of their own, longest first, each module whole, the same on every worker."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from xdist.scheduler import LoadGroupScheduling

from tests.scheduling import (MULTI, CpuAwareScheduling, _deal_into_lanes, block_of, light_blocks, long_blocks,
                              next_unit)


class _Item:
    """What the dealing reads of a collected test: its node id and its xdist_group markers."""

    def __init__(self, nodeid: str, group: str | None) -> None:
        self.nodeid = nodeid
        self.marks: list[Any] = [pytest.mark.xdist_group(group).mark] if group else []

    def get_closest_marker(self, name: str) -> Any:
        found = [m for m in self.marks if m.name == name]
        return found[-1] if found else None

    def add_marker(self, mark: Any) -> None:
        self.marks.append(mark.mark)


def _groups(items: list[_Item]) -> dict[str, str | None]:
    return {i.nodeid: (m.args[0] if (m := i.get_closest_marker("xdist_group")) else None) for i in items}


def test_modules_are_dealt_longest_first_and_kept_whole() -> None:
    items = [_Item("a.py::t1", MULTI), _Item("a.py::t2", MULTI), _Item("b.py::t", MULTI),
             _Item("c.py::t", MULTI), _Item("d.py::t", "stacks"), _Item("e.py::t", None)]
    known = {"a.py::t1": 50.0, "a.py::t2": 50.0, "b.py::t": 80.0, "c.py::t": 30.0, "d.py::t": 500.0}
    _deal_into_lanes(items, known, 2)
    # a (100 s) to lane 1, b (80 s) to lane 2, c (30 s) to the lighter lane 2; other groups untouched.
    assert _groups(items) == {"a.py::t1": f"{MULTI}-1", "a.py::t2": f"{MULTI}-1", "b.py::t": f"{MULTI}-2",
                              "c.py::t": f"{MULTI}-2", "d.py::t": "stacks", "e.py::t": None}


def test_the_dealing_is_the_same_for_the_same_collection() -> None:
    def dealt() -> dict[str, str | None]:
        items = [_Item(f"m{i}.py::t", MULTI) for i in range(7)]
        _deal_into_lanes(items, {}, 3)  # unknown durations: every module counts alike
        return _groups(items)

    assert dealt() == dealt()
    assert sorted(set(dealt().values())) == [f"{MULTI}-1", f"{MULTI}-2", f"{MULTI}-3"]


# --- waiting beside computing -------------------------------------------------------------------
def test_one_light_block_runs_beside_the_others_and_a_long_block_goes_by_its_length() -> None:
    light = {"lease.py", "boot.py", "scale.py"}
    queue = ["stacks.py", "lease.py", "gpu.py", "boot.py"]
    assert next_unit(queue, ["gpu.py", "fsdp.py"], light, 1, set()) == 1  # none waits: the longest light one
    assert next_unit(queue, ["scale.py", "fsdp.py"], light, 1, set()) == 0  # one waits: the longest that computes
    assert next_unit(queue[1:], ["scale.py", "fsdp.py"], light, 1, set()) == 1
    assert next_unit(queue[1:], ["scale.py", "fsdp.py"], light, 2, set()) == 0  # two may wait at once
    assert next_unit(["lease.py", "boot.py"], ["scale.py"], light, 1, set()) == 0  # only light ones left
    assert next_unit(["gpu.py"], ["fsdp.py"], light, 1, set()) == 0  # only computing ones left
    assert next_unit(queue, ["gpu.py"], light, 1, {"stacks.py"}) == 0  # long: by its length


def test_a_block_is_light_by_its_recorded_cpu_over_its_wall() -> None:
    known: dict[str, tuple[float, float | None]] = {
        "lease.py::a": (30.0, 2.0), "lease.py::b": (10.0, 1.0),  # 3 of 40 s: light
        "stacks.py::a": (10.0, 9.0),  # computes
        "mixed.py::a": (10.0, 0.1), "mixed.py::b": (10.0, 9.0),  # 9.1 of 20 s: computes, as a whole
        "old.py::a": (30.0, None),  # recorded without CPU: counts as computing
        "m.py::a": (30.0, 1.0), "n.py::a": (30.0, 25.0),  # one group, 26 of 60 s: computes
    }
    ids = [*known, "new.py::a", "m.py::a@torchrun-1", "n.py::a@torchrun-1"]
    ids.remove("m.py::a")
    ids.remove("n.py::a")
    assert light_blocks(ids, known) == {"lease.py"}
    assert block_of("m.py::a@torchrun-1") == "group:torchrun-1" and block_of("m.py::t[a@b]") == "m.py"


class _Node:
    """What the scheduler uses of a worker: its id, and the tests it is sent."""

    def __init__(self, name: str) -> None:
        self.gateway = SimpleNamespace(id=name)
        self.shutting_down = False
        self.sent: list[int] = []

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent += indices

    def shutdown(self) -> None:
        self.shutting_down = True


def _scheduled(scheduler: Any, collection: list[str]) -> dict[str, list[str]]:
    nodes = [_Node(f"gw{i}") for i in range(3)]
    for node in nodes:
        scheduler.add_node(node)
    for node in nodes:
        scheduler.add_node_collection(node, collection)
    scheduler.schedule()
    return {n.gateway.id: [collection[i] for i in n.sent] for n in nodes}


def test_three_workers_on_two_cores_keep_one_waiting_test_beside_two_that_compute() -> None:
    # The order scheduling.py gives them: longest block first. The drill is long; three blocks mostly
    # wait (a lease's TTL, a VM's timers), one computes.
    known: dict[str, tuple[float, float | None]] = {
        "drill.py::a": (120.0, 100.0), "boot.py::a": (30.0, 3.0), "lease.py::a": (20.0, 1.0),
        "lease.py::b": (20.0, 1.0), "scale.py::a": (25.0, 1.0), "stack.py::a": (5.0, 5.0), "stack.py::b": (5.0, 5.0),
        "stack.py::c": (5.0, 5.0)}
    collection = ["drill.py::a", "lease.py::a", "lease.py::b", "boot.py::a", "scale.py::a", "stack.py::a",
                  "stack.py::b", "stack.py::c"]
    assert long_blocks(collection, known) == {"drill.py"}
    config = SimpleNamespace(getvalue=lambda name: ["popen"] * 3 if name == "tx" else None,
                             option=SimpleNamespace(loadscopereorder=False))

    # xdist's loadgroup hands them out in order: beside the drill, two workers waiting.
    plain = _scheduled(LoadGroupScheduling(config), collection)
    assert [sent[0] for sent in plain.values()] == ["drill.py::a", "lease.py::a", "lease.py::b"]

    # Ours: the long drill first, then one light module beside it and a module that computes, each
    # module whole on one worker. A worker's next module is chosen the same way: beside a light one
    # the next that computes (none is left: the first), beside none a light one.
    ours = _scheduled(CpuAwareScheduling(config, known=known, cores=2), collection)
    assert ours == {"gw0": ["drill.py::a", "boot.py::a"], "gw1": ["lease.py::a", "lease.py::b", "scale.py::a"],
                    "gw2": ["stack.py::a", "stack.py::b", "stack.py::c"]}
