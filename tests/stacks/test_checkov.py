"""checkov over every stack the suite synthesizes: zero failed checks, skips only from the list."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from stacks import checkov

pytestmark = pytest.mark.xdist_group("stacks")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def report(synthesized):
    files = [s.file for s in synthesized.values()]
    return checkov.run(files), len(files)


def test_no_failed_checks(report):
    result, _ = report
    assert result["failed"] == []
    assert result["parsing_errors"] == 0


def test_checks_actually_ran_on_every_stack(report):
    result, n_files = report
    # 39 checks pass on the example; each stack has at least the bucket, template, firewall...
    assert result["passed"] >= 30 * n_files


def test_each_skip_has_a_reason():
    assert checkov.SKIPS
    for check, reason in checkov.SKIPS.items():
        assert check.startswith("CKV_") and len(reason) > 40


def test_every_skip_is_still_needed(example, synthesized):
    """Without the list, exactly the listed checks fail on the example and the pooled stack
    (its coordinator's own disks): no stale skip hides a fixed problem."""
    result = checkov.run([example.file, synthesized["l4-pool"].file], skips={})
    assert sorted({check for check, _, _ in result["failed"]}) == sorted(checkov.SKIPS)
    pooled = {check for check, _, f in result["failed"] if "l4-pool" in f}
    assert {"CKV_GCP_37", "CKV_GCP_38"} <= pooled


def test_the_skip_list_is_the_only_source_of_skips():
    """No inline `checkov:skip` anywhere and no other --skip-check in the code base."""
    offenders = []
    for path in [*ROOT.glob("stacks/**/*.py"), *ROOT.glob("tests/stacks/**/*.py"),
                 *ROOT.glob("templates/*"), ROOT / "main.py", *ROOT.glob("experiments/*")]:
        if path.name == "test_checkov.py":
            continue
        text = path.read_text()
        if "checkov:skip" in text.replace("`checkov:skip`", ""):
            offenders.append(str(path))
        if "--skip-check" in text and path.name != "checkov.py":
            offenders.append(str(path))
    assert offenders == []
    tree = ast.parse((ROOT / "stacks" / "checkov.py").read_text())
    skip_args = [n for n in ast.walk(tree)
                 if isinstance(n, ast.Constant) and n.value == "--skip-check"]
    assert len(skip_args) == 1


def test_the_repositorys_own_experiments_are_checked(synthesized):
    """Every experiments/*.toml a user starts from is synthesized and checked with the rest."""
    assert {p.stem for p in (ROOT / "experiments").glob("*.toml")} <= set(synthesized)
