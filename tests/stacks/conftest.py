"""Fixtures for the stack tests: every variant synthesized once per session.

Synthesis is cheap once cdktn is imported (~0.1 s) but the import is not (~5 s), so the tests
that synthesize share these; `xdist_group("stacks")` keeps them on one worker.
"""

from __future__ import annotations

import pytest
from stack_support import EXPERIMENTS, FIXTURES, VARIANTS, Synthesized, variant

from stacks.load import load_all


@pytest.fixture(scope="session")
def synthesized() -> dict[str, Synthesized]:
    """Every variant, plus the experiment files under fixtures/ and the repository's own
    experiments/ (checkov sees them all)."""
    found = {name: Synthesized(name, variant(o, name)) for name, o in VARIANTS.items()}
    for e in [*load_all(FIXTURES), *load_all(EXPERIMENTS)]:
        if e.name not in found:  # experiments/example.toml is the "example" variant
            found[e.name] = Synthesized(e.name, e.spec)
    return found


@pytest.fixture(scope="session")
def example(synthesized) -> Synthesized:
    return synthesized["example"]
