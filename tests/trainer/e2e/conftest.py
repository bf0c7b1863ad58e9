"""End-to-end trainer tests (real subprocesses, real signals).

The long crash-consistency runs are marked ``soak``: the suite's addopts deselect them
(``-m "not soak"``), and ``make soak`` selects them with ``-m soak``.
"""
from __future__ import annotations

import pytest

from tests.trainer.support import REFERENCE_STEPS, run_to_end, status, write_config


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """`status` of an uninterrupted 40-step run with the test config (once per worker); the
    checkpoint cadence is not part of the run, so every interrupted run must end at this digest."""
    d = tmp_path_factory.mktemp("reference")
    run_to_end(d / "run", REFERENCE_STEPS, write_config(d), "--checkpoint-every-steps", "10")
    s = status(d / "run")
    assert s["latest_step"] == REFERENCE_STEPS
    return s
