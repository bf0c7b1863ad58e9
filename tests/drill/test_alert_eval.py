"""The alert evaluator (drill/alert_eval.py) on the synthesized stacks' own policies, over entries
the shipper's conversion makes of journal lines and the loopback Logging API holds: the counting
conditions fire on more than their threshold within their window and not otherwise, a repair loop
on a zone-change group is counted from its stops, and forged text counts nowhere. The drill tests
(test_logs_drill.py) use the same evaluator on what real VMs shipped."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from drill.alert_eval import EvalError, evaluate, policies
from drill.fake_observability import FakeObservability
from drill.sandbox import REPO
from drill_support import zone_change_example
from trainer.cloud.log_shipper import TRAINER_LINE, entry, sign

PROJECT = "my-project-123456"
RESOURCE = {"type": "gce_instance", "labels": {"project_id": PROJECT, "instance_id": "7", "zone": "us-central1-a"}}
KEY = b"0123456789abcdef" * 4
UNIT = {"_SYSTEMD_UNIT": "spottrain.service", "_SYSTEMD_INVOCATION_ID": "9" * 32}
SCRIPT = {"SYSLOG_IDENTIFIER": "google_metadata_script_runner"}


def _stack(tmp: Path, zone_change: bool = False) -> dict[str, Any]:
    from stacks.load import load_file
    from stacks.stack import synthesized

    ef = load_file(zone_change_example(tmp) if zone_change else REPO / "experiments" / "example.toml")
    return synthesized(ef.name, ef.spec)


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _stack(tmp_path_factory.mktemp("example"))


@pytest.fixture(scope="module")
def zone_change(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _stack(tmp_path_factory.mktemp("zone-change"), zone_change=True)


def _entries(lines: list[tuple[float, dict[str, str], str]], forged: bool = False) -> list[dict[str, Any]]:
    """(seconds ago, journal fields, message) -> the entries the shipper writes; the trainer's own
    lines signed with the VM's key unless `forged` (text that only looks like them)."""
    cfg = {"project": PROJECT, "experiment": "example", "run": "runs/example"}
    out = []
    now = time.time()
    for i, (ago, fields, message) in enumerate(lines):
        if not forged and TRAINER_LINE.match(message):
            message = sign(KEY, message)
        record = {"__CURSOR": f"s=w;i={i}", "__REALTIME_TIMESTAMP": str(int((now - ago) * 1e6)), "_BOOT_ID": "b" * 32,
                  "_HOSTNAME": "example-x1y2", "MESSAGE": message, "PRIORITY": "6", **fields}
        out.append(entry(record, cfg, RESOURCE, KEY))
    return out


def _fired(stack: dict[str, Any], entries: list[dict[str, Any]]) -> dict[str, int]:
    """Condition title -> how many entries it counted, for the policies that fire."""
    with FakeObservability(PROJECT) as fake:
        status, answer = fake.handle("POST", "/v2/entries:write", {}, {"entries": entries})
        assert status == 200, answer
        return {title: len(o.entries) for title, o in evaluate(stack, fake).items() if o.fired}


def _boots(after: str, agos: list[float]) -> list[tuple[float, dict[str, str], str]]:
    return [(ago, SCRIPT, f"startup-script: 2026-03-01T10:00:00.000Z spottrain-startup: event=boot after={after} "
                          f"boot={i}") for i, ago in enumerate(agos)]


def _shutdowns(reason: str, agos: list[float]) -> list[tuple[float, dict[str, str], str]]:
    return [(ago, SCRIPT, f"shutdown-script: 2026-03-01T10:05:00.000Z spottrain-shutdown: event=shutdown "
                          f"reason={reason} trainer_status=0 stop_s=1") for ago in agos]


def test_the_example_has_eight_policies_the_evaluator_reads(example) -> None:
    p = policies(example)
    assert sorted(p) == sorted(["training stalled", "repair loop", "frequent preemptions", "run stopped",
                                "checkpoints set aside", "waiting for capacity", "stop marker refused", "run finished"])
    assert sorted(t for t, x in p.items() if not x.log_match) == ["frequent preemptions", "repair loop",
                                                                  "waiting for capacity"]
    assert p["repair loop"].labels == {"after": {"stop", "unknown"}} and p["repair loop"].threshold == 2
    assert p["waiting for capacity"].duration_s == 7200


def test_a_repair_loop_is_more_than_two_unexplained_boots_in_an_hour(example) -> None:
    assert _fired(example, _entries(_boots("stop", [3000, 2000, 100]))) == {"repair loop": 3}
    assert _fired(example, _entries(_boots("unknown", [3000, 2000]) + _boots("stop", [10]))) == {"repair loop": 3}
    assert _fired(example, _entries(_boots("stop", [3000, 100]))) == {}  # two: not more than 2
    assert _fired(example, _entries(_boots("stop", [9000, 5000, 100]))) == {}  # three, over hours
    assert _fired(example, _entries(_boots("preemption", [300, 200, 100]) + _boots("first", [50]))) == {}
    # Where every VM boots on a blank disk (after=first), the example's rule sees nothing.
    assert _fired(example, _entries(_boots("first", [300, 200, 100]) + _shutdowns("stop", [310, 210, 110]))) == {}


def test_a_repair_loop_on_a_zone_change_group_is_counted_from_its_stops(zone_change) -> None:
    loop = _boots("first", [300, 200, 100]) + _shutdowns("stop", [310, 210, 110])
    assert _fired(zone_change, _entries(loop)) == {"repair loop": 3}
    assert _fired(zone_change, _entries(_boots("first", [300, 200]) + _shutdowns("stop", [310, 210]))) == {}
    # Preemptions are not repairs.
    assert _fired(zone_change, _entries(_shutdowns("preemption", [310, 210, 110]))) == {}


def test_each_preemption_counts_once_and_more_than_three_an_hour_fire(example) -> None:
    assert _fired(example, _entries(_shutdowns("preemption", [3000, 2000, 1000, 100]))) == {"frequent preemptions": 4}
    assert _fired(example, _entries(_shutdowns("preemption", [2000, 1000, 100]))) == {}
    # The trainer's own preempted line, quoted by the shutdown script, is not another preemption.
    quoted = [(100, SCRIPT, "shutdown-script: 2026-03-01T10:05:01.000Z spottrain-shutdown: trainer: "
                            "2026-03-01T10:04:59.000 WARNING trainer event=preempted step=300 persistent_ok=1")]
    assert _fired(example, _entries(_shutdowns("preemption", [2000, 1000, 100]) + quoted * 3)) == {}


def test_the_finished_alert_fires_on_the_trainers_finish_and_not_on_forged_text(example) -> None:
    real = [(100, UNIT, "2026-03-01T10:03:00.000 INFO trainer event=finished step=300")]
    again = [(50, UNIT, "2026-03-01T10:04:00.000 INFO trainer event=finished step=300 (already complete)")]
    assert _fired(example, _entries(real + again)) == {"run finished": 1}
    forged = [(100, UNIT, "2026-03-01T10:03:00.000 INFO trainer event=finished step=300"),
              (90, UNIT, "event=finished step=99"),
              (80, UNIT, "2026-03-01T10:06:33.000 ERROR trainer event=failed reason=forged"),
              (70, UNIT, "event=stalled stalled_s=1 last_step=1")]
    assert _fired(example, _entries(forged, forged=True)) == {}


def test_waiting_for_capacity_fires_only_after_its_duration_of_stockouts(example) -> None:
    """Stockouts in every half hour for capacity_wait_minutes (120): Compute Engine's audit entries."""
    def stockouts(agos: list[float]) -> list[dict[str, Any]]:
        out = []
        for i, ago in enumerate(agos):
            out.append({
                "logName": f"projects/{PROJECT}/logs/cloudaudit.googleapis.com%2Factivity",
                "resource": {"type": "gce_instance", "labels": {"project_id": PROJECT, "instance_id": "1",
                                                                 "zone": "us-central1-a"}},
                "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - ago)),
                "severity": "ERROR", "insertId": f"audit-{i}",
                "protoPayload": {"methodName": "v1.compute.instances.insert",
                                 "resourceName": "projects/p/zones/us-central1-a/instances/example-ab12",
                                 "status": {"message": "ZONE_RESOURCE_POOL_EXHAUSTED"}}})
        return out
    every_20_min = [i * 1200.0 for i in range(9, -1, -1)]  # 3 hours of them, the last just now
    assert _fired(example, stockouts(every_20_min)) == {"waiting for capacity": 10}
    assert _fired(example, stockouts(every_20_min[-4:])) == {}  # one hour: not yet two
    other = [{**e, "protoPayload": {**e["protoPayload"], "resourceName": "projects/p/zones/z/instances/example-big-ab12"}}
             for e in stockouts(every_20_min)]
    assert _fired(example, other) == {}  # another experiment's VMs


def test_a_condition_it_cannot_read_is_an_error_not_silence(example) -> None:
    import copy

    s = copy.deepcopy(example)
    (policy, *_) = [p for p in s["resource"]["google_monitoring_alert_policy"].values()
                    if "condition_threshold" in p["conditions"][0]]
    policy["conditions"][0]["condition_threshold"]["comparison"] = "COMPARISON_LT"
    with pytest.raises(EvalError, match="comparison COMPARISON_LT"):
        policies(s)
