"""Fixtures of the benchmark tests."""
from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest


@pytest.fixture
def logging_restored() -> Iterator[None]:
    """A benchmark quiets the loggers for its own tables (the root's level and handlers, the
    trainer's level); the tests after it in the same process get them back as they were."""
    root, trainer = logging.getLogger(), logging.getLogger("trainer")
    saved = root.level, list(root.handlers), trainer.level
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in saved[1]:
        root.addHandler(h)
    root.setLevel(saved[0])
    trainer.setLevel(saved[2])
