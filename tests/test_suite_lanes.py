"""tests/conftest.py's lanes: with more than two xdist workers the multi-process group's modules
are dealt into groups of their own, longest first, each module whole, the same on every worker."""
from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import MULTI, _deal_into_lanes


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
