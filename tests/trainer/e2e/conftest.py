"""End-to-end trainer tests (real subprocesses, real signals).

The long crash-consistency runs are marked ``soak``; they run only when asked for with ``-m soak``
(``make soak``), so the default suite stays fast.
"""
from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "soak" in (config.getoption("-m") or ""):
        return
    keep, drop = [], []
    for item in items:
        mine = HERE in Path(str(item.fspath)).parents
        (drop if mine and item.get_closest_marker("soak") else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
