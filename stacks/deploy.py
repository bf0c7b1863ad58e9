"""`make deploy|diff|destroy|output EXPERIMENT=name`: the cdktn CLI for one experiment, from any shell.

`python -m stacks.deploy VERB EXPERIMENT [CDKTN_ARGS...]` checks what the CLI needs before it
starts, each with a message that says what to do: the experiment file (validated, so a bad one
fails here with its `file: field: problem` lines, exit 2), the committed lock of its VM's
dependencies (missing or stale: "run `make lock`", exit 2; its wheels are fetched now), the Node that `make setup` put into the
virtual environment (cdktn needs Node >= 22.19; a system Node 20 crashes it, so the venv's bin/
goes first on PATH whatever the shell had), and Terraform or OpenTofu on PATH for the verbs that
run it. Then it replaces itself with `npx cdktn VERB STACK`, synthesizing that experiment alone
(`SPOTTRAIN_EXPERIMENTS`). `--dry-run` prints what would run instead.

`destroy` leaves the checkpoint bucket and its key in the project (unless `bucket.force_destroy`;
docs/deploy.md). Deploying the same experiment again then finds them there: `--adopt-kept` (with
deploy or diff) has the stack import them into the state instead of creating them (`ADOPT_ENV`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from stacks.errors import InputError
from stacks.load import load_file, resolve

REPO = Path(__file__).resolve().parent.parent
VERBS = ("deploy", "diff", "destroy", "output")
#: Set for the synthesis: import the kept bucket and key (Terraform `import` blocks, >= 1.5).
ADOPT_ENV = "SPOTTRAIN_ADOPT_KEPT"
MIN_NODE = (22, 19)


class DeployError(Exception):
    """Something the CLI needs is missing; the message says what to do."""


def tool_path() -> str:
    """PATH with this Python's bin/ (the venv: node, npx) first."""
    return os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])


def node(path: str) -> tuple[str, str]:
    """(node's path, its version) on `path`; DeployError when it is missing or too old."""
    found = shutil.which("node", path=path)
    if found is None:
        raise DeployError("no `node` found: run `make setup` (it puts Node into .venv/bin)")
    version = subprocess.run([found, "--version"], capture_output=True, text=True,
                             timeout=30).stdout.strip()
    try:
        have = tuple(int(x) for x in version.lstrip("v").split(".")[:2])
    except ValueError:
        have = (0, 0)
    if have < MIN_NODE:
        raise DeployError(f"{found} is Node {version or '(unknown)'}; cdktn needs Node >= "
                          f"{MIN_NODE[0]}.{MIN_NODE[1]}: run `make setup` (Node from PyPI into "
                          ".venv/bin) and use the make targets, which put it first on PATH")
    return found, version


def terraform(path: str) -> tuple[str, dict[str, str]]:
    """(the Terraform binary, the environment cdktn needs to use it)."""
    for name in ("terraform", "tofu"):
        found = shutil.which(name, path=path)
        if found is not None:
            return found, {"TERRAFORM_BINARY_NAME": name} if name == "tofu" else {}
    raise DeployError("neither `terraform` (>= 1.5) nor `tofu` (OpenTofu >= 1.6) is on PATH: "
                      "deploy, diff, destroy and output run Terraform; install one of them, and "
                      "sign in with `gcloud auth application-default login` (docs/deploy.md: "
                      "What deploy needs)")


def command(verb: str, experiment: str, extra: list[str],
            adopt: bool = False) -> tuple[list[str], dict[str, str], list[str]]:
    """(argv, environment additions, notes) for `npx cdktn VERB STACK`; raises on what is missing."""
    from stacks.experiment import code_path
    from stacks.wheels import shipped_wheels

    try:
        path = resolve(experiment)
        spec = load_file(path)
        # The locked wheels, checked and fetched before cdktn starts: a missing or stale lock is
        # one line here, not a failed synthesis inside the CLI's output.
        code = code_path(spec.spec.trainer.code_dir) if spec.spec.trainer.code_dir else None
        shipped_wheels(spec.spec, code, spec.name)
    except InputError as e:
        raise DeployError("\n".join(e.lines)) from None
    search = tool_path()
    node_path, version = node(search)
    tf, tf_env = terraform(search)
    env = {"PATH": search, "SPOTTRAIN_EXPERIMENTS": str(path), "CHECKPOINT_DISABLE": "1",
           "DISABLE_VERSION_CHECK": "1", **tf_env, **({ADOPT_ENV: "1"} if adopt else {})}
    npx = str(Path(node_path).parent / "npx")
    notes = [f"node {version} ({node_path}), {Path(tf).name} ({tf}), experiment {path}"]
    return [npx, "cdktn", verb, spec.name, *extra], env, notes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stacks.deploy", description=__doc__.split("\n\n")[0])
    p.add_argument("verb", choices=VERBS)
    p.add_argument("experiment", nargs="?", default="",
                   help="a name (experiments/NAME.toml) or the path of an experiment file")
    p.add_argument("--dry-run", action="store_true", help="print what would run, run nothing")
    p.add_argument("--adopt-kept", action="store_true",
                   help="deploy/diff: import the bucket and key a destroy left in the project")
    args, extra = p.parse_known_args(argv)
    if not args.experiment:
        print(f"stacks.deploy: which experiment? make {args.verb} EXPERIMENT=name (a file "
              "experiments/NAME.toml) or EXPERIMENT=path/to/file.toml", file=sys.stderr)
        return 2
    try:
        if args.adopt_kept and args.verb not in ("deploy", "diff"):
            raise DeployError(f"--adopt-kept applies to deploy and diff, not {args.verb}")
        argv_, env, notes = command(args.verb, args.experiment, extra, adopt=args.adopt_kept)
    except DeployError as e:
        print(f"stacks.deploy: {e}" if "\n" not in str(e) else str(e), file=sys.stderr)
        return 2
    for note in notes:
        print(f"stacks.deploy: {note}", file=sys.stderr)
    if args.dry_run:
        print(" ".join(f"{k}={v}" for k, v in env.items() if k != "PATH") + " " + " ".join(argv_))
        return 0
    os.chdir(REPO)
    os.execve(argv_[0], argv_, {**os.environ, **env})
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
