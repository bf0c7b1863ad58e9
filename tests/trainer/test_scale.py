"""The VM-side scale-to-zero call (`python -m trainer.scale`) against the loopback fakes: the fake
Compute API (drill.fake_gcp), the fake metadata server and gcp-storage-emulator."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

import pytest

from drill.fake_gcp import FakeGcp
from drill.metadata_server import MetadataServer
from trainer import scale
from trainer.gce import Client

from support import REPO

PROJECT, ZONE, REGION = "my-project-123456", "us-central1-a", "us-central1"
SCRIPT = "#!/bin/bash\necho the startup script\n"


@pytest.fixture
def world(gcs_emulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict]:
    """A zonal group with this VM in it, the VM's metadata server, the bucket, a settings file."""
    with MetadataServer(attributes={"startup-script": SCRIPT}, instance_name="exp-abcd", zone=ZONE,
                        project_id=PROJECT) as md, FakeGcp(PROJECT, token="drill-fake-token") as gcp:
        gcp.add_group("exp-group", zone=ZONE, instances=("exp-abcd",))
        env = {"GCE_METADATA_HOST": md.host, "SPOTTRAIN_COMPUTE_API": gcp.compute_api,
               "STORAGE_EMULATOR_HOST": gcs_emulator.emulator.host}
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        bucket, prefix = gcs_emulator.uri[len("gs://"):].split("/", 1)
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        settings = scale.Settings(project=PROJECT, location=f"zones/{ZONE}", groups=("exp-group",),
                                  bucket=bucket, prefix=prefix, steps=200, run_dir=str(run_dir))
        yield {"gcp": gcp, "md": md, "env": env, "bucket": gcs_emulator.client.bucket(bucket), "prefix": prefix,
               "settings": settings, "run_dir": run_dir, "tmp": tmp_path}


def write_settings(world: dict, **changes) -> Path:
    path = world["tmp"] / "scale.json"
    s = {**vars(world["settings"]), **changes}
    path.write_text(json.dumps(s))
    return path


def put_checkpoint(world: dict, step: int) -> None:
    world["bucket"].blob(f"{world['prefix']}/step-{step:08d}/manifest.json").upload_from_string(b"{}")


def disk_checkpoint(world: dict, step: int) -> None:
    folder = world["run_dir"] / f"step-{step:08d}"
    folder.mkdir()
    (folder / "manifest.json").write_text("{}")


def marker(world: dict, reason: str) -> str:
    return scale.markers(world["prefix"], world["settings"].steps, scale.digest(SCRIPT))[reason]


def exists(world: dict, name: str) -> bool:
    return world["bucket"].get_blob(name) is not None


def test_finished_job_scales_its_group_to_zero_and_leaves_a_marker(world) -> None:
    put_checkpoint(world, 200)
    cfg = write_settings(world)
    proc = subprocess.run([sys.executable, "-m", "trainer.scale", "--config", str(cfg), "stop", "finished"],
                          cwd=REPO, env={**os.environ, **world["env"]},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    group = world["gcp"].group("exp-group")
    assert group.target_size == 0
    assert [size for _, size in group.history] == [1, 0]
    assert world["gcp"].calls_to("POST", f"/zones/{ZONE}/instanceGroupManagers/exp-group/resize")[0].query == \
        {"size": ["0"]}
    record = json.loads(world["bucket"].blob(marker(world, "finished")).download_as_bytes())
    assert record["reason"] == "finished" and record["instance"] == "exp-abcd" and record["steps"] == 200
    assert "event=group_resized group=exp-group target_size=0" in proc.stderr


def test_finished_without_the_final_checkpoint_in_the_bucket_is_refused(world) -> None:
    put_checkpoint(world, 150)  # the bucket lags: step 200 may live only on the disk
    assert scale.main(["--config", str(write_settings(world)), "stop", "finished"]) == scale.EXIT_REFUSED
    assert world["gcp"].group("exp-group").target_size == 1
    assert world["gcp"].calls_to("POST", "/resize") == []
    assert not exists(world, marker(world, "finished"))


def test_bad_input_stops_only_when_the_bucket_has_the_disks_newest_checkpoint(world) -> None:
    disk_checkpoint(world, 100)
    put_checkpoint(world, 50)
    cfg = write_settings(world)
    assert scale.main(["--config", str(cfg), "stop", "bad-input", "--detail", "trainer.args: bad"]) == \
        scale.EXIT_REFUSED
    assert world["gcp"].group("exp-group").target_size == 1
    put_checkpoint(world, 100)
    assert scale.main(["--config", str(cfg), "stop", "bad-input", "--detail", "trainer.args: bad"]) == 0
    assert world["gcp"].group("exp-group").target_size == 0
    assert json.loads(world["bucket"].blob(marker(world, "bad-input")).download_as_bytes())["detail"] == \
        "trainer.args: bad"


def test_regional_group_and_a_pool_coordinator_stopped_first(world) -> None:
    gcp = world["gcp"]
    gcp.add_group("pool-group", region=REGION, zones=(ZONE, "us-central1-b"), target_size=3)
    coordinator = gcp.add_instance(ZONE, "pool-coordinator")
    put_checkpoint(world, 200)
    cfg = write_settings(world, location=f"regions/{REGION}", groups=["pool-group"],
                         coordinator=f"zones/{ZONE}/instances/pool-coordinator")
    assert scale.main(["--config", str(cfg), "stop", "finished"]) == 0
    assert gcp.group("pool-group").target_size == 0
    assert coordinator.status == "TERMINATED"
    stop, resize = gcp.calls_to("POST", "/stop")[0], gcp.calls_to("POST", "/resize")[0]
    assert gcp.calls.index(stop) < gcp.calls.index(resize)
    assert f"/regions/{REGION}/instanceGroupManagers/pool-group/resize" in resize.path


def test_the_coordinator_stops_itself_last(world) -> None:
    gcp = world["gcp"]
    me = gcp.add_instance(ZONE, "exp-abcd-coordinator")
    world["md"].set_value("instance/name", "exp-abcd-coordinator")
    put_checkpoint(world, 200)
    cfg = write_settings(world, coordinator=f"zones/{ZONE}/instances/exp-abcd-coordinator")
    assert scale.main(["--config", str(cfg), "stop", "finished"]) == 0
    stop, resize = gcp.calls_to("POST", "/stop")[0], gcp.calls_to("POST", "/resize")[0]
    assert gcp.calls.index(resize) < gcp.calls.index(stop) and me.status == "TERMINATED"


def test_honour_at_boot_stops_again_only_when_a_marker_exists(world) -> None:
    cfg = write_settings(world)
    assert scale.main(["--config", str(cfg), "honour"]) == 0
    assert world["gcp"].calls_to("POST", "/resize") == []
    put_checkpoint(world, 200)
    world["bucket"].blob(marker(world, "finished")).upload_from_string(b"{}")
    assert scale.main(["--config", str(cfg), "honour"]) == scale.EXIT_HONOURED
    assert world["gcp"].group("exp-group").target_size == 0


def test_a_bad_input_marker_of_another_startup_script_is_not_honoured(world) -> None:
    name = scale.markers(world["prefix"], 200, scale.digest("an older, broken experiment"))["bad-input"]
    world["bucket"].blob(name).upload_from_string(b"{}")
    assert scale.main(["--config", str(write_settings(world)), "honour"]) == 0
    assert world["gcp"].group("exp-group").target_size == 1


def test_refused_by_iam_says_so_and_exits_1(world, capsys) -> None:
    world["gcp"].deny("POST", r"/instanceGroupManagers/exp-group/resize$")
    put_checkpoint(world, 200)
    assert scale.main(["--config", str(write_settings(world)), "stop", "finished"]) == scale.EXIT_API
    err = capsys.readouterr().err
    assert "event=api_error code=403 status=PERMISSION_DENIED" in err and "custom role" in err
    assert world["gcp"].group("exp-group").target_size == 1


def test_flex_start_successor_is_a_resize_request_unless_the_job_is_done(world) -> None:
    s = world["settings"]
    flex = scale.Settings(**{**vars(s), "run_duration_s": 86400})
    scaler = scale.Scaler(flex, Client(), scale.digest(SCRIPT))
    assert scaler.successor(now=datetime(2026, 3, 1, 12, 0, 5, tzinfo=timezone.utc)) == 0
    (req,) = world["gcp"].group("exp-group").resize_requests
    assert req["name"] == "exp-group-20260301-120005" and req["resizeBy"] == 1
    assert req["requestedRunDuration"] == {"seconds": "86400"}
    assert world["gcp"].group("exp-group").target_size == 2
    world["bucket"].blob(marker(world, "finished")).upload_from_string(b"{}")
    assert scaler.successor() == 0
    assert len(world["gcp"].group("exp-group").resize_requests) == 1  # done: no more VMs


def test_deadline_keeps_the_save_margin_and_never_precedes_boot() -> None:
    assert scale.deadline_at(1000.0, 7 * 86400, 600) == 1000.0 + 7 * 86400 - 600
    assert scale.deadline_at(1000.0, 300, 600) == 1000.0


def test_a_settings_file_with_an_unknown_key_is_bad_input(tmp_path: Path, capsys) -> None:
    cfg = tmp_path / "scale.json"
    cfg.write_text(json.dumps({"project": "p", "location": "zones/z", "groups": ["g"], "bucket": "b",
                               "prefix": "runs/x", "steps": 1, "colour": "red"}))
    assert scale.main(["--config", str(cfg), "honour"]) == scale.EXIT_BAD
    assert "colour" in capsys.readouterr().err
