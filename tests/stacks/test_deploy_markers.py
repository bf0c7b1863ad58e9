"""`make deploy` / `make diff` judge the stop markers before cdktn plans the group's size from them.

The stack's data sources set the group's target size to 0 whenever a marker object exists
(`stacks.scale_to_zero`), and a resize to zero deletes the VMs' checkpoint disks. So
`stacks.deploy` first reads every object those data sources count and verifies it as the control
job does (`trainer.cloud.control.judge`), with the operator's application-default credentials.

Against: the real gcp-storage-emulator (the bucket, written here with the real google-cloud-storage
client, as a bucket writer would), the fake Google APIs (drill/fake_gcp.py: the checkpoint key in
Secret Manager, the group in Compute, the token endpoint ADC refreshes against, the deployer a
project Owner), and `fake_terraform.py` on PATH, which records every call. The marker names are
the synthesized stack's own data-source prefixes, not recomputed here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
from stack_support import ROOT
from test_deploy import terraform_on_path

from drill.fake_gcp import FakeGcp
from drill.fault_proxy import FaultProxy
from drill.gcs_emulator import StorageEmulator
from drill.net import free_port

pytestmark = pytest.mark.xdist_group("stacks")

PROJECT, ZONE = "my-project-123456", "us-central1-a"
BUCKET = f"{PROJECT}-example-ckpt"
PREFIX = "runs/example"
KEY = b"the example run's checkpoint key, 32+ bytes"
SECRET = f"projects/{PROJECT}/secrets/example-checkpoint-key"
GROUP = "example-group"


class World:
    """The example experiment after a deploy: its bucket, key, group (one VM) and an operator
    signed in with ADC; `deploy()` runs `stacks.deploy` as `make deploy` does."""

    def __init__(self, tmp: Path, markers: dict[str, str], gcp: FakeGcp, emulator: StorageEmulator,
                 proxy: FaultProxy) -> None:
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        self.tmp, self.markers, self.gcp, self.emulator, self.proxy = tmp, markers, gcp, emulator, proxy
        self.bucket = storage.Client(project=PROJECT, credentials=AnonymousCredentials(),
                                     client_options={"api_endpoint": emulator.host}).bucket(BUCKET)
        self.vm = "example-abcd"
        gcp.add_group(GROUP, zone=ZONE, instances=(self.vm,), target_size=1)
        gcp.add_secret("example-checkpoint-key")
        gcp.add_secret_version(SECRET, KEY)
        adc = gcp.key_file(tmp / "adc.json", "deployer@my-project-123456.iam.gserviceaccount.com")
        self.world = {"state": {}, "cloud": {}, "objects": {}, "calls": []}
        self.env = {**os.environ, **terraform_on_path(tmp, self.world), "GOOGLE_APPLICATION_CREDENTIALS": str(adc),
                    "SPOTTRAIN_COMPUTE_API": gcp.compute_api, "SPOTTRAIN_SECRETMANAGER_API": gcp.secretmanager_api,
                    "STORAGE_EMULATOR_HOST": proxy.host, "NO_GCE_CHECK": "True",
                    "GCE_METADATA_HOST": f"127.0.0.1:{free_port()}", "HOME": str(tmp)}

    def deploy(self, verb: str = "deploy") -> subprocess.CompletedProcess[str]:
        """`python -m stacks.deploy VERB example`, as `make VERB` runs it."""
        return subprocess.run([sys.executable, "-m", "stacks.deploy", verb, "example"], cwd=ROOT, env=self.env,
                              capture_output=True, text=True, timeout=300)

    def deploy_here(self, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                    verb: str = "deploy") -> tuple[int, list[str] | None, str]:
        """The same in this process (cdktn's synthesis and Terraform are another test's: here,
        only whether it would start): (exit status, the argv it would exec or None, stderr)."""
        from stacks import deploy

        for k, v in self.env.items():
            monkeypatch.setenv(k, v)
        monkeypatch.chdir(self.tmp)
        ran: list[list[str]] = []
        monkeypatch.setattr(deploy.os, "execve", lambda path, argv, env: ran.append(list(argv)))
        capsys.readouterr()
        rc = deploy.main([verb, "example"])
        return rc, (ran[0] if ran else None), capsys.readouterr().err

    def terraform_calls(self) -> list[list[str]]:
        return json.loads(Path(self.env["FAKE_TERRAFORM_CLOUD"]).read_text())["calls"]

    def put_checkpoint(self, step: int) -> None:
        """An authentic checkpoint of `step`, as the trainer uploads it (files, then manifest)."""
        from trainer.checkpoint.key import CheckpointKey
        from trainer.checkpoint.manifest import build_manifest
        from trainer.manifest_auth import run_uri

        key = CheckpointKey(KEY, run=run_uri(BUCKET, PREFIX))
        data = b"weights" * 100
        self.bucket.blob(f"{PREFIX}/step-{step:08d}/model.bin").upload_from_string(data)
        manifest = build_manifest(step, {"model.bin": {"size": len(data), "sha256": "0" * 64}}, {}, 0.0, key=key)
        self.bucket.blob(f"{PREFIX}/step-{step:08d}/manifest.json").upload_from_string(manifest)

    def marker(self, reason: str, step: int | None, *, secret: bytes = KEY, name: str | None = None) -> bytes:
        """The record `trainer.cloud.scale` signs when this experiment's VM stops."""
        from trainer.cloud import stop_marker

        return stop_marker.sign(secret, {
            "reason": reason, "at": "2026-11-29T00:00:00+00:00", "instance": self.vm,
            "instance_id": self.gcp.instance(ZONE, self.vm).id, "detail": "", "steps": 100, "step": step,
            "disk_step": step, "run": f"gs://{BUCKET}/{PREFIX}", "name": name or self.markers[reason]})

    def put(self, name: str, data: bytes) -> None:
        self.bucket.blob(name).upload_from_string(data)


@pytest.fixture
def world(tmp_path: Path, example) -> Iterator[World]:
    objects = example.json["data"]["google_storage_bucket_objects"]
    markers = {key.split("_")[1].removesuffix("-marker"): o["prefix"] for key, o in objects.items()}
    assert sorted(markers) == ["bad-input", "finished"], markers
    # The operator's calls go through a proxy that can refuse or drop them as Cloud Storage or the
    # network would; the test writes the bucket directly.
    with FakeGcp(PROJECT) as gcp, StorageEmulator(BUCKET, quiet=True) as emulator, \
            FaultProxy(emulator.host) as proxy:
        yield World(tmp_path, markers, gcp, emulator, proxy)


def shaped(world: World, reason: str, step: int) -> dict[str, Any]:
    """A record shaped like the VM's, its HMAC made up: what a bucket writer without the key writes
    (the key's public id is in every manifest of the bucket)."""
    from trainer import manifest_auth

    return {**json.loads(world.marker(reason, step)), "hmac": "0" * 64, "key_id": manifest_auth.key_id(KEY)}


def test_a_planted_marker_refuses_make_deploy_and_nothing_runs(world) -> None:
    world.put_checkpoint(100)
    world.put(world.markers["finished"], b"not even JSON")
    proc = world.deploy()
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "npx cdktn" not in proc.stdout
    assert world.terraform_calls() == []  # cdktn never started, so Terraform never planned size 0
    url = f"gs://{BUCKET}/{world.markers['finished']}"
    assert ("stacks.deploy: not deploying example: its stack sets the group's size to 0 (and stops a pool's "
            "coordinator) while a stop marker exists, and these do not verify as the run's:") in proc.stderr
    assert f"\n  {url}: a stop marker is not valid JSON" in proc.stderr, proc.stderr
    assert "if the run did not write it, or it is stale, delete it (gcloud storage rm URL)" in proc.stderr
    assert world.gcp.group(GROUP).target_size == 1


def test_markers_that_do_not_verify_refuse_deploy_and_diff(world, monkeypatch, capsys) -> None:
    """Each as the control job would refuse it: no signature, a made-up HMAC, another key's, and
    the run's own record copied to a longer name (the data source lists by prefix, so it counts)."""
    from trainer.cloud import stop_marker

    world.put_checkpoint(100)
    finished, bad_input = world.markers["finished"], world.markers["bad-input"]
    cases = [
        (finished, json.dumps(shaped(world, "finished", 100)).encode(), "its HMAC does not verify with this run's"),
        (bad_input, b'{"reason": "bad-input"}', "not a signed stop marker (no kind/version)"),
        (finished, stop_marker.sign(b"another experiment's key, 32 bytes!", shaped(world, "finished", 100)),
         "it names checkpoint key"),
        (finished + ".copy", world.marker("finished", 100), f"signed as {finished!r}, found at {finished + '.copy'!r}"),
    ]
    for verb in ("deploy", "diff"):
        for name, data, why in cases:
            world.put(name, data)
            rc, ran, err = world.deploy_here(monkeypatch, capsys, verb)
            assert (rc, ran) == (2, None), err
            assert f"  gs://{BUCKET}/{name}: " in err and why in err, err
            world.bucket.blob(name).delete()
    assert world.gcp.group(GROUP).target_size == 1


def test_an_authentic_marker_the_bucket_or_the_group_has_overtaken_is_refused(world, monkeypatch, capsys) -> None:
    """Replays: (1) the run's marker for step 100 after training went on to an authentic step 150;
    (2) the run's marker, still naming the newest step, written by a VM the group has since
    replaced (a new id), whose disk may be ahead of the bucket."""
    world.put_checkpoint(100)
    world.put(world.markers["finished"], world.marker("finished", 100))
    world.put_checkpoint(150)
    rc, ran, err = world.deploy_here(monkeypatch, capsys)
    assert (rc, ran) == (2, None), err
    assert "the bucket holds authentic step 150, newer than the marker's 100" in err
    world.bucket.blob(world.markers["finished"]).delete()
    world.put(world.markers["bad-input"], world.marker("bad-input", 150))
    world.gcp.recreate(GROUP, world.vm)
    rc, ran, err = world.deploy_here(monkeypatch, capsys)
    assert (rc, ran) == (2, None), err
    assert f"  gs://{BUCKET}/{world.markers['bad-input']}: it was written by 'example-abcd'" in err
    assert "which is no VM of the experiment now" in err


def test_a_marker_the_run_signed_lets_deploy_scale_to_zero(world, monkeypatch, capsys) -> None:
    world.put_checkpoint(100)
    world.put(world.markers["finished"], world.marker("finished", 100))
    _, ran, err = world.deploy_here(monkeypatch, capsys)
    assert ran is not None and ran[-3:] == ["cdktn", "deploy", "example"], err
    assert (f"stacks.deploy: stop markers: gs://{BUCKET}/{world.markers['finished']} verified (signed by the run, "
            "its step the bucket's newest authentic one): the group goes to zero") in err
    # The same marker once the group is gone (a destroy, or the stop done): no VM, no disk to lose.
    world.gcp.groups.pop(GROUP)
    _, ran, err = world.deploy_here(monkeypatch, capsys, "diff")
    assert ran is not None and ran[-3:] == ["cdktn", "diff", "example"], err


def test_no_marker_and_no_bucket_let_deploy_run_without_the_key(world, monkeypatch, capsys) -> None:
    """The key is read only when a marker is there to verify: an operator who may not read it
    deploys as before while no marker exists."""
    world.gcp.deny("GET", r":access$")
    world.put_checkpoint(100)
    world.put(f"{PREFIX}/stop/finished-steps-99.json", b"another step count's: not read by this stack")
    _, ran, err = world.deploy_here(monkeypatch, capsys)
    assert ran is not None and ran[-2:] == ["deploy", "example"], err
    assert f"stacks.deploy: stop markers: none in gs://{BUCKET} (" in err
    for blob in world.bucket.list_blobs():
        blob.delete()
    world.bucket.delete()  # a first deploy: the stack has not created the bucket yet
    _, ran, err = world.deploy_here(monkeypatch, capsys)
    assert ran is not None, err
    assert f"stacks.deploy: stop markers: gs://{BUCKET} does not exist yet, so none" in err


def test_what_cannot_be_checked_refuses(world, monkeypatch, capsys) -> None:
    """Unknown is not empty: the key refused (403), the bucket refused (403) or unreachable, no
    credentials at all."""
    world.put_checkpoint(100)
    world.put(world.markers["finished"], world.marker("finished", 100))
    world.gcp.deny("GET", r":access$")
    rc, ran, err = world.deploy_here(monkeypatch, capsys)
    assert (rc, ran) == (2, None), err
    assert ("stacks.deploy: not deploying example: its stop markers could not be checked, and an unchecked "
            "marker is not an absent one:") in err
    assert f"  read the checkpoint key {SECRET}: 403 " in err
    assert f"secretmanager.versions.access on {SECRET}" in err and "Traceback" not in err
    # The bucket: refused (a 403 as Cloud Storage answers one), then unreachable.
    world.gcp.denied.clear()
    world.proxy.add("GET", r"/o\?", "status", status=403, times=None)
    rc, ran, err = world.deploy_here(monkeypatch, capsys)
    assert (rc, ran) == (2, None), err
    assert f"  list gs://{BUCKET}/{PREFIX}/stop/: 403 " in err
    world.proxy.clear()
    world.proxy.down()
    rc, ran, err = world.deploy_here(monkeypatch, capsys)
    assert (rc, ran) == (2, None), err
    assert f"  list gs://{BUCKET}/{PREFIX}/stop/: 0 UNREACHABLE" in err
    world.proxy.up()
    world.env["GOOGLE_APPLICATION_CREDENTIALS"] = str(world.tmp / "missing.json")
    rc, ran, err = world.deploy_here(monkeypatch, capsys)
    assert (rc, ran) == (2, None), err
    assert "no usable application-default credentials (DefaultCredentialsError)" in err


def test_no_key_version_means_no_marker_can_be_the_runs(world, monkeypatch, capsys) -> None:
    """No VM has booted (the secret has no version): a marker there was planted."""
    world.gcp.secrets[SECRET].clear()
    world.put(world.markers["bad-input"], world.marker("bad-input", None))
    rc, ran, err = world.deploy_here(monkeypatch, capsys)
    assert (rc, ran) == (2, None), err
    assert f"cannot be the run's: {SECRET} has no version 1: no VM of this experiment has booted" in err


def test_the_check_judges_exactly_the_names_every_stack_reads(synthesized) -> None:
    """What `make deploy` lists is what each variant's data sources list (pools, regional groups,
    flex-start, the fallback...): a name computed apart from the stack would check one object
    while Terraform counts another."""
    from stacks.stack import boot_scripts, stop_markers

    checked = 0
    for name, s in synthesized.items():
        objects = s.json.get("data", {}).get("google_storage_bucket_objects", {})
        read = sorted(o["prefix"] for o in objects.values())
        _, props, scripts = boot_scripts(name, s.spec)
        names = stop_markers(name, props, scripts)
        assert sorted((names or {}).values()) == read, name
        checked += bool(read)
    assert checked >= 5
