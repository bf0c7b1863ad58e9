"""`make destroy`: it finishes, and leaves exactly what docs/deploy.md promises (the bucket with its
checkpoints and the key that authenticates them), or everything gone with `force_destroy`.

Run as a user runs it (make, stacks.deploy, the real cdktn CLI synthesizing the experiment) against
`fake_terraform.py` on PATH, which destroys a state seeded from the synthesized stack the way the
Google provider would, refusals included.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from stack_support import ROOT, Synthesized

pytestmark = pytest.mark.xdist_group("stacks")

FAKE = Path(__file__).with_name("fake_terraform.py")
CHECKPOINTS = ["runs/{exp}/step-100/manifest.json", "runs/{exp}/step-100/model.pt",
               "runs/{exp}/stop/finished-steps-100.json"]


def seeded_world(s: Synthesized, exp: str) -> dict:
    """The state and the project after a deploy of `s` and a run that saved checkpoints."""
    resources = s.json["resource"]
    (bucket,) = resources["google_storage_bucket"].values()
    name = bucket["name"]
    state = {}
    for kind, items in resources.items():
        for key, attrs in items.items():
            text = re.sub(r"\$\{google_storage_bucket\.[^.}]+\.name\}", name, json.dumps(attrs))
            state[f"{kind}.{key}"] = json.loads(text)
    objects = [o["name"] for o in resources["google_storage_bucket_object"].values()]
    objects += [c.format(exp=exp) for c in CHECKPOINTS]
    return {"state": state, "cloud": dict(state), "objects": {name: objects}, "calls": []}


def apis(s: Synthesized) -> set[str]:
    return {f"google_project_service.{k}" for k in s.json["resource"]["google_project_service"]}


def apis_left_enabled(world: dict) -> set[str]:
    """The APIs a destroy leaves enabled (`disable_on_destroy = false`): still in the project."""
    return {a for a, attrs in world["cloud"].items()
            if a.startswith("google_project_service.") and attrs.get("disable_on_destroy") is False}


def terraform_on_path(tmp_path: Path, world: dict) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "terraform").write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE}" "$@"\n')
    (bin_dir / "terraform").chmod(0o755)
    cloud = tmp_path / "cloud.json"
    cloud.write_text(json.dumps(world))
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", "FAKE_TERRAFORM_CLOUD": str(cloud)}


def test_make_destroy_finishes_and_keeps_the_bucket_with_its_checkpoints_and_the_key(
        tmp_path, example):
    env = terraform_on_path(tmp_path, seeded_world(example, "example"))
    out = tmp_path / "cdktf.out"
    proc = subprocess.run(
        ["/usr/bin/make", "--no-print-directory", "-o", ".venv/.setup-stamp", "destroy",
         "EXPERIMENT=example", f"CDKTN_ARGS=--auto-approve --output {out}"],
        cwd=ROOT, env={**{k: v for k, v in os.environ.items()
                          if k not in ("PATH", "VIRTUAL_ENV", "MAKEFLAGS")}, **env},
        capture_output=True, text=True, timeout=600)
    world = json.loads(Path(env["FAKE_TERRAFORM_CLOUD"]).read_text())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert ["destroy", "-auto-approve"] in world["calls"]
    assert (out / "stacks" / "example" / "cdk.tf.json").exists()  # cdktn synthesized it there
    assert world["state"] == {}  # Terraform knows nothing any more
    kept = sorted(a.split(".")[0] for a in world["cloud"] if not a.startswith("google_project_service."))
    assert kept == ["google_secret_manager_secret", "google_storage_bucket"]
    assert apis_left_enabled(world) and apis_left_enabled(world) == apis(example)
    assert world["objects"] == {
        "my-project-123456-example-ckpt": [c.format(exp="example") for c in CHECKPOINTS]}


def _destroy(tmp_path: Path, world: dict) -> tuple[subprocess.CompletedProcess[str], dict]:
    env = terraform_on_path(tmp_path, world)
    proc = subprocess.run(["terraform", "destroy", "-auto-approve"], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=60)
    return proc, json.loads(Path(env["FAKE_TERRAFORM_CLOUD"]).read_text())


def test_force_destroy_deletes_the_bucket_its_objects_and_the_key(tmp_path, synthesized):
    proc, world = _destroy(tmp_path, seeded_world(synthesized["existing-net"], "existing-net"))
    assert proc.returncode == 0, proc.stderr
    assert world["state"] == {} and world["objects"] == {}
    assert world["cloud"].keys() == apis_left_enabled(world) == apis(synthesized["existing-net"])


def test_the_stand_in_refuses_what_the_provider_refuses(tmp_path, example):
    """The configuration before the keep-on-destroy policy: a protected key and a bucket that
    may not be force-destroyed. The destroy fails on both and leaves them in the state."""
    world = seeded_world(example, "example")
    for address, attrs in world["state"].items():
        attrs.pop("deletion_policy", None)
        if address.startswith("google_secret_manager_secret."):
            attrs["deletion_protection"] = True
    proc, after = _destroy(tmp_path, world)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        "Error: cannot destroy secret without setting deletion_protection=false and running "
        "`terraform apply`",
        "Error: Error trying to delete bucket my-project-123456-example-ckpt containing objects "
        "without `force_destroy` set to true",
    ]
    assert sorted(a.split(".")[0] for a in after["state"]) == [
        "google_secret_manager_secret", "google_storage_bucket"]


def test_deploying_again_after_a_destroy_adopts_the_kept_bucket_and_key(monkeypatch, example):
    """`make deploy EXPERIMENT=x CDKTN_ARGS=--adopt-kept`: Terraform import blocks for the two
    resources a destroy left, instead of a create that fails on an existing name."""
    from stack_support import variant

    from stacks.stack import ADOPT_ENV

    assert "import" not in example.json
    monkeypatch.setenv(ADOPT_ENV, "1")
    s = Synthesized("example", variant({}, "example"))
    (bucket,), (secret,) = (s.json["resource"][k].keys() for k in
                            ("google_storage_bucket", "google_secret_manager_secret"))
    assert sorted(s.json["import"], key=lambda i: i["to"]) == [
        {"to": f"google_secret_manager_secret.{secret}",
         "id": "projects/my-project-123456/secrets/example-checkpoint-key"},
        {"to": f"google_storage_bucket.{bucket}", "id": "my-project-123456/my-project-123456-example-ckpt"},
    ]
    # A bucket that may be force-destroyed was destroyed with its key: nothing to adopt.
    forced = Synthesized("forced", variant({"bucket": {"force_destroy": True}}, "forced"))
    assert "import" not in forced.json


def test_adopt_kept_reaches_the_synthesis_of_deploy_and_diff_only(tmp_path):
    env = {**os.environ, **terraform_on_path(tmp_path, {"state": {}, "cloud": {}, "objects": {},
                                                        "calls": []})}
    run = [sys.executable, "-m", "stacks.deploy"]
    proc = subprocess.run([*run, "diff", "example", "--adopt-kept", "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert " SPOTTRAIN_ADOPT_KEPT=1 " in proc.stdout and proc.stdout.rstrip().endswith("cdktn diff example")
    proc = subprocess.run([*run, "destroy", "example", "--adopt-kept"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr == "stacks.deploy: --adopt-kept applies to deploy and diff, not destroy\n"
