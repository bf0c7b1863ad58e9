"""The VM-side stop path (`python -m trainer.cloud.scale`) and the control job it starts
(`trainer.cloud.control`), against fakes that are no kinder than Google: the fake Google APIs
(drill.fake_gcp) enforce the IAM of the experiment's **synthesized stack** for each caller and
answer pending operations; the fake metadata server gives the VM its own token; the bucket is
gcp-storage-emulator behind a proxy that checks the same grants for every object request. A grant
the stack lacks, or one Google would not honour, fails here."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from drill.control_job import ControlJob
from drill.fake_gcp import FakeGcp
from drill.fault_proxy import FaultProxy
from drill.gcs_emulator import StorageEmulator
from drill.iam import Policy
from drill.metadata_server import MetadataServer
from stacks.control import control_settings
from trainer.cloud import scale
from trainer.cloud.gce import ApiError, Client

from support import REPO

PROJECT, ZONE, REGION = "my-project-123456", "us-central1-a", "us-central1"
SCRIPT = "#!/bin/bash\necho the startup script\n"
VM = f"exp-trainer@{PROJECT}.iam.gserviceaccount.com"
CONTROL = f"exp-control@{PROJECT}.iam.gserviceaccount.com"
GROUP = f"projects/{PROJECT}/zones/{ZONE}/instanceGroupManagers/exp-group"
POOL = "tests/stacks/fixtures/l4-pool.toml"
FLEX = {"machine": {"provisioning": "flex-start", "termination_action": None}, "capacity": {"flex_max_run_hours": 24}}


class World:
    """One experiment `exp` deployed on the fakes: its stack's grants, its groups (and pool
    coordinator), this VM in the group with its own metadata server and token, its bucket (the
    stack's name, behind an IAM-checking proxy), the VM's settings file, and the control job the
    VM may start. The test itself reads and writes the bucket directly, as the deployer."""

    def __init__(self, stack: dict, tmp: Path, *, instance: str = "exp-abcd",
                 coordinator: bool = False, flex: bool = False) -> None:
        self.tmp, self.instance = tmp, instance
        (self.bucket_name,) = [b["name"] for b in stack["resource"]["google_storage_bucket"].values()]
        self.prefix = "runs/exp"
        self.emulator = StorageEmulator(self.bucket_name, quiet=True)
        self.gcp = FakeGcp(PROJECT, policy=Policy.from_stack(stack))
        self.gcp.add_identity("vm-token", f"serviceAccount:{VM}")
        self.md = MetadataServer(attributes={"startup-script": SCRIPT}, instance_name=instance, zone=ZONE,
                                 project_id=PROJECT, token="vm-token", email=VM)
        self.run_dir = tmp / "run"
        self.run_dir.mkdir()
        self.steps = 200
        self.coordinator_path = f"zones/{ZONE}/instances/exp-coordinator" if coordinator else None
        self.markers = scale.markers(self.prefix, self.steps, scale.digest(SCRIPT))
        self.key_secret = f"projects/{PROJECT}/secrets/exp-checkpoint-key"
        self.control_settings = control_settings(
            project=PROJECT, region=REGION, location=f"zones/{ZONE}", groups=("exp-group",),
            bucket=self.bucket_name, prefix=self.prefix, stop_markers=tuple(self.markers.values()),
            checkpoint_key_secret=self.key_secret, coordinator=self.coordinator_path, flex_run_duration_s=86400 if flex else None)
        self.settings = scale.Settings(job=f"projects/{PROJECT}/locations/{REGION}/jobs/exp-control",
                                       bucket=self.bucket_name, prefix=self.prefix, steps=self.steps,
                                       run_dir=str(self.run_dir), run_duration_s=86400 if flex else None,
                                       answer_s=120.0, forbidden_retry_s=0.0, poll_s=0.05,
                                       checkpoint_key_file=str(tmp / "checkpoint.key"))
        (tmp / "checkpoint.key").write_bytes(b"k" * 32)

    def __enter__(self) -> "World":
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        self.emulator.start()
        self.proxy = FaultProxy(self.emulator.host).start()
        self.gcp.start()
        self.gcp.storage_gate(self.proxy, {self.bucket_name: PROJECT})
        self.bucket = storage.Client(project=PROJECT, credentials=AnonymousCredentials(),
                                     client_options={"api_endpoint": self.emulator.host}).bucket(self.bucket_name)
        self.md.start()
        self.gcp.add_group("exp-group", zone=ZONE, instances=(self.instance, "exp-efgh"), target_size=2)
        # This VM's metadata says the id the group lists (a stop marker is bound to it).
        self.md.set_value("instance/id", self.gcp.instance(ZONE, self.instance).id)
        if self.coordinator_path:
            self.gcp.add_instance(ZONE, "exp-coordinator")
        # The experiment's checkpoint key, as the first VM's boot added it (`stacks.checkpoint_key`).
        self.gcp.add_secret("exp-checkpoint-key")
        self.gcp.add_secret_version(self.key_secret, Path(self.settings.checkpoint_key_file).read_bytes())
        self.job = ControlJob(self.gcp, self.control_settings, account=CONTROL, name="exp-control",
                              storage=self.proxy.host)
        self.job.__enter__()
        self.env = {"GCE_METADATA_HOST": self.md.host, "SPOTTRAIN_RUN_API": self.gcp.run_api,
                    "STORAGE_EMULATOR_HOST": self.proxy.host}
        return self

    def __exit__(self, *exc: object) -> None:
        self.gcp.stop()  # waits for the job's executions
        self.job.__exit__()
        self.md.stop()
        self.proxy.stop()
        self.emulator.stop()

    def config(self, **changes: Any) -> Path:
        path = self.tmp / "scale.json"
        path.write_text(json.dumps({**vars(self.settings), **changes}))
        return path

    def main(self, *argv: str, **changes: Any) -> int:
        return scale.main(["--config", str(self.config(**changes)), *argv])

    def put_checkpoint(self, step: int, *, secret: bytes | None = None, files: bool = True,
                       run: str | None = None) -> None:
        """An authentic checkpoint of ``step`` (signed with the run's key, or ``secret``; for this
        run, or ``run``), as the trainer uploads it: its files, then its manifest; ``files`` False
        leaves them out."""
        from trainer.checkpoint.key import CheckpointKey
        from trainer.checkpoint.manifest import build_manifest
        from trainer.manifest_auth import run_uri

        key = CheckpointKey(secret or Path(self.settings.checkpoint_key_file).read_bytes(),
                            run=run or run_uri(self.bucket_name, self.prefix))
        data = b"weights" * 100
        if files:
            self.bucket.blob(f"{self.prefix}/step-{step:08d}/model.bin").upload_from_string(data)
        manifest = build_manifest(step, {"model.bin": {"size": len(data), "sha256": "0" * 64}}, {}, 0.0, key=key)
        self.bucket.blob(f"{self.prefix}/step-{step:08d}/manifest.json").upload_from_string(manifest)

    def plant(self, step: int, data: bytes = b"{}") -> None:
        """What a bucket writer without the key can put there."""
        self.bucket.blob(f"{self.prefix}/step-{step:08d}/manifest.json").upload_from_string(data)

    def disk_checkpoint(self, step: int) -> None:
        folder = self.run_dir / f"step-{step:08d}"
        folder.mkdir()
        (folder / "manifest.json").write_text("{}")

    def exists(self, name: str) -> bool:
        return self.bucket.get_blob(name) is not None

    def scheduled(self) -> Any:
        """One execution of the control job as Cloud Scheduler starts it (every 15 minutes), with
        no VM asking: its exit status, output and the outcome it wrote (None: none)."""
        self.job(self.job.job)
        run = self.job.runs[-1]
        blob = self.bucket.get_blob(f"{self.prefix}/control/outcome.json")
        return run, json.loads(blob.download_as_bytes()) if blob is not None else None

    def by(self, principal: str, method: str, fragment: str) -> list:
        return [c for c in self.gcp.calls_to(method, fragment) if c.principal == f"serviceAccount:{principal}"]


@pytest.fixture
def world(stack_json, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., World]]:
    made: list[World] = []

    def make(overrides: dict | None = None, base: str = "experiments/example.toml", **kw: Any) -> World:
        w = World(stack_json("exp", overrides, base), tmp_path, **kw).__enter__()
        made.append(w)
        for k, v in w.env.items():
            monkeypatch.setenv(k, v)
        return w

    yield make
    for w in made:
        w.__exit__()


def test_a_finished_vm_has_its_group_scaled_to_zero_by_the_control_job(world) -> None:
    w = world()
    w.put_checkpoint(200)
    proc = subprocess.run([sys.executable, "-m", "trainer.cloud.scale", "--config", str(w.config()), "stop", "finished"],
                          cwd=REPO, env={**os.environ, **w.env}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "event=group_resized group=exp-group target_size=0" in proc.stderr
    group = w.gcp.group("exp-group")
    assert group.target_size == 0 and [size for _, size in group.history] == [2, 0]
    # The VM started the job and touched no group; the job resized it with its own grant and
    # confirmed it from the group's own state (it may not read operations), as Google allows.
    assert len(w.by(VM, "POST", "/jobs/exp-control:run")) == 1 and not w.by(VM, "POST", "/compute/")
    assert [c.query for c in w.by(CONTROL, "POST", "/instanceGroupManagers/exp-group/resize")] == [{"size": ["0"]}]
    assert w.gcp.calls_to("GET", "/operations/") == [] and w.gcp.calls_to("POST", "/operations/") == []
    # Every call, object requests included, was within the synthesized stack's grants.
    w.gcp.join_jobs()
    assert w.gcp.refusals == [] and w.job.failed() == []
    assert not [r for r in w.proxy.seen() if r.outcome == "iam 403"]
    record = json.loads(w.bucket.blob(w.markers["finished"]).download_as_bytes())
    assert record["reason"] == "finished" and record["instance"] == "exp-abcd" and record["steps"] == 200
    outcome = json.loads(w.bucket.blob(f"{w.prefix}/control/outcome.json").download_as_bytes())
    assert outcome["ok"] and outcome["groups"] == {"exp-group": 0}


def test_the_vm_itself_may_not_touch_its_group(world) -> None:
    """What the VM did before: resize its own group, then wait on the operation. Google refuses
    the resize (the group-named condition never matched; now there is no grant at all)."""
    w = world()
    vm = Client(token=lambda: ("vm-token", 3600.0), compute=w.gcp.compute_api, sleep=lambda s: None, retries=0)
    with pytest.raises(ApiError) as e:
        vm.compute_call("POST", f"{GROUP}/resize", query={"size": 0})
    assert e.value.code == 403 and "compute.instanceGroupManagers.update" in e.value.message
    assert w.gcp.group("exp-group").target_size == 2


def test_a_bucket_grant_the_stack_lacks_fails_the_stop_as_it_would_on_google(world, capsys) -> None:
    """Object requests are checked too: without its write grant on runs/exp/control/ the job
    resizes the group but cannot report it, and the VM says it got no answer."""
    w = world()
    w.gcp.policy.bindings = [b for b in w.gcp.policy.bindings
                             if not (b.member == f"serviceAccount:{CONTROL}" and b.role == "roles/storage.objectUser")]
    w.put_checkpoint(200)
    assert w.main("stop", "finished", answer_s=3.0) == scale.EXIT_API
    assert "event=stop_unconfirmed" in capsys.readouterr().err
    w.gcp.join_jobs()
    assert (f"serviceAccount:{CONTROL}", "storage.objects.create",
            f"projects/_/buckets/{w.bucket_name}/objects/runs/exp/control/outcome.json") in w.gcp.refusals
    assert [r.returncode for r in w.job.runs] == [1]


def test_finished_without_the_final_checkpoint_in_the_bucket_is_refused(world) -> None:
    w = world()
    w.put_checkpoint(150)  # the bucket lags: step 200 may live only on the disk
    assert w.main("stop", "finished") == scale.EXIT_REFUSED
    assert w.gcp.group("exp-group").target_size == 2
    assert w.gcp.calls_to("POST", ":run") == [] and not w.exists(w.markers["finished"])


def test_bad_input_stops_only_when_the_bucket_has_the_disks_newest_checkpoint(world) -> None:
    w = world()
    w.disk_checkpoint(100)
    w.put_checkpoint(50)
    assert w.main("stop", "bad-input", "--detail", "trainer.args: bad") == scale.EXIT_REFUSED
    assert w.gcp.group("exp-group").target_size == 2
    w.put_checkpoint(100)
    assert w.main("stop", "bad-input", "--detail", "trainer.args: bad") == 0
    assert w.gcp.group("exp-group").target_size == 0
    assert json.loads(w.bucket.blob(w.markers["bad-input"]).download_as_bytes())["detail"] == "trainer.args: bad"


def test_a_pool_worker_stops_the_coordinator_and_the_worker_group(world) -> None:
    w = world(base=POOL, coordinator=True)
    w.put_checkpoint(200)
    assert w.main("stop", "finished") == 0
    assert w.gcp.group("exp-group").target_size == 0
    assert w.gcp.instance(ZONE, "exp-coordinator").status == "TERMINATED"
    assert w.by(CONTROL, "POST", "/instances/exp-coordinator/stop") and w.gcp.refusals == []
    outcome = json.loads(w.bucket.blob(f"{w.prefix}/control/outcome.json").download_as_bytes())
    assert outcome == {**outcome, "ok": True, "groups": {"exp-group": 0}, "coordinator": "TERMINATED"}


def test_one_failed_step_skips_no_other_and_every_failure_is_reported(world, capsys) -> None:
    w = world(base=POOL, coordinator=True)
    w.gcp.deny("POST", r"/instances/exp-coordinator/stop$")  # e.g. its grant is still propagating
    w.put_checkpoint(200)
    assert w.main("stop", "finished") == scale.EXIT_API
    assert w.gcp.group("exp-group").target_size == 0  # the Spot workers stop billing regardless
    assert w.gcp.instance(ZONE, "exp-coordinator").status == "RUNNING"
    err = capsys.readouterr().err
    assert "event=group_resized group=exp-group target_size=0" in err
    assert 'event=stop_failed step="stop zones/us-central1-a/instances/exp-coordinator: 403' in err
    w.gcp.join_jobs()
    assert [r.returncode for r in w.job.runs] == [1]


def test_honour_at_boot_stops_again_only_when_a_marker_exists(world) -> None:
    w = world()
    assert w.main("honour") == 0
    assert w.gcp.calls_to("POST", ":run") == []
    w.put_checkpoint(200)
    w.bucket.blob(w.markers["finished"]).upload_from_string(b"{}")
    assert w.main("honour") == scale.EXIT_HONOURED
    assert w.gcp.group("exp-group").target_size == 0


def test_a_bad_input_marker_of_another_startup_script_is_not_honoured(world) -> None:
    w = world()
    name = scale.markers(w.prefix, 200, scale.digest("an older, broken experiment"))["bad-input"]
    w.bucket.blob(name).upload_from_string(b"{}")
    assert w.main("honour") == 0
    assert w.gcp.group("exp-group").target_size == 2


def test_a_vm_that_may_not_start_the_job_says_so_and_exits_1(world, capsys) -> None:
    w = world()
    w.gcp.deny("POST", r"/jobs/exp-control:run$")
    w.put_checkpoint(200)
    assert w.main("stop", "finished") == scale.EXIT_API
    err = capsys.readouterr().err
    assert "event=api_error code=403 status=PERMISSION_DENIED" in err and "roles/run.invoker" in err
    assert w.gcp.group("exp-group").target_size == 2
    assert w.exists(w.markers["finished"])  # durable: the job's scheduled run acts on it


def test_flex_start_successor_is_one_resize_request_per_vm_unless_the_job_is_done(world) -> None:
    w = world(FLEX, flex=True)
    scaler = scale.Scaler(w.settings, Client(), scale.digest(SCRIPT))
    assert scaler.successor(now=datetime(2026, 3, 1, 12, 0, 5, tzinfo=timezone.utc)) == 0
    (req,) = w.gcp.group("exp-group").resize_requests
    assert req["name"] == "exp-group-after-exp-abcd" and req["resizeBy"] == 1
    assert req["requestedRunDuration"] == {"seconds": "86400"}
    assert w.gcp.group("exp-group").target_size == 3
    assert scaler.successor(now=datetime(2026, 3, 1, 12, 0, 6, tzinfo=timezone.utc)) == 0  # asked twice
    assert len(w.gcp.group("exp-group").resize_requests) == 1 and w.gcp.refusals == []
    w.bucket.blob(w.markers["finished"]).upload_from_string(b"{}")
    started = len(w.gcp.calls_to("POST", ":run"))
    assert scaler.successor() == 0
    assert len(w.gcp.group("exp-group").resize_requests) == 1  # done: no more VMs
    assert len(w.gcp.calls_to("POST", ":run")) == started


def test_a_successor_is_refused_for_a_vm_outside_the_group(world) -> None:
    w = world(FLEX, flex=True, instance="exp-abcd")
    w.md.set_value("instance/name", "someone-else")
    scaler = scale.Scaler(w.settings, Client(), scale.digest(SCRIPT))
    assert scaler.successor() == scale.EXIT_API
    assert w.gcp.group("exp-group").resize_requests == []


def test_deadline_keeps_the_save_margin_and_never_precedes_boot() -> None:
    assert scale.deadline_at(1000.0, 7 * 86400, 600) == 1000.0 + 7 * 86400 - 600
    assert scale.deadline_at(1000.0, 300, 600) == 1000.0


def test_a_settings_file_with_an_unknown_key_is_bad_input(tmp_path: Path, capsys) -> None:
    cfg = tmp_path / "scale.json"
    cfg.write_text(json.dumps({"job": "projects/p/locations/r/jobs/j", "bucket": "b", "prefix": "runs/x",
                               "steps": 1, "colour": "red"}))
    assert scale.main(["--config", str(cfg), "honour"]) == scale.EXIT_BAD
    assert "colour" in capsys.readouterr().err


def test_a_planted_checkpoint_never_lets_the_disk_go(world, capsys) -> None:
    """A bucket writer without the key plants `{}` at step 99999999, a well-formed manifest without
    an HMAC at the final step, one signed with another key, another run's authentic checkpoint, or
    an authentic manifest whose files are missing: neither `stop bad-input`, `stop finished` nor the boot's `honour` scales to zero
    (which would delete the disk holding the newest authentic step)."""
    from drill.attacker import forge

    w = world()
    w.disk_checkpoint(100)
    w.put_checkpoint(50)
    w.plant(99999999)
    w.bucket.blob(f"{w.prefix}/step-99999999/model.bin").upload_from_string(b"x")
    assert w.main("stop", "bad-input", "--detail", "trainer.args: bad") == scale.EXIT_REFUSED
    w.put_checkpoint(200, files=False)
    forged = forge(w.bucket.blob(f"{w.prefix}/step-00000050/manifest.json").download_as_bytes(), 150, {})
    w.plant(150, forged)
    w.put_checkpoint(120, secret=b"another run's key, 32 bytes long")
    w.put_checkpoint(130, run="gs://another-bucket/runs/other")  # the same key, another run's, copied here
    assert w.main("stop", "finished") == scale.EXIT_REFUSED
    assert w.main("stop", "bad-input", "--detail", "trainer.args: bad") == scale.EXIT_REFUSED
    w.bucket.blob(w.markers["bad-input"]).upload_from_string(b"{}")  # a marker, planted as well
    assert w.main("honour") == scale.EXIT_REFUSED
    # The reasons as a person reads them (the line shows them JSON-quoted: a quote inside is escaped).
    err = capsys.readouterr().err.replace('\\"', '"')
    assert "step 99999999: manifest has" in err or "step 99999999: unauthenticated" in err
    assert "step 150: unauthenticated: its manifest carries no HMAC" in err
    assert "step 120: unauthenticated: its manifest names checkpoint key" in err
    assert "step 130: another run's: signed for the run at \"gs://another-bucket/runs/other\"" in err
    assert "step 200: model.bin is missing" in err
    assert w.gcp.group("exp-group").target_size == 2 and w.gcp.calls_to("POST", ":run") == []
    # The disk's own step, authentic and complete in the bucket: now it may go.
    w.put_checkpoint(100)
    assert w.main("stop", "bad-input", "--detail", "trainer.args: bad") == 0
    assert w.gcp.group("exp-group").target_size == 0


def test_without_the_checkpoint_key_nothing_in_the_bucket_counts(world, capsys) -> None:
    w = world()
    w.put_checkpoint(200)
    assert w.main("stop", "finished", checkpoint_key_file=str(w.tmp / "absent.key")) == scale.EXIT_REFUSED
    assert ("cannot authenticate the bucket's checkpoints, nor sign the stop marker, without the checkpoint key"
            in capsys.readouterr().err)
    assert w.gcp.group("exp-group").target_size == 2


# --- issue 28.4: what the control job acts on, on its own schedule ------------------------------
def refusals(run: Any) -> list[dict[str, Any]]:
    """The job's `stop_marker_refused` events (its JSON log lines, which an alert counts)."""
    lines = [json.loads(line) for line in run.output.splitlines() if line.startswith("{")]
    return [e for e in lines if e.get("event") == "stop_marker_refused"]


def test_a_planted_stop_marker_never_deletes_a_disk_ahead_of_the_bucket(world) -> None:
    """The issue's case: the disk holds step 686, the bucket's newest authentic step is 600 (the
    lease was disturbed), and a bucket writer plants markers. Cloud Scheduler's run of the job
    finds them: it resizes nothing, says why in the outcome, logs an event an alert counts and
    fails the execution. Planted: `{}`, a record shaped like the VM's without an HMAC, and one
    signed with another key."""
    from trainer.cloud import stop_marker

    w = world()
    w.disk_checkpoint(686)
    w.put_checkpoint(600)
    shaped = {"kind": stop_marker.KIND, "version": 1, "reason": "finished", "step": 600, "instance": w.instance,
              "instance_id": w.gcp.instance(ZONE, w.instance).id, "name": w.markers["finished"],
              "run": f"gs://{w.bucket_name}/{w.prefix}", "hmac": "0" * 64,
              # The key's public id, as every manifest in the bucket shows it.
              "key_id": json.loads(w.bucket.blob(f"{w.prefix}/step-00000600/manifest.json")
                                   .download_as_bytes())["auth"]["key_id"]}
    w.bucket.blob(w.markers["finished"]).upload_from_string(json.dumps(shaped))
    w.bucket.blob(w.markers["bad-input"]).upload_from_string(b"{}")
    run, outcome = w.scheduled()
    assert w.gcp.group("exp-group").target_size == 2 and [size for _, size in w.gcp.group("exp-group").history] == [2]
    assert not w.by(CONTROL, "POST", "/resize")
    assert run.returncode == 1
    assert sorted(e["marker"].rsplit("/", 1)[-1] for e in refusals(run)) == sorted(
        m.rsplit("/", 1)[-1] for m in w.markers.values())
    assert all(e["severity"] == "ERROR" for e in refusals(run))
    assert outcome["ok"] is False and outcome["markers"] == [] and outcome["groups"] == {}
    assert "HMAC does not verify" in outcome["refused"][w.markers["finished"]]
    assert "not a signed stop marker" in outcome["refused"][w.markers["bad-input"]]
    # Signed with another experiment's key: refused as well.
    other = stop_marker.sign(b"another experiment's key, 32 byte", {**shaped, "hmac": None})
    w.bucket.blob(w.markers["finished"]).upload_from_string(other)
    run, outcome = w.scheduled()
    assert "names checkpoint key" in outcome["refused"][w.markers["finished"]]
    assert w.gcp.group("exp-group").target_size == 2 and w.gcp.refusals == []
    # The VM's own stop still works: it replaces the planted marker with its signed record.
    w.put_checkpoint(686)
    assert w.main("stop", "bad-input", "--detail", "trainer.args: bad") == 0
    assert w.gcp.group("exp-group").target_size == 0


def test_a_replayed_authentic_marker_is_refused(world, capsys) -> None:
    """Authentic markers, replayed: (1) one the VM wrote while its job could not be started,
    acted on after training went on and the bucket holds a newer authentic step; (2) one of an
    earlier VM, restored after a human deleted it and the group recreated the VMs, whose disks
    are now ahead of the bucket."""
    w = world()
    w.disk_checkpoint(600)
    w.put_checkpoint(600)
    w.gcp.deny("POST", r"/jobs/exp-control:run$", times=1)
    assert w.main("stop", "bad-input", "--detail", "bad") == scale.EXIT_API  # the marker stays, unacted
    w.put_checkpoint(700)  # the run went on (a human restarted it in place)
    run, outcome = w.scheduled()
    assert "the bucket holds authentic step 700, newer than the marker's 600" in outcome["refused"][w.markers["bad-input"]]
    assert w.gcp.group("exp-group").target_size == 2 and run.returncode == 1
    # (2): the VM stops again, now covered by step 700, and the job acts on its new marker.
    assert w.main("stop", "bad-input", "--detail", "bad") == 0
    assert w.gcp.group("exp-group").target_size == 0
    marker = w.bucket.blob(w.markers["bad-input"]).download_as_bytes()
    assert json.loads(marker)["step"] == 700
    # A human deletes the marker and resizes back up: new VMs (new ids) train to 786 on new
    # disks while the bucket lags at 700; a bucket writer restores the old marker.
    w.bucket.blob(w.markers["bad-input"]).delete()
    w.gcp.recreate("exp-group", w.instance)
    w.gcp.recreate("exp-group", "exp-efgh")
    w.gcp.set_target("exp-group", 2)
    w.bucket.blob(w.markers["bad-input"]).upload_from_string(marker)  # restored from a noncurrent version
    run, outcome = w.scheduled()
    assert "which is no VM of the experiment now" in outcome["refused"][w.markers["bad-input"]]
    assert w.gcp.group("exp-group").target_size == 2 and run.returncode == 1


def test_the_control_job_without_its_grant_on_the_key_acts_on_no_marker(world, capsys) -> None:
    """Verifying needs the key: without `secretmanager.versions.access` on that one secret (the
    stack's binding), Secret Manager refuses the job, which then resizes nothing."""
    w = world()
    w.gcp.policy.bindings = [b for b in w.gcp.policy.bindings
                             if not (b.member == f"serviceAccount:{CONTROL}" and "secretmanager" in b.role)]
    w.put_checkpoint(200)
    assert w.main("stop", "finished") == scale.EXIT_API
    assert "event=stop_marker_refused" in capsys.readouterr().err
    assert w.gcp.group("exp-group").target_size == 2
    w.gcp.join_jobs()
    assert (f"serviceAccount:{CONTROL}", "secretmanager.versions.access",
            f"{w.key_secret}/versions/1") in w.gcp.refusals


def test_a_finished_marker_names_the_newest_authentic_step_so_the_job_acts_on_it(world) -> None:
    """A bucket that also holds a newer authentic step than the final one (an earlier, longer run
    of the experiment): the VM's marker names that newest step, so the job, which refuses a
    marker the bucket has overtaken, acts on it."""
    w = world()
    w.put_checkpoint(250)
    w.put_checkpoint(200)
    assert w.main("stop", "finished") == 0
    assert json.loads(w.bucket.blob(w.markers["finished"]).download_as_bytes())["step"] == 250
    assert w.gcp.group("exp-group").target_size == 0
