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
deploy or diff) has the stack import them into the state instead of creating them (`stacks.stack.ADOPT_ENV`).

**Stop markers, before deploy and diff** (`check_stop_markers`). The stack sets the group's size
to 0 (and a pool's coordinator TERMINATED) whenever one of its stop marker objects exists
(`stacks.scale_to_zero`: Terraform can only see that an object is there), and a resize to zero
deletes every VM's checkpoint disk, which may hold a step newer than the bucket. Whoever can write
the bucket can write a marker's name, so before cdktn starts, with the operator's
application-default credentials, every object those data sources would count is read and judged
exactly as the control job judges a marker (`trainer.cloud.control.judge`: signed with the run's
checkpoint key, version 1 of `<experiment>-checkpoint-key`; its step authentic in the bucket with
nothing newer; its writer still one of the experiment's VMs). All verify, or none exists, or the
bucket does not exist yet (a first deploy): cdktn runs. Any other: exit 2, naming each object and
why, and nothing runs. What cannot be checked (no credentials, a 403 on the bucket or the key, no
answer) refuses too: a marker that could not be read is not an absent one. There is no override:
a planted or stale marker is deleted by whoever judges it so, then deploy runs. `--dry-run` runs
nothing and checks nothing. `npx cdktn deploy` run by hand skips this check (docs/deploy.md).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from stacks.errors import InputError
from stacks.load import load_file, resolve

REPO = Path(__file__).resolve().parent.parent
VERBS = ("deploy", "diff", "destroy", "output")
MIN_NODE = (22, 19)
#: The verbs whose plan takes the group's size from the stop markers (`check_stop_markers`).
MARKER_VERBS = ("deploy", "diff")


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
    from stacks.stack import ADOPT_ENV  # the stack reads it; importing it here loads the stack only now

    search = tool_path()
    node_path, version = node(search)
    tf, tf_env = terraform(search)
    env = {"PATH": search, "SPOTTRAIN_EXPERIMENTS": str(path), "CHECKPOINT_DISABLE": "1",
           "DISABLE_VERSION_CHECK": "1", **tf_env, **({ADOPT_ENV: "1"} if adopt else {})}
    npx = str(Path(node_path).parent / "npx")
    notes = [f"node {version} ({node_path}), {Path(tf).name} ({tf}), experiment {path}"]
    return [npx, "cdktn", verb, spec.name, *extra], env, notes


def check_stop_markers(experiment: str, client: Any = None) -> str:
    """A note of what was checked when the experiment's stop markers let its stack be planned
    (none exists, none can yet, or each verifies as the control job verifies one); DeployError
    naming each marker and why, or what could not be checked, otherwise. ``client``: a
    `trainer.cloud.gce.Client` (default: one with application-default credentials)."""
    from stacks.checkpoint_key_name import secret_name
    from stacks.stack import boot_scripts, stop_markers
    from trainer.cloud import control
    from trainer.cloud.gce import ApiError, Client

    spec = load_file(resolve(experiment))
    name, exp = spec.name, spec.spec
    _, props, scripts = boot_scripts(name, exp)
    names = stop_markers(name, props, scripts)
    if names is None or props.scale is None:
        return "stop markers: this stack has none (its VMs never scale their group)"
    bucket, prefix, project = exp.bucket_name(name), f"runs/{name}", exp.gcp.project
    key = secret_name(project, name)
    if client is None:
        from stacks.preflight import adc_token

        try:
            token = adc_token()
            token()
        except Exception as e:  # google.auth raises several kinds; none is worth a traceback here
            raise DeployError(_unchecked(name, bucket, key, [
                f"no usable application-default credentials ({type(e).__name__}); run `gcloud auth "
                "application-default login`"])) from None
        client = Client(token=token, retries=2)
    found: list[str] = []
    try:
        for marker in names.values():
            # By prefix, as the data source lists them: any object whose name starts with a
            # marker's counts there, so each is judged here (a longer name never verifies).
            found += sorted(client.object_sizes(bucket, marker))
    except ApiError as e:
        if e.code == 404:  # no bucket yet (a first deploy): nothing in it can stop anything
            return f"stop markers: gs://{bucket} does not exist yet, so none"
        raise DeployError(_unchecked(name, bucket, key, [f"list gs://{bucket}/{prefix}/stop/: {e}"])) from None
    if not found:
        return f"stop markers: none in gs://{bucket} ({', '.join(n.rsplit('/', 1)[-1] for n in names.values())})"
    try:
        secret = control.read_key(client, key)
    except control.KeyProblem as e:  # no key at all: nothing the run wrote can be in the bucket
        raise DeployError(_refused(name, bucket, {m: f"cannot be the run's: {e}" for m in found})) from None
    except ApiError as e:
        raise DeployError(_unchecked(name, bucket, key, [f"read the checkpoint key {key}: {e}"])) from None
    scale = props.scale
    verdict = control.judge(
        client, bucket=bucket, prefix=prefix, found=found, secret=secret,
        members=lambda: control.members(
            client, [f"projects/{project}/{scale.location}/instanceGroupManagers/{g}" for g in scale.groups],
            f"projects/{project}/{scale.coordinator}" if scale.coordinator else None, absent_ok=True))
    if verdict.failures:
        raise DeployError(_unchecked(name, bucket, key, [f"{what}: {e}" for what, e in verdict.failures]))
    if verdict.refused:
        raise DeployError(_refused(name, bucket, verdict.refused))
    return "stop markers: " + ", ".join(f"gs://{bucket}/{m}" for m in verdict.ok) + (
        " verified (signed by the run, its step the bucket's newest authentic one): the group goes to zero")


def _refused(name: str, bucket: str, refused: dict[str, str]) -> str:
    lines = [f"stacks.deploy: not deploying {name}: its stack sets the group's size to 0 (and stops a pool's "
             "coordinator) while a stop marker exists, and these do not verify as the run's:"]
    lines += [f"  gs://{bucket}/{m}: {why}" for m, why in refused.items()]
    lines += ["Scaling to zero deletes the VMs' checkpoint disks, which may hold a step newer than the bucket: only "
              "a marker the run signed, naming the bucket's newest authentic step, may do that (docs/security.md, "
              "Stop markers).",
              "Inspect each (gcloud storage cat URL; its history: gcloud storage ls -a URL); if the run did not write "
              "it, or it is stale, delete it (gcloud storage rm URL), then run the same command again."]
    return "\n".join(lines)


def _unchecked(name: str, bucket: str, key: str, what: list[str]) -> str:
    lines = [f"stacks.deploy: not deploying {name}: its stop markers could not be checked, and an unchecked "
             "marker is not an absent one:"]
    lines += [f"  {w}" for w in what]
    lines += [f"The stack sets the group's size to 0 while a stop marker exists, deleting the VMs' checkpoint disks. "
              f"Checking one needs storage.objects.list and .get on gs://{bucket} and secretmanager.versions.access "
              f"on {key} (a project Owner has both), and Compute read access to the group; then run the same "
              "command again."]
    return "\n".join(lines)


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
    if args.verb in MARKER_VERBS:
        if args.dry_run:
            notes.append("stop markers: not checked (--dry-run calls no Google API)")
        else:
            try:
                notes.append(check_stop_markers(args.experiment))
            except DeployError as e:
                print(str(e), file=sys.stderr)
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
