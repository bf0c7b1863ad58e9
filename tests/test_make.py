"""The Makefile's targets for one experiment, run as a newcomer's fresh shell would run them.

`make -o .venv/.setup-stamp -o .venv/.setup-dev-stamp` treats the environment as set up (the
suite's .venv is): nothing here installs anything. A fresh shell's PATH is /usr/bin:/bin, where this machine's system Node (if
any) is too old for cdktn: the targets must use the venv's Node anyway.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FRESH_PATH = "/usr/bin:/bin"


def make(*args: str, path: str = FRESH_PATH) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PATH", "VIRTUAL_ENV", "MAKEFLAGS")}
    return subprocess.run(["/usr/bin/make", "--no-print-directory", "-o", ".venv/.setup-stamp", "-o",
                           ".venv/.setup-dev-stamp", *args],
                          cwd=ROOT, env={**env, "PATH": path}, capture_output=True, text=True,
                          timeout=120)


def fake_terraform(tmp_path: Path, name: str = "terraform") -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / name).write_text("#!/bin/sh\necho 'Terraform v1.9.0'\n")
    (bin_dir / name).chmod(0o755)
    return f"{bin_dir}:{FRESH_PATH}"


@pytest.mark.parametrize("verb", ["deploy", "diff", "destroy", "output"])
def test_each_verb_runs_cdktn_for_the_named_experiment_with_the_venvs_node(tmp_path, verb):
    proc = make(verb, "EXPERIMENT=example", "CDKTN_ARGS=--dry-run", path=fake_terraform(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == (
        f"SPOTTRAIN_EXPERIMENTS={ROOT}/experiments/example.toml CHECKPOINT_DISABLE=1 "
        f"DISABLE_VERSION_CHECK=1 {ROOT}/.venv/bin/npx cdktn {verb} example")
    assert f"({ROOT}/.venv/bin/node)" in proc.stderr


def test_a_path_and_opentofu_work_too(tmp_path):
    path = fake_terraform(tmp_path, "tofu")
    proc = make("diff", "EXPERIMENT=experiments/example.toml", "CDKTN_ARGS=--dry-run", path=path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1].startswith(
        "SPOTTRAIN_EXPERIMENTS=experiments/example.toml CHECKPOINT_DISABLE=1 "
        "DISABLE_VERSION_CHECK=1 TERRAFORM_BINARY_NAME=tofu ")


def test_without_terraform_it_says_what_is_missing():
    proc = make("deploy", "EXPERIMENT=example")
    assert proc.returncode != 0
    assert "neither `terraform` (>= 1.5) nor `tofu` (OpenTofu >= 1.6) is on PATH" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_missing_or_unknown_experiment_is_named(tmp_path):
    proc = make("deploy", path=fake_terraform(tmp_path))
    assert proc.returncode != 0 and "which experiment? make deploy EXPERIMENT=name" in proc.stderr
    proc = make("destroy", "EXPERIMENT=nope", path=fake_terraform(tmp_path))
    listed = ", ".join(sorted(p.stem for p in (ROOT / "experiments").glob("*.toml")))
    assert f"experiments/nope.toml: no such experiment file (experiments/: {listed})" in proc.stderr


def test_make_drill_takes_an_experiment():
    proc = make("-n", "drill", "EXPERIMENT=drill/experiments/two-gpus.toml")
    assert proc.returncode == 0, proc.stderr
    assert ".venv/bin/python -m drill --experiment drill/experiments/two-gpus.toml" in proc.stdout


def test_make_lifecycle_takes_an_experiment_and_its_arguments():
    proc = make("-n", "lifecycle", "EXPERIMENT=cnn", "LIFECYCLE_ARGS=--preemptions 2 --steps 180")
    assert proc.returncode == 0, proc.stderr
    assert ".venv/bin/python -m drill.lifecycle --experiment cnn --preemptions 2 --steps 180" in proc.stdout


def test_make_chaos_takes_a_selection_of_cells():
    proc = make("-n", "chaos", "CHAOS_CELLS=gcs-*:startup,pd-full")
    assert proc.returncode == 0, proc.stderr
    assert ".venv/bin/python -m drill.chaos --cells 'gcs-*:startup,pd-full'" in proc.stdout


def test_deploy_without_a_lock_says_to_run_make_lock_before_cdktn_starts(tmp_path):
    code = tmp_path / "code"
    code.mkdir()
    (code / "task.py").write_text("")
    (code / "requirements.txt").write_text("numpy>=1.26\n")
    exp = tmp_path / "mine.toml"
    exp.write_text((ROOT / "experiments" / "example.toml").read_text()
                   .replace("[trainer]\n", f'[trainer]\ncode_dir = "{code}"\n'))
    proc = make("deploy", f"EXPERIMENT={exp}", "CDKTN_ARGS=--dry-run", path=fake_terraform(tmp_path))
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert (f"{code}/requirements.py3.10-glibc2.35.lock: no lock of the VM's dependencies for Python 3.10, "
            "glibc 2.35, image torch 2.9.0") in proc.stderr
    assert "run `make lock EXPERIMENT=mine` and commit the lock" in proc.stderr
    assert "npx cdktn" not in proc.stdout


def test_make_lock_and_wheels_take_an_experiment():
    proc = make("-n", "lock", "EXPERIMENT=cnn", "UPGRADE=1")
    assert proc.returncode == 0, proc.stderr
    assert ".venv/bin/python -m stacks.lock cnn --upgrade" in proc.stdout
    proc = make("wheels", "EXPERIMENT=example")  # the suite's cache has them: offline
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^experiments/example.toml: \d+ wheels of locks/py3.10-glibc2.35.lock in ", proc.stdout, re.M)


@pytest.mark.parametrize("failing, status", [(None, 0), ("mypy", 1), ("pytest", 3), ("ruff", 1)])
def test_make_test_runs_ruff_first_mypy_beside_the_suite_and_fails_on_either(tmp_path, failing, status):
    """`make test` (what CI runs): ruff first (a finding stops it there), then the suite with mypy
    running beside it; a mypy finding fails it even when the suite passes, and the suite's own
    status is kept. A stand-in Python records each command and fails the one named."""
    log = tmp_path / "ran"
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\n"
                    f"echo \"$2\" >> {log}\n"
                    f"case \"$2\" in {failing or 'none'}) exit {status};; esac\n"
                    "exit 0\n")
    fake.chmod(0o755)
    proc = make("test", f"PY={fake}")
    assert proc.returncode == (2 if failing else 0), proc.stdout + proc.stderr  # make's "a recipe failed"
    ran = log.read_text().split()
    if failing == "ruff":
        assert ran == ["ruff"]
        return
    assert ran[0] == "ruff" and sorted(ran[1:]) == ["mypy", "pytest"]
    assert ("mypy found problems" in proc.stderr) == (failing == "mypy")
