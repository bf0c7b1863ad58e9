"""Logs that outlive the VM, end to end in the drill: the real boot scripts start the real log
shipper in the drill VM, which ships to the loopback Cloud Logging; a preempted VM's session and
its recreation's are both read back with `python -m trainer logs`, and a hung trainer makes the
stall alert's log-based metric count. Which alerts fire is the synthesized stack's own policies
evaluated over what the loopback Cloud Logging received (`drill.alert_eval`): the preempted and
finished run raises "run finished" once, on the real finish (not on forged text in the trainer's
output), counts its one preemption once and raises nothing else; the hung trainer raises "training
stalled" and nothing else; a zone-change group whose VM keeps going away raises "repair loop"."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from drill.alert_eval import evaluate
from drill.drill import DRILL_TOKEN, RESTORE_RE, STEP_RE, UNIT, Deployment, DrillConfig, render, stack_json
from drill.net import free_port
from drill.sandbox import REPO
from drill_support import needs_root, zone_change_example
from stacks import alert_rules, run_metrics
from stacks.boot import LogShipping
from stacks.load import load_file

pytestmark = needs_root

GUARD_S = 300.0  # a failure guard for waits, never a timing assertion
EXAMPLE = load_file(REPO / "experiments" / "example.toml")
PROJECT, NAME = EXAMPLE.spec.gcp.project, EXAMPLE.name
#: Text in the trainer unit's output that looks exactly like the trainer's finished line (what a
#: task, a library or a subprocess could print): unsigned, so never the trainer's record.
FORGED_FINISH = "2026-01-01T00:00:00.000 INFO trainer event=finished step=99"


def _fired(dep: Deployment) -> dict[str, list[dict]]:
    """The alerts that fire on what the drill's VMs shipped: condition title -> entries counted."""
    return {t: o.entries for t, o in evaluate(stack_json(dep.r), dep.observability).items() if o.fired}


def _trainer_unit_pid(dep: Deployment) -> str:
    assert dep.vm is not None
    return dep.vm.exec(["systemctl", "show", "--property=MainPID", "--value", UNIT]).stdout.strip()


def _deployment(tmp_path: Path, cfg: DrillConfig, **extra: object) -> Deployment:
    rendered = render(cfg, free_port(), trainer_source=REPO / "trainer", code_dir=tmp_path / "code", extra=extra)
    return Deployment(tmp_path / "dep", rendered, cfg, lambda s: None, REPO)


def test_a_preempted_and_recreated_vms_sessions_are_read_back_with_trainer_logs(tmp_path: Path) -> None:
    cfg = DrillConfig(steps=60, checkpoint_every_steps=20, disk_mb=64, window_s=20.0)
    with _deployment(tmp_path, cfg) as dep:
        assert dep.vm is not None
        j0, e0 = dep.boot()
        dep.wait_line(RESTORE_RE, j0, events_since=e0)
        dep.wait_line(STEP_RE, j0, accept=lambda m: int(m.group(1)) >= 10, events_since=e0)
        # Another writer of the trainer unit's output (its stdout, as a subprocess holds it).
        forge = dep.vm.exec(["sh", "-c", f"printf '%s\\n' '{FORGED_FINISH}' > /proc/{_trainer_unit_pid(dep)}/fd/1"])
        assert forge.returncode == 0, forge.stderr
        dep.metadata.preempt()
        assert not dep.vm.power_off(cfg.window_s)["killed"], dep.vm.tail()
        saved = int(re.findall(r"event=preempted step=(\d+)", dep.vm.journal()[j0:])[-1])
        dep.run_to_end()  # the group recreates the VM: a new boot disk, the same checkpoint disk
        token = tmp_path / "token"
        token.write_text(DRILL_TOKEN)
        out = subprocess.run([sys.executable, "-m", "trainer", "logs", "--project", PROJECT, "--experiment", NAME,
                              "--access-token-file", str(token), "--json"], cwd=REPO, capture_output=True, text=True,
                             env={**os.environ, "SPOTTRAIN_LOGGING_API": dep.observability.logging_api}, timeout=120)
        assert out.returncode == 0, out.stderr
        first, second = json.loads(out.stdout)["vms"]
        assert first["boot"] != second["boot"] and first["node"] == second["node"] == dep.hostname
        assert (first["after"], second["after"]) == ("first", "preemption")
        (s1,) = first["sessions"]
        (s2,) = second["sessions"]
        assert s1["ended"].startswith(f"preempted: emergency save of step {saved} in ") and s1["exit"] == "75", s1
        assert first["shutdown"] == "preemption (trainer exit 75)"
        assert s2["first_step"] == saved and s2["ended"] == f"finished at step {cfg.steps} (exit 0)", s2
        # The drill's own report ends with the same, read in-process through the same API.
        text = "\n".join(dep.logs())
        assert "2 boot(s) of 1 VM(s), 2 trainer session(s)" in text and "after preemption" in text
        # The alerts: the finish once, the real one; the one preemption counted once (below the
        # threshold); no stall, no repair loop, nothing stopped.
        forged = dep.observability.matching(f'jsonPayload.message="{FORGED_FINISH}"')
        assert len(forged) == 1 and "event" not in forged[0]["jsonPayload"], forged  # it reached Logging, plain
        fired = _fired(dep)
        assert sorted(fired) == ["run finished"], {t: [e["jsonPayload"]["message"] for e in es] for t, es in fired.items()}
        (finish,) = fired["run finished"]
        assert finish["jsonPayload"]["step"] == cfg.steps and finish["jsonPayload"]["boot"] == second["boot"]
        outcome = evaluate(stack_json(dep.r), dep.observability)
        assert len(outcome["frequent preemptions"].entries) == 1
        assert outcome["frequent preemptions"].entries[0]["jsonPayload"]["boot"] == first["boot"]


def test_a_hung_trainer_makes_the_stall_alerts_metric_count(tmp_path: Path) -> None:
    """The trainer stops (SIGSTOP: alive, stepping no more); the shipper's watchdog writes
    event=stalled once the unit has been active `stall_s` without a step, and the stall alert's
    log-based metric, evaluated over the entries the loopback Cloud Logging holds, counts it."""
    cfg = DrillConfig(steps=1_000_000, disk_mb=64)
    stall = run_metrics.by_name(PROJECT, NAME)["stalls"]
    rule = next(r for r in alert_rules.rules(EXAMPLE.spec) if r.metric == "stalls")
    with _deployment(tmp_path, cfg, logs=LogShipping(project=PROJECT, stall_s=15)) as dep:
        assert dep.vm is not None
        j0, e0 = dep.boot()
        m = dep.wait_line(STEP_RE, j0, accept=lambda m: int(m.group(1)) >= 20, events_since=e0)
        logged = lambda: [e for e in dep.observability.matching(stall.filter)  # noqa: E731
                          if isinstance(e["jsonPayload"]["fields"].get("last_step"), int)]
        assert logged() == []  # stepping: no stall (a start-up's would name no step)
        assert "training stalled" not in _fired(dep)
        main = _trainer_unit_pid(dep)
        (trainer,) = dep.vm.exec(["cat", f"/proc/{main}/task/{main}/children"]).stdout.split()
        assert dep.vm.exec(["kill", f"-{signal.SIGSTOP.name}", trainer]).returncode == 0
        assert dep.observability.wait_for(lambda o: bool(logged()), GUARD_S), dep.vm.tail()
        hung = logged()[0]["jsonPayload"]
        last = max(int(x) for x in re.findall(r"event=step step=(\d+)/", dep.vm.journal()[j0:]))
        assert hung["fields"]["last_step"] == last >= int(m.group(1))
        assert hung["node"] == dep.hostname and hung["session"] and hung["source"] == "logs"
        assert len(logged()) > rule.threshold  # the alert's condition: more than 0 in its period
        fired = _fired(dep)
        assert sorted(fired) == ["training stalled"] and fired["training stalled"][0]["jsonPayload"] == hung
        dep.vm.kill()


def test_a_zone_change_group_that_keeps_recreating_its_vm_raises_the_repair_loop_alert(tmp_path: Path) -> None:
    """A group with zone_change_on_repair keeps no stateful disk: every VM it recreates boots on a
    blank disk and says after=first, so boots cannot tell a repair. Each VM that goes other than by
    a preemption (the group recreating it: here powered off without a notice) has its shutdown
    script say reason=stop, and the third within the hour raises "repair loop" (more than
    repairs_per_hour = 2); the first two raise nothing."""
    exp = zone_change_example(tmp_path)
    cfg = DrillConfig(experiment=exp, steps=1_000_000, disk_mb=64)
    with _deployment(tmp_path, cfg) as dep:
        assert dep.vm is not None
        for i in range(3):
            assert _fired(dep) == {}, i
            j0, e0 = dep.boot()
            dep.wait_line(RESTORE_RE, j0, events_since=e0)  # the trainer runs: then the VM goes
            assert not dep.power_off()["killed"], dep.vm.tail()
            dep.disk.blank()  # its successor's disk is a new one, maybe in another zone
        fired = _fired(dep)
        assert sorted(fired) == ["repair loop"], fired
        assert len(fired["repair loop"]) == 3
        assert {e["jsonPayload"]["fields"]["reason"] for e in fired["repair loop"]} == {"stop"}
        boots = dep.observability.matching('jsonPayload.source="startup" AND jsonPayload.event="boot"')
        assert [e["jsonPayload"]["fields"]["after"] for e in boots] == ["first"] * 3  # they said nothing of it
