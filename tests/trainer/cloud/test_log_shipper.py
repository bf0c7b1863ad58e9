"""trainer/cloud/log_shipper.py: the parse rule over the trainer's and the boot scripts' real lines, and
the shipper itself, a real process following a journal (the drill's journalctl) into the loopback
Logging API (drill/fake_observability.py) with the fake metadata server's token."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from drill.fake_observability import FakeObservability, Filter
from drill.metadata_server import MetadataServer
from tests.trainer.support import GATE_TASK, REPO, Proc, gated, open_gate_on_notice, run_args, write_config
from trainer import retry
from trainer.cloud.log_shipper import (LABEL, RETRY, RETRY_CAP_S, SCRIPT_LINE, TRAINER_LINE, entry, load_key,
                                       parse_message, sign)

GUARD_S = 60.0  # a failure guard for waits, never a timing assertion
TOKEN = "drill-fake-token"  # what drill.metadata_server hands out
KEY = b"0123456789abcdef" * 4  # a VM's log key, for entries made here


# --- the parse rule, over real lines ---------------------------------------------------------------
@pytest.fixture(scope="module")
def trainer_lines(tmp_path_factory) -> list[str]:
    """A real trainer's log: a fresh start, steps, a preemption notice (SIGTERM) and its emergency
    save, then a restart that restores and finishes."""
    tmp = tmp_path_factory.mktemp("run")
    config, gate = write_config(tmp, f'task = "{GATE_TASK}"\n'), tmp / "gate"
    first = Proc(run_args(tmp / "run", 40, config), env=gated(gate, 8))  # held at 8 only if read late
    first.wait_for(r"event=step step=3/")
    first.signal(signal.SIGTERM)
    open_gate_on_notice(first, gate)
    assert first.wait() == 75, first.output[-3000:]
    second = Proc(run_args(tmp / "run", 40, config))
    assert second.wait() == 0, second.output[-3000:]
    return first.lines + second.lines


def test_every_trainer_line_with_an_event_parses_into_its_fields(trainer_lines) -> None:
    events = {}
    for line in trainer_lines:
        if "event=" not in line or not TRAINER_LINE.match(line):
            continue
        p = parse_message(line)
        want = line.split("event=", 1)[1].split()[0]
        assert p["event"] == want and p["level"] in ("INFO", "WARNING", "ERROR") and p["logger"].startswith("trainer"), line
        events.setdefault(want, []).append(p)
    assert {"start", "restore", "step", "preempted", "finished"} <= set(events), sorted(events)
    step = events["step"][0]
    assert step["step"] == 1 and step["fields"]["total_steps"] == 40
    assert isinstance(step["fields"]["loss"], float) and isinstance(step["fields"]["steps_per_s"], float)
    preempted = events["preempted"][0]
    assert preempted["step"] >= 3 and isinstance(preempted["fields"]["seconds"], float)
    restore = events["restore"][-1]
    assert restore["step"] == preempted["step"]  # the second session restored the emergency save
    assert events["finished"][-1]["step"] == 40
    # Only the trainer's own lines are structured; the rest stays a message.
    assert parse_message("Traceback (most recent call last):") == {}


def test_a_boot_scripts_lines_parse_with_the_scripts_own_log_function(tmp_path) -> None:
    from stacks.boot import BootProps, render

    scripts = render(BootProps(name="x", bucket="b", task="t:build", steps=5, health_port=8471,
                               provisioning="spot"))
    log_fn = next(line for line in scripts.startup.splitlines() if line.startswith("log() {"))
    out = subprocess.run(["bash", "-c", log_fn + '\nlog "event=boot after=preemption boot=1a2b3c4d"\n'
                          'log "event=boot_failed FAILED: checkpoint disk not found"'],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert all(SCRIPT_LINE.match(line) for line in out), out
    boot, failed = (parse_message(line) for line in out)
    assert boot["event"] == "boot" and boot["fields"]["after"] == "preemption" and boot["logger"] == "spottrain-startup"
    assert failed["event"] == "boot_failed" and failed["level"] == "ERROR"


def _record(i: int, message: str, boot: str = "b" * 32, **fields: str) -> dict[str, str]:
    return {"__CURSOR": f"s=test;i={i:x}", "__REALTIME_TIMESTAMP": str(int(time.time() * 1e6)),
            "_BOOT_ID": boot, "_HOSTNAME": "example-group-abcd", "MESSAGE": message, "PRIORITY": "6", **fields}


CFG = {"project": "my-project-123456", "experiment": "example", "run": "runs/example"}
RESOURCE = {"type": "gce_instance", "labels": {"project_id": "my-project-123456", "instance_id": "1", "zone": "z-a"}}


def test_a_journal_record_becomes_an_entry_with_the_run_fields() -> None:
    unit = {"_SYSTEMD_UNIT": "spottrain.service", "_SYSTEMD_INVOCATION_ID": "0123456789abcdef" * 2}
    e = entry(_record(1, sign(KEY, "2026-01-02T03:04:05.678 WARNING trainer rank=1 event=tier_failing tier=gcs "
                                   "since=x"), **unit), CFG, RESOURCE, KEY)
    p = e["jsonPayload"]
    assert (p["experiment"], p["run"], p["node"], p["session"], p["rank"], p["event"], p["source"]) == (
        "example", "runs/example", "example-group-abcd", "0123456789ab", 1, "tier_failing", "trainer")
    assert e["labels"] == {LABEL: "example"} and e["severity"] == "WARNING" and e["resource"] == RESOURCE
    assert e["logName"] == "projects/my-project-123456/logs/spottrain" and e["timestamp"].endswith("Z")
    # systemd's line about the unit belongs to the same session; a boot script's to none.
    exited = entry(_record(2, "spottrain.service: Main process exited, code=exited, status=75/n/a", _PID="1",
                           UNIT="spottrain.service", INVOCATION_ID="0123456789abcdef" * 2), CFG, RESOURCE)
    assert exited["jsonPayload"]["session"] == "0123456789ab" and exited["jsonPayload"]["source"] == "systemd"
    script = entry(_record(3, "startup-script: 2026-01-02T03:04:05.000Z spottrain-startup: event=boot after=first",
                           SYSLOG_IDENTIFIER="google_metadata_script_runner"), CFG, RESOURCE)
    assert "session" not in script["jsonPayload"] and script["jsonPayload"]["source"] == "startup"
    assert script["jsonPayload"]["message"].startswith("2026-01-02T03:04:05.000Z spottrain-startup:")
    # The same journal line twice is the same insertId (a batch sent again is deduplicated).
    assert entry(_record(3, "x"), CFG, RESOURCE)["insertId"] == entry(_record(3, "y"), CFG, RESOURCE)["insertId"]


# --- the shipper, a real process ------------------------------------------------------------------
class Rig:
    """A journal (the drill's JSON journal and journalctl stub), a systemctl that answers
    is-active from a file, the fake metadata server and the fake Logging API; the shipper runs as
    the VM runs it: `log_shipper.py CONFIG`."""

    def __init__(self, root: Path, **cfg: Any) -> None:
        self.root = root
        bin_ = root / "bin"
        bin_.mkdir(parents=True)
        stub = (REPO / "drill" / "stubs" / "journalctl").read_text()
        (bin_ / "journalctl").write_text(stub.replace("@PYTHON@", sys.executable).replace("@STATE@", str(root)))
        (bin_ / "systemctl").write_text(f"#!/bin/sh\ncat {root}/unit-state\n")
        for f in bin_.iterdir():
            f.chmod(0o755)
        self.set_trainer("active")
        self.boot = open("/proc/sys/kernel/random/boot_id").read().strip().replace("-", "")
        self.n = 0
        self.logging = FakeObservability("my-project-123456", token=TOKEN).start()
        self.metadata = MetadataServer(project_id="my-project-123456").start()
        config = {**CFG, "stall_s": 3600, "drain_s": 10, "retry_s": 0.05, "cursor_file": str(root / "cursor"),
                  "key_file": str(root / "run" / "log.key"), "units": ["spottrain.service"],
                  "identifiers": ["google_metadata_script_runner"], **cfg}
        # The key the shipper finds at its start (as on a VM, where it made it before the trainer ran):
        # the trainer's lines below are signed with it, as the trainer signs them.
        self.key_file = Path(config["key_file"])
        self.key = load_key(config["key_file"], create=True)
        assert self.key is not None
        (root / "logs.json").write_text(json.dumps(config))
        (root / "journal.jsonl").touch()
        self.env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "GCE_METADATA_HOST": self.metadata.host,
                    "SPOTTRAIN_LOGGING_API": self.logging.logging_api}
        self.proc: subprocess.Popen[str] | None = None

    def set_trainer(self, state: str) -> None:
        (self.root / "unit-state").write_text(state + "\n")

    def line(self, message: str, *, signed: bool | None = None, **fields: str) -> None:
        """One journal record; the trainer unit's by default, signed when it is a trainer line
        (`signed=False`: text in its output that only looks like one)."""
        self.n += 1
        if signed is None:
            signed = not fields and TRAINER_LINE.match(message) is not None
        if signed:
            assert self.key is not None
            message = sign(self.key, message)
        fields = fields or {"_SYSTEMD_UNIT": "spottrain.service", "_SYSTEMD_INVOCATION_ID": "c" * 32}
        with open(self.root / "journal.jsonl", "a") as f:
            f.write(json.dumps(_record(self.n, message, self.boot, **fields)) + "\n")

    def start(self) -> None:
        # Its own process group, as a unit's cgroup: a test can signal the shipper and its journalctl.
        self.proc = subprocess.Popen([sys.executable, str(REPO / "trainer" / "cloud" / "log_shipper.py"),
                                      str(self.root / "logs.json")], env=self.env, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)

    def journalctl(self) -> int:
        """The pid of the shipper's `journalctl --follow`."""
        assert self.proc is not None
        children = [int(c) for t in Path(f"/proc/{self.proc.pid}/task").iterdir()
                    for c in (t / "children").read_text().split()]
        [pid] = [c for c in children if "--follow" in Path(f"/proc/{c}/cmdline").read_text()]
        return pid

    def stop(self) -> str:
        """SIGTERM once the trainer unit has stopped (the drain then ends with the journal)."""
        assert self.proc is not None
        self.set_trainer("inactive")
        self.proc.send_signal(signal.SIGTERM)
        _, err = self.proc.communicate(timeout=GUARD_S)
        assert self.proc.returncode == 0, err
        return err

    def messages(self) -> list[str]:
        return [e["jsonPayload"]["message"] for e in self.logging.entries]

    def wait(self, n: int) -> None:
        assert self.logging.wait_for(lambda o: len(o.entries) >= n, GUARD_S), self.messages()

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.logging.stop()
        self.metadata.stop()


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    r = Rig(tmp_path)
    yield r
    r.close()


def _step(n: int) -> str:
    return f"2026-01-02T03:04:{n % 60:02d}.000 INFO trainer event=step step={n}/100 loss=2.0 steps_per_s=1.0"


def test_it_ships_the_journal_and_a_restart_resumes_after_its_cursor(rig: Rig) -> None:
    rig.line("startup-script: 2026-01-02T03:04:00.000Z spottrain-startup: event=boot after=first boot=1",
             SYSLOG_IDENTIFIER="google_metadata_script_runner")
    rig.line(_step(1))
    rig.line("not ours", _SYSTEMD_UNIT="ssh.service")  # outside the matches: never shipped
    rig.start()
    rig.wait(2)
    rig.line(_step(2))
    rig.wait(3)
    rig.stop()
    assert (rig.root / "cursor").read_text().strip() == "s=test;i=4"
    rig.line(_step(3))
    rig.start()  # a restart (Restart=always, or a VM started again with its boot disk)
    rig.wait(4)
    rig.stop()
    assert rig.messages() == ["2026-01-02T03:04:00.000Z spottrain-startup: event=boot after=first boot=1",
                              _step(1), _step(2), _step(3)]
    assert [e["jsonPayload"].get("step") for e in rig.logging.entries] == [None, 1, 2, 3]
    f = Filter('labels."spottrain-experiment"="example" AND jsonPayload.event="step" AND jsonPayload.session="cccccccccccc"')
    assert len(rig.logging.matching(f.text)) == 3


def test_an_outage_is_retried_and_nothing_is_lost_or_shipped_twice(rig: Rig) -> None:
    rig.logging.fail("POST", "entries:write", 503, times=2)
    rig.logging.fail("POST", "entries:write", 403, times=1)  # the account's grant still propagating
    rig.line(_step(1))
    rig.start()
    rig.wait(1)
    rig.line(_step(2))
    rig.wait(2)
    err = rig.stop()
    assert rig.messages() == [_step(1), _step(2)]
    assert [c[2] for c in rig.logging.calls[:4]] == [503, 503, 403, 200]
    assert "retrying" in err


def test_the_shipper_retries_what_the_trainer_retries() -> None:
    """It runs without the trainer package, so it mirrors trainer.retry's rule: the same
    answers (and an expired token's 401, and 403 without end), waits doubling to the same cap."""
    assert set(RETRY) == set(retry.RETRY_STATUS) | {401, retry.FORBIDDEN}
    assert RETRY_CAP_S == retry.IAM_GRANT.grace_cap_s


def test_a_batch_the_api_refuses_for_good_is_passed_over(rig: Rig) -> None:
    rig.logging.fail("POST", "entries:write", 400, times=1)
    rig.line(_step(1))
    rig.start()
    assert rig.logging.wait_for(lambda o: any(c[2] == 400 for c in o.calls), GUARD_S)
    rig.line(_step(2))
    rig.wait(1)
    err = rig.stop()
    assert rig.messages() == [_step(2)] and "passing over" in err


def test_the_watchdog_says_stalled_while_the_trainer_unit_is_active_without_a_step(tmp_path: Path) -> None:
    rig = Rig(tmp_path, stall_s=1.5)
    try:
        rig.set_trainer("inactive")
        rig.line(_step(1))
        rig.start()
        rig.wait(1)
        rig.line(_step(2))  # the trainer unit is not running: no stall, however long
        rig.wait(2)
        rig.set_trainer("active")
        assert rig.logging.wait_for(
            lambda o: any(e["jsonPayload"].get("event") == "stalled" for e in o.entries), GUARD_S), rig.messages()
        stalled = [e for e in rig.logging.entries if e["jsonPayload"].get("event") == "stalled"]
        p = stalled[0]["jsonPayload"]
        assert (p["source"], p["session"], p["fields"]["last_step"]) == ("logs", "cccccccccccc", 2)
        assert stalled[0]["severity"] == "WARNING" and p["fields"]["stalled_s"] >= 1
        assert [e["jsonPayload"].get("event") for e in rig.logging.entries][:2] == ["step", "step"]
        rig.stop()
    finally:
        rig.close()


def test_at_power_off_it_ships_until_the_trainer_has_stopped(rig: Rig) -> None:
    rig.line(_step(1))
    rig.start()
    rig.wait(1)
    assert rig.proc is not None
    rig.proc.send_signal(signal.SIGTERM)  # the power-off began; the trainer still saves
    rig.line("2026-01-02T03:05:00.000 WARNING trainer event=preempted step=1 persistent_ok=1 gcs_ok=1 seconds=2.5")
    rig.wait(2)
    assert rig.proc.poll() is None  # still there while the trainer unit is active
    rig.set_trainer("inactive")
    assert rig.proc.wait(GUARD_S) == 0
    assert rig.messages()[-1].endswith("seconds=2.5")


def test_lines_its_journalctl_never_handed_over_are_shipped_when_the_power_off_kills_it(rig: Rig) -> None:
    """The power-off's SIGTERM may reach the shipper's journalctl too (a unit's whole cgroup, were
    it not KillMode=mixed): the shutdown script's last line, written but not yet read, still
    reaches Cloud Logging."""
    rig.line(_step(1))
    rig.start()
    rig.wait(1)
    assert rig.proc is not None
    follower = rig.journalctl()
    os.kill(follower, signal.SIGSTOP)  # it has not read what comes next, and never will
    rig.line("shutdown-script: 2026-01-02T03:05:01.000Z spottrain-shutdown: event=shutdown reason=preemption "
             "trainer_status=75 stop_s=3", SYSLOG_IDENTIFIER="google_metadata_script_runner")
    rig.set_trainer("inactive")
    os.killpg(rig.proc.pid, signal.SIGTERM)
    os.kill(follower, signal.SIGCONT)  # the pending SIGTERM ends it before it reads again
    assert rig.proc.wait(GUARD_S) == 0
    assert [e["jsonPayload"].get("event") for e in rig.logging.entries] == ["step", "shutdown"]


def test_logs_reads_a_trainers_own_log_into_its_sessions(trainer_lines, tmp_path: Path) -> None:
    """The same parse rule over a local file: `python -m trainer logs --file` (a new session at
    each event=start)."""
    log = tmp_path / "train.log"
    log.write_text("\n".join(trainer_lines) + "\n")
    out = subprocess.run([sys.executable, "-m", "trainer", "logs", "--file", str(log), "--json"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    (vm,) = json.loads(out.stdout)["vms"]
    first, second = vm["sessions"]
    assert first["ended"].startswith("preempted: emergency save of step ") and first["first_step"] == 0
    assert second["ended"] == "finished at step 40" and second["first_step"] == first["last_step"]


def _stall_clock_entries(lines: list[str]) -> list[dict[str, Any]]:
    from trainer.cloud.log_shipper import local_entry

    return [local_entry(line, {"experiment": "pool", "run": "runs/pool"}) for line in lines]


@pytest.mark.parametrize(("lines", "stalls"), [
    # Another node of a healthy pool: rank 0 logs the step lines elsewhere; this node's leader says
    # it trains (trainer.observe.progress.Heartbeat) once a minute.
    (["2026-01-02T03:04:05.000 INFO trainer event=heartbeat step=40 (this node trains; rank 0 logs the step lines)"],
     False),
    # A coordinator that only hosts the rendezvous store (trainer.rendezvous.serve).
    (["2026-01-02T03:04:05.000 INFO trainer event=heartbeat role=rendezvous (the coordinator hosts the rendezvous "
      "store; it does not train)"], False),
    # A hung trainer still writes other lines, none of them progress: a stall.
    (["2026-01-02T03:04:05.000 INFO trainer event=checkpoint_save step=40 blocked_s=0.1"], True),
])
def test_the_stall_clock_resets_on_every_nodes_heartbeat_not_only_on_rank_0s_step_lines(lines, stalls) -> None:
    """In a pool only global rank 0 logs step lines; each node's shipper resets its stall clock
    on its own node's lines alone, so every other node (and a coordinator that does not train)
    would report a stall every stall_s while the pool trains well."""
    from trainer.cloud.log_shipper import Shipper

    s = Shipper({"project": "p", "experiment": "pool", "run": "runs/pool", "stall_s": 300})
    s._trainer_active = lambda: True  # type: ignore[method-assign]  # the unit runs the whole time
    s._resource = lambda: {"type": "global", "labels": {"project_id": "p"}}  # type: ignore[method-assign]
    s._last_poll, now, seen = 0.0, 0.0, []
    while now < 1800:  # half an hour of a line a minute, the watchdog polled every 10 s
        if now % 60 == 0:
            for e in _stall_clock_entries(lines):
                s._saw(e)
        stalled = s.watchdog(now)
        if stalled is not None:
            seen.append(stalled)
        now += 10.0
    assert bool(seen) is stalls, [e["jsonPayload"]["message"] for e in seen]
