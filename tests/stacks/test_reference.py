"""The generated reference pages match the code, and the code documents every setting."""
from __future__ import annotations

import pytest

from stacks import reference


@pytest.mark.parametrize("name", sorted(reference.PAGES))
def test_reference_page_is_current(name: str) -> None:
    path = reference.PAGES[name]
    expected = reference.pages()[path]
    assert path.exists() and path.read_text() == expected, (
        f"{path.name} is out of date with the code: run `make docs` and commit it")


def test_every_trainer_setting_and_flag_is_documented() -> None:
    from trainer.config import RunConfig

    models = [RunConfig, *reference._nested_models(RunConfig)]
    missing = [f"{m.__name__}.{n}" for m in models for n, f in m.model_fields.items() if not f.description]
    assert missing == []
    page = reference.trainer_page()
    assert "|  |" not in page.replace("| flag | meaning |", "")  # no flag without help text


def test_a_field_change_shows_in_the_page() -> None:
    from stacks.experiment import Gcp

    info = Gcp.model_fields["region"]
    old = info.description
    try:
        info.description = "a changed description"
        assert "a changed description" in reference.experiment_page()
    finally:
        info.description = old
