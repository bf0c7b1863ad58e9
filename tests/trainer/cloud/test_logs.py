"""`python -m trainer logs`: a run's sessions across VMs and how each ended, read back from the
loopback Logging API (drill/fake_observability.py) with entries:list, page after page."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

from drill.fake_gcp import FakeGcp
from drill.fake_observability import FakeObservability
from drill.net import free_port
from tests.trainer.support import REPO
from trainer.cloud.log_shipper import TRAINER_LINE, entry, sign
from trainer.cloud.logs import log_filter

PROJECT, TOKEN = "my-project-123456", "fake-access-token"
CFG = {"project": PROJECT, "experiment": "example", "run": "runs/example"}
RESOURCE = {"type": "gce_instance", "labels": {"project_id": PROJECT, "instance_id": "1", "zone": "us-central1-a"}}
KEY = b"0123456789abcdef" * 4  # the VMs' log key: the trainer signs its own lines with it


class Journal:
    """Journal records of VM boots, as the shipper turns them into entries."""

    def __init__(self) -> None:
        self.t = time.time() - 3600
        self.n = 0
        self.entries: list[dict] = []

    def line(self, boot: str, message: str, *, session: str | None = None, script: str | None = None,
             systemd: bool = False, experiment: str = "example") -> None:
        self.n += 1
        self.t += 1.0
        r = {"__CURSOR": f"s=t;i={self.n:x}", "__REALTIME_TIMESTAMP": str(int(self.t * 1e6)), "_BOOT_ID": boot,
             "_HOSTNAME": "example-group-x1y2", "MESSAGE": message, "PRIORITY": "6"}
        if script:
            r.update(SYSLOG_IDENTIFIER="google_metadata_script_runner", MESSAGE=f"{script}-script: {message}")
        elif systemd:
            r.update(_PID="1", UNIT="spottrain.service", INVOCATION_ID=session)
        elif session:
            r.update(_SYSTEMD_UNIT="spottrain.service", _SYSTEMD_INVOCATION_ID=session)
            if TRAINER_LINE.match(message):  # the trainer's own line, as it writes it on a VM
                r.update(MESSAGE=sign(KEY, message))
        self.entries.append(entry(r, {**CFG, "experiment": experiment}, RESOURCE, KEY))


def _trainer(msg: str) -> str:
    return f"2026-01-02T03:04:05.000 INFO trainer {msg}"


def two_vms(j: Journal, steps: int = 3) -> None:
    """A VM preempted at step 118, then its recreation, which finished; and another experiment's."""
    a, b = "a" * 32, "b" * 32
    s1, s2 = "1" * 32, "2" * 32
    j.line(a, "2026-01-02T03:00:00.000Z spottrain-startup: event=boot after=first boot=aaaaaaaa", script="startup")
    j.line(a, _trainer("event=restore step=0 (no checkpoint: starting fresh)"), session=s1)
    for n in range(1, steps + 1):
        j.line(a, _trainer(f"event=step step={n * 10}/300 loss=2.0 steps_per_s=3.0"), session=s1)
    j.line(a, _trainer("event=preemption_notice reason=metadata completed_step=118"), session=s1)
    j.line(a, _trainer("event=preempted step=118 persistent_ok=1 gcs_ok=1 local_ok=- seconds=4.250 detail=x"),
           session=s1)
    j.line(a, "spottrain.service: Main process exited, code=exited, status=75/n/a", session=s1, systemd=True)
    j.line(a, "2026-01-02T03:10:00.000Z spottrain-shutdown: event=shutdown reason=preemption trainer_status=75 "
           "stop_s=5", script="shutdown")
    j.line(b, "2026-01-02T03:20:00.000Z spottrain-startup: event=boot after=preemption boot=bbbbbbbb",
           script="startup")
    j.line(b, _trainer("event=restore step=118 tier=gcs path=x seconds=1.000 world_size=1"), session=s2)
    j.line(b, _trainer("event=step step=300/300 loss=1.0 steps_per_s=3.0"), session=s2)
    j.line(b, _trainer("event=finished step=300"), session=s2)
    j.line(b, "spottrain.service: Main process exited, code=exited, status=0/SUCCESS", session=s2, systemd=True)
    j.line("c" * 32, _trainer("event=finished step=5"), session="3" * 32, experiment="other")


@pytest.fixture
def logging_api() -> Iterator[FakeObservability]:
    with FakeObservability(PROJECT, token=TOKEN) as fake:
        yield fake


def write(fake: FakeObservability, entries: list[dict]) -> None:
    """entries:write through the API, as the VMs' shipper does."""
    for i in range(0, len(entries), 500):
        req = urllib.request.Request(f"{fake.logging_api}/entries:write", method="POST",
                                     data=json.dumps({"entries": entries[i:i + 500]}).encode(),
                                     headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert resp.status == 200


def logs(fake: FakeObservability, tmp_path: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    base = {**os.environ, "SPOTTRAIN_LOGGING_API": fake.logging_api, "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-m", "trainer", "logs", *args]
    if env is None:
        argv += ["--access-token-file", str(token)]
    return subprocess.run(argv, cwd=REPO, env={**base, **(env or {})}, capture_output=True, text=True, timeout=120)


def test_the_sessions_of_recreated_vms_in_order_with_how_each_ended(logging_api, tmp_path) -> None:
    j = Journal()
    two_vms(j)
    write(logging_api, j.entries)
    out = logs(logging_api, tmp_path, "--project", PROJECT, "--experiment", "example")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "2 boot(s) of 1 VM(s), 2 trainer session(s)" in lines[0]
    assert lines[1].startswith("1. VM example-group-x1y2 boot aaaaaaaa") and lines[1].endswith("after first")
    assert "steps 0 -> 118" in lines[2] and "ended: preempted: emergency save of step 118 in 4.2 s (exit 75)" in lines[2]
    assert lines[3] == "   VM stopped: preemption (trainer exit 75)"
    assert lines[4].startswith("2. VM example-group-x1y2 boot bbbbbbbb") and lines[4].endswith("after preemption")
    assert "steps 118 -> 300" in lines[5] and "ended: finished at step 300 (exit 0)" in lines[5]
    assert "other" not in out.stdout  # another experiment's entries are filtered out by its label


def test_json_output_and_every_page(logging_api, tmp_path) -> None:
    j = Journal()
    two_vms(j, steps=1500)  # more than one page of 1000
    write(logging_api, j.entries)
    out = logs(logging_api, tmp_path, "--project", PROJECT, "--experiment", "example", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    first = report["vms"][0]["sessions"][0]
    assert (first["first_step"], first["last_step"], first["exit"]) == (0, 118, "75")
    assert report["sessions"] == 2 and report["vms"][1]["after"] == "preemption"
    lists = [c for c in logging_api.calls if c[1] == "/v2/entries:list"]
    assert len(lists) == 2 and all(c[2] == 200 for c in lists)


def test_the_filter_selects_the_experiment_and_the_time_range() -> None:
    from datetime import datetime, timezone

    since = datetime(2026, 1, 2, tzinfo=timezone.utc)
    assert log_filter(PROJECT, "example", since=since, run="runs/example") == (
        f'logName="projects/{PROJECT}/logs/spottrain" AND labels."spottrain-experiment"="example" AND '
        'timestamp>="2026-01-02T00:00:00Z" AND jsonPayload.run="runs/example"')


def test_a_refusal_says_which_role_is_missing(logging_api, tmp_path) -> None:
    logging_api.fail("POST", "entries:list", 403, times=None)
    out = logs(logging_api, tmp_path, "--project", PROJECT, "--experiment", "example")
    assert out.returncode == 1 and "403" in out.stderr and "roles/logging.viewer" in out.stderr
    assert "Traceback" not in out.stderr


def test_application_default_credentials_or_a_clear_exit_3(logging_api, tmp_path) -> None:

    j = Journal()
    two_vms(j)
    write(logging_api, j.entries)
    none = logs(logging_api, tmp_path, "--project", PROJECT, "--experiment", "example",
                env={"GOOGLE_APPLICATION_CREDENTIALS": str(tmp_path / "missing.json"),
                     "GCE_METADATA_HOST": f"127.0.0.1:{free_port()}", "NO_GCE_CHECK": "True", "HOME": str(tmp_path)})
    assert none.returncode == 3 and "application-default" in none.stderr and "Traceback" not in none.stderr
    with FakeGcp(PROJECT, token=TOKEN) as gcp:
        adc = gcp.key_file(tmp_path / "adc.json", "viewer@my-project-123456.iam.gserviceaccount.com")
        out = logs(logging_api, tmp_path, "--project", PROJECT, "--experiment", "example",
                   env={"GOOGLE_APPLICATION_CREDENTIALS": str(adc), "NO_GCE_CHECK": "True", "HOME": str(tmp_path),
                        "GCE_METADATA_HOST": f"127.0.0.1:{free_port()}"})
    assert out.returncode == 0, out.stderr
    assert "2 trainer session(s)" in out.stdout


def test_bad_arguments_exit_2(logging_api, tmp_path) -> None:
    out = logs(logging_api, tmp_path, "--project", PROJECT)
    assert out.returncode == 2 and "--experiment" in out.stderr
    out = logs(logging_api, tmp_path, "--project", PROJECT, "--experiment", "x", "--since", "yesterday")
    assert out.returncode == 2 and "--since" in out.stderr


def test_make_logs_takes_the_project_and_the_name_from_the_experiment_file(logging_api, tmp_path) -> None:
    """`make logs EXPERIMENT=example` runs `python -m stacks.logs example`: experiments/example.toml's
    project and name, the rest passed to `trainer logs`."""
    j = Journal()
    two_vms(j)
    write(logging_api, j.entries)
    token = tmp_path / "token"
    token.write_text(TOKEN)
    out = subprocess.run([sys.executable, "-m", "stacks.logs", "example", "--access-token-file", str(token), "--json"],
                         cwd=REPO, env={**os.environ, "SPOTTRAIN_LOGGING_API": logging_api.logging_api},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["sessions"] == 2
    bad = subprocess.run([sys.executable, "-m", "stacks.logs", "no-such-experiment"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "no-such-experiment" in bad.stderr


def test_the_lines_it_reads_are_named_as_the_events_name_them() -> None:
    """`trainer logs` runs beside the trainer (standard library only) and cannot import the events'
    names (`trainer.observe.events`): its copies must agree with them."""
    from trainer.cloud import logs
    from trainer.observe import events as ev

    assert (logs.RESTORE, logs.FINISHED, logs.PREEMPTED, logs.PAUSED, logs.NOT_DURABLE, logs.FAILED) == (
        ev.Restored.line, ev.Finished.line, ev.Preempted.line, ev.Paused.line, ev.NOT_DURABLE, ev.Failed.line)
