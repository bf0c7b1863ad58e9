"""Watching a deployed run (docs/watch.md): the log-based metrics count what they say, evaluated
against real shipped entries in the loopback Logging API; the alert policies, their channels and
notification text; the dashboard reads only metrics that exist; the billing budget; the
`[alerts]` and `[budget]` fields refuse bad input."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import pytest
from stack_support import EXAMPLE, merged, variant

from drill.fake_observability import FakeObservability
from stacks import alert_rules, run_metrics
from stacks.dashboard import dashboard, metric_types
from stacks.load import ExperimentError, parse
from trainer.cloud.log_shipper import TRAINER_LINE, entry, sign

pytestmark = pytest.mark.xdist_group("stacks")

PROJECT = "my-project-123456"
RESOURCE = {"type": "gce_instance", "labels": {"project_id": PROJECT, "instance_id": "7", "zone": "us-central1-a"}}
KEY = b"0123456789abcdef" * 4  # the VM's log key, which signs the trainer's own lines


def _entries(experiment: str = "example") -> list[dict[str, Any]]:
    """One VM's journal as its shipper turns it into entries: one line of each kind the metrics
    count (and a few they must not: among them text in the trainer's output that only looks like
    its lines, unsigned), tagged with what each line is."""
    cfg = {"project": PROJECT, "experiment": experiment, "run": f"runs/{experiment}"}
    unit = {"_SYSTEMD_UNIT": "spottrain.service", "_SYSTEMD_INVOCATION_ID": "9" * 32}
    script = {"SYSLOG_IDENTIFIER": "google_metadata_script_runner"}
    lines = [
        (script, "startup-script: 2026-03-01T10:00:00.000Z spottrain-startup: event=boot after=stop boot=1"),
        (script, "startup-script: 2026-03-01T10:00:01.000Z spottrain-startup: event=boot after=preemption boot=2"),
        (script, "startup-script: 2026-03-01T10:00:02.000Z spottrain-startup: event=boot_failed reason=boot FAILED: no disk"),
        (unit, "2026-03-01T10:01:00.000 INFO trainer event=restore step=0 (no checkpoint: starting fresh)"),
        (unit, "2026-03-01T10:01:00.000 INFO trainer event=restore step=120 tier=gcs path=x seconds=2.0 world_size=1"),
        (unit, "2026-03-01T10:01:10.000 INFO trainer event=step step=130/300 loss=2.5000 lr=1.000e-03 "
               "steps_per_s=4.00 tokens_per_s=1000 eta_s=42"),
        (unit, "2026-03-01T10:01:20.000 INFO trainer event=eval step=130 loss=2.7000 batches=4 seconds=0.1"),
        (unit, "2026-03-01T10:01:30.000 WARNING trainer event=tier_failing tier=gcs failing since 10:01"),
        (unit, "2026-03-01T10:01:40.000 WARNING trainer event=checkpoints_set_aside saved_before=0 steps=10,30 "
               "(started from scratch beside checkpoints nobody can vouch for as this run's: gcs step 10 at x)"),
        (unit, "2026-03-01T10:02:00.000 ERROR trainer event=failed reason=bad_input trainer.steps: no"),
        (unit, "2026-03-01T10:03:00.000 INFO trainer event=finished step=300"),
        (unit, "2026-03-01T10:04:00.000 INFO trainer event=finished step=300 (already complete)"),
        (script, "shutdown-script: 2026-03-01T10:05:00.000Z spottrain-shutdown: event=shutdown reason=preemption "
                 "trainer_status=75 stop_s=4"),
        (script, "shutdown-script: 2026-03-01T10:05:01.000Z spottrain-shutdown: trainer: 2026-03-01T10:04:59.000 "
                 "WARNING trainer event=preempted step=300 persistent_ok=1"),  # quoted by the shutdown script
        (script, "shutdown-script: 2026-03-01T10:06:00.000Z spottrain-shutdown: event=shutdown reason=stop "
                 "trainer_status=0 stop_s=1"),
        # What a task prints or a bucket's text puts on a line of its own: never the trainer's record.
        ({**unit, "forged": "1"}, "2026-03-01T10:06:30.000 INFO trainer event=finished step=300"),
        ({**unit, "forged": "1"}, "2026-03-01T10:06:31.000 INFO trainer event=step step=999/300 loss=0.1 steps_per_s=9"),
        ({**unit, "forged": "1"}, "event=stalled stalled_s=1 last_step=1"),
        ({**unit, "forged": "1"}, "2026-03-01T10:06:32.000Z spottrain-shutdown: event=shutdown reason=preemption"),
        ({**unit, "forged": "1"}, "2026-03-01T10:06:33.000 ERROR trainer event=failed reason=forged"),
    ]
    out = []
    t = time.time() - 600
    for i, (fields, message) in enumerate(lines):
        fields = dict(fields)
        if not fields.pop("forged", None) and TRAINER_LINE.match(message):
            message = sign(KEY, message)  # as the trainer writes its own lines on a VM
        record = {"__CURSOR": f"s=w;i={i}", "__REALTIME_TIMESTAMP": str(int((t + i) * 1e6)), "_BOOT_ID": "b" * 32,
                  "_HOSTNAME": f"{experiment}-x1y2", "MESSAGE": message, "PRIORITY": "6", **fields}
        out.append(entry(record, cfg, RESOURCE, KEY))
    stalled = json.loads(json.dumps(out[5]))  # what the shipper's watchdog writes
    stalled["jsonPayload"].update(source="logs", event="stalled", message="event=stalled stalled_s=1800 last_step=130",
                                  fields={"event": "stalled", "stalled_s": 1800, "last_step": 130})
    stalled["insertId"] = "stalled"
    return out + [stalled]


def _write(fake: FakeObservability, entries: list[dict[str, Any]]) -> None:
    status, answer = fake.handle("POST", "/v2/entries:write", {}, {"entries": entries})
    assert status == 200, answer


#: What each metric must count among `_entries`, by the message's distinguishing text.
EXPECTED = {
    "steps": ["event=step"], "steps_per_s": ["event=step"], "loss": ["event=step"], "step": ["event=step"],
    "eval_loss": ["event=eval"], "restores": ["event=restore step=120"],
    "preemptions": ["reason=preemption"], "stops": ["reason=stop"], "boots": ["after=stop", "after=preemption"],
    "stalls": ["event=stalled"], "failures": ["event=boot_failed", "event=failed"],
    "finished": ["event=finished step=300"], "tier_failing": ["event=tier_failing"], "capacity_waits": [],
    "set_aside": ["event=checkpoints_set_aside"],
    "markers_refused": [],
}


def test_each_log_based_metric_counts_exactly_its_entries() -> None:
    """The filters run over shipped entries (the shipper's own conversion of real journal lines)
    in the loopback Logging API's evaluator; another experiment's entries never count."""
    with FakeObservability(PROJECT) as fake:
        _write(fake, _entries() + _entries("other"))
        for m in run_metrics.metrics(PROJECT, "example"):
            got = [e["jsonPayload"]["message"] for e in fake.matching(m.filter)]
            want = EXPECTED[m.name]
            assert len(got) == len(want) and all(any(w in g for g in got) for w in want), (m.name, got)
            for e in fake.matching(m.filter):
                if m.value_field:  # a distribution extracts a number from every entry it counts
                    value: Any = e
                    for part in m.value_field.split("."):
                        value = value[part]
                    assert isinstance(value, (int, float)), (m.name, value)
                for label, path in m.labels.items():
                    assert e["jsonPayload"]["fields"].get(path.rsplit(".", 1)[1]) is not None, (m.name, label)
    assert set(EXPECTED) == set(run_metrics.by_name(PROJECT, "example"))


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--steps", "3", "--bogus"]], ids=["config", "usage"])
def test_a_command_line_the_trainer_refuses_counts_as_a_failure(argv, tmp_path, capsys, monkeypatch) -> None:
    """A VM whose trainer refuses its command line stops itself (exit 2): the line it logs must be
    the structured failure that the `failures` metric, and so the "run stopped" alert, counts (a
    line the trainer signs with the VM's log key, as on a VM)."""
    from trainer.cli import main
    from trainer.cloud.log_shipper import KEY_ENV

    key_file = tmp_path / "log.key"
    key_file.write_text(KEY.decode() + "\n")  # the key is the file's text (trainer.cloud.log_shipper.load_key)
    monkeypatch.setenv(KEY_ENV, str(key_file))
    try:
        code = main(["run", "--run-dir", str(tmp_path), *argv])
    except SystemExit as e:  # argparse's own refusal
        code = e.code
    assert code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    cfg = {"project": PROJECT, "experiment": "example", "run": "runs/example"}
    unit = {"_SYSTEMD_UNIT": "spottrain.service", "_SYSTEMD_INVOCATION_ID": "9" * 32}
    entries = [entry({"__CURSOR": f"s=w;i={i}", "__REALTIME_TIMESTAMP": str(int(time.time() * 1e6)),
                      "_BOOT_ID": "b" * 32, "_HOSTNAME": "example-x1y2", "MESSAGE": line, "PRIORITY": "3", **unit},
                     cfg, RESOURCE, KEY) for i, line in enumerate(lines)]
    with FakeObservability(PROJECT) as fake:
        _write(fake, entries)
        got = fake.matching(run_metrics.by_name(PROJECT, "example")["failures"].filter)
    assert len(got) == 1, lines
    assert got[0]["jsonPayload"]["fields"]["reason"] == "bad_input"
    assert "command line:" in got[0]["jsonPayload"]["message"]


def test_the_capacity_metric_counts_compute_engines_stockout_audit_entries() -> None:
    audit = {"logName": f"projects/{PROJECT}/logs/cloudaudit.googleapis.com%2Factivity", "resource": RESOURCE,
             "severity": "ERROR", "protoPayload": {
                 "methodName": "v1.compute.instances.insert", "resourceName":
                 f"projects/{PROJECT}/zones/us-central1-a/instances/example-abcd",
                 "status": {"code": 8, "message": "ZONE_RESOURCE_POOL_EXHAUSTED: The zone does not have enough "
                                                  "resources available to fulfill the request."}}}
    other = json.loads(json.dumps(audit))
    other["protoPayload"]["resourceName"] = f"projects/{PROJECT}/zones/us-central1-a/instances/other-abcd"
    quota = json.loads(json.dumps(audit))
    quota["protoPayload"]["status"]["message"] = "Quota 'PREEMPTIBLE_NVIDIA_L4_GPUS' exceeded."

    def on(name: str) -> dict[str, Any]:
        e = json.loads(json.dumps(audit))
        e["protoPayload"]["resourceName"] = f"projects/{PROJECT}/zones/us-central1-a/instances/{name}"
        return e

    # The experiment's own VMs: its fallback group's and its pool's coordinator too.
    own = [audit, on("example-od-x1y2"), on("example-coordinator")]
    # Another experiment whose name starts with this one's ("example-big"): none of its VMs count.
    others = [on("example-big-abcd"), on("example-big-od-abcd"), on("example-big-coordinator")]
    with FakeObservability(PROJECT) as fake:
        _write(fake, [*own, *others, other, quota])
        got = fake.matching(run_metrics.by_name(PROJECT, "example")["capacity_waits"].filter)
        assert sorted(e["protoPayload"]["resourceName"] for e in got) == sorted(
            e["protoPayload"]["resourceName"] for e in own)


def test_the_refused_marker_metric_counts_the_control_jobs_refusals_as_cloud_run_logs_them() -> None:
    """The control job's JSON line on stderr (`trainer.cloud.control.Control.refuse`), as Cloud Run
    turns it into an entry of the `cloud_run_job` resource in its stderr log: this experiment's
    job's refusal counts; another experiment's job, another event, or the VMs' log do not."""
    from trainer.cloud.control import Control, Settings

    lines: list[str] = []
    control = Control(Settings(project=PROJECT, region="us-central1", location="zones/us-central1-a",
                               groups=("example-group",), bucket="b", prefix="runs/example", stop_markers=()),
                      client=None, log=lines.append)  # type: ignore[arg-type]
    control.refuse("runs/example/stop/finished-steps-300.json", "not a signed stop marker")
    control.say("control_done", status=1)

    def entry(line: str, job: str = "example-control") -> dict[str, Any]:
        payload = json.loads(line)
        return {"logName": f"projects/{PROJECT}/logs/run.googleapis.com%2Fstderr",
                "resource": {"type": "cloud_run_job",
                             "labels": {"project_id": PROJECT, "job_name": job, "location": "us-central1"}},
                "severity": payload.get("severity", "DEFAULT"), "jsonPayload": payload}

    refused, done = lines
    with FakeObservability(PROJECT) as fake:
        _write(fake, [entry(refused), entry(done), entry(refused, job="other-control")])
        got = fake.matching(run_metrics.by_name(PROJECT, "example")["markers_refused"].filter)
    assert [e["jsonPayload"]["marker"] for e in got] == ["gs://b/runs/example/stop/finished-steps-300.json"]
    assert got[0]["severity"] == "ERROR"
    assert run_metrics.by_name(PROJECT, "example")["markers_refused"].resource == "cloud_run_job"
    assert "example-control" == __import__("stacks.boot", fromlist=["x"]).control_job_name("example")


def test_metrics_alerts_and_their_words_in_the_stack(synthesized) -> None:
    s = synthesized["example"]
    metrics = {m["name"]: m for m in s.resources("google_logging_metric")}
    assert set(metrics) == {run_metrics.metric_id("example", n) for n in EXPECTED}
    steps = metrics["spottrain/example/steps_per_s"]
    assert steps["value_extractor"] == "EXTRACT(jsonPayload.fields.steps_per_s)"
    assert steps["metric_descriptor"]["value_type"] == "DISTRIBUTION"
    boots = metrics["spottrain/example/boots"]
    assert boots["label_extractors"] == {"after": "EXTRACT(jsonPayload.fields.after)"}
    policies = s.resources("google_monitoring_alert_policy")
    assert len(policies) == len(alert_rules.rules(s.spec)) == 8
    filters = {m.name: m.filter for m in run_metrics.metrics("my-project-123456", "example")}
    rules = {f"spottrain example: {r.title}": r for r in alert_rules.rules(s.spec)}
    for p in policies:
        (condition,) = p["conditions"]
        r = rules[p["display_name"]]
        assert r.matched_log == (r.key in ("stall", "stopped", "set-aside", "marker-refused", "finished"))
        if r.matched_log:
            # One entry fires it: a log-match on the metric's own Logging filter, which needs no
            # metric descriptor (a threshold on a log-based metric created in the same apply gets
            # 404 "Cannot find metric(s)" for up to 10 minutes), rate-limited as the API requires.
            assert "condition_threshold" not in condition
            assert condition["condition_matched_log"] == {"filter": filters[r.metric]}
            assert p["alert_strategy"]["notification_rate_limit"] == {"period": f"{r.period_s}s"}
            assert "google_logging_metric" not in json.dumps(p)
            continue
        # A count: the condition names its metric resource, on the VMs' resource type.
        assert "${google_logging_metric." in condition["condition_threshold"]["filter"]
        assert 'resource.type="gce_instance"' in condition["condition_threshold"]["filter"]
        doc = p["documentation"]["content"]
        assert "make logs EXPERIMENT=example" in doc and "python -m trainer logs --project my-project-123456" in doc
        assert p["documentation"]["mime_type"] == "text/markdown" and "notification_channels" not in p
        assert p["user_labels"]["spottrain-experiment"] == "example"
    repair = next(p for p in policies if p["display_name"].endswith("repair loop"))
    t = repair["conditions"][0]["condition_threshold"]
    assert 'metric.labels.after=one_of("stop", "unknown")' in t["filter"]
    assert (t["threshold_value"], t["aggregations"][0]["alignment_period"]) == (2, "3600s")
    capacity = next(p for p in policies if p["display_name"].endswith("waiting for capacity"))
    assert capacity["conditions"][0]["condition_threshold"]["duration"] == "7200s"
    assert s.resources("google_monitoring_notification_channel") == []
    refused = next(p for p in policies if p["display_name"].endswith("stop marker refused"))
    # The control job's refusals, in its Cloud Run log: the log-match is on that resource.
    assert refused["severity"] == "CRITICAL"
    assert 'resource.type="cloud_run_job"' in refused["conditions"][0]["condition_matched_log"]["filter"]
    assert alert_rules.note(s.spec) == ("alerts: 8 alert policies notify nobody (no email, webhook_url or "
                                        "pubsub_topic in [alerts]); their incidents show in Cloud Monitoring only")


def test_the_repair_loop_alert_counts_what_a_group_without_boot_notes_still_says(synthesized) -> None:
    """A group without a stateful checkpoint disk (zone_change_on_repair, flex-start) boots every VM
    on a blank disk, after=first: the boots cannot tell a repair, so the alert counts the shutdown
    script's reason=stop instead; a group that keeps its notes counts boots no preemption explains."""
    def condition(name: str) -> dict[str, Any]:
        (p,) = [p for p in synthesized[name].resources("google_monitoring_alert_policy")
                if p["display_name"].endswith("repair loop")]
        return p["conditions"][0]["condition_threshold"]

    assert not alert_rules.keeps_boot_notes(synthesized["zone-change"].spec)
    assert "metric-stops_" in condition("zone-change")["filter"] and "after" not in condition("zone-change")["filter"]
    assert "metric-boots_" in condition("example")["filter"]
    assert 'metric.labels.after=one_of("stop", "unknown")' in condition("example")["filter"]


def test_channels_notify_every_policy_and_the_topic_grants_monitoring_its_publisher_role(synthesized) -> None:
    s = synthesized["watch"]
    channels = s.resources("google_monitoring_notification_channel")
    assert sorted((c["type"], json.dumps(c["labels"])) for c in channels) == sorted([
        ("email", '{"email_address": "ml-team@example.com"}'), ("email", '{"email_address": "oncall@example.com"}'),
        ("webhook_tokenauth", '{"url": "https://hooks.example.com/spottrain?token=abc123"}'),
        ("pubsub", '{"topic": "projects/my-project-123456/topics/spottrain-alerts"}')])
    policies = s.resources("google_monitoring_alert_policy")
    assert len(policies) == 7  # notify_finished = false
    assert all(len(p["notification_channels"]) == 4 for p in policies)
    grant = s.one("google_pubsub_topic_iam_member")
    assert (grant["project"], grant["topic"], grant["role"]) == (
        "my-project-123456", "spottrain-alerts", "roles/pubsub.publisher")
    assert grant["member"].startswith("serviceAccount:service-${data.google_project.")
    assert grant["member"].endswith("@gcp-sa-monitoring-notification.iam.gserviceaccount.com")
    assert any("google_monitoring_notification_channel" in d for d in grant["depends_on"])
    assert alert_rules.note(s.spec) is None
    off = synthesized["no-alerts"]
    assert off.resources("google_monitoring_alert_policy") == [] and alert_rules.note(off.spec) is None
    assert len(off.resources("google_logging_metric")) == len(EXPECTED)  # the metrics and the dashboard stay
    assert off.one("google_monitoring_dashboard")


def test_the_dashboard_reads_only_metrics_the_stack_declares_or_the_trainer_writes(synthesized) -> None:
    for name in ("example", "watch"):
        s = synthesized[name]
        body = json.loads(s.one("google_monitoring_dashboard")["dashboard_json"].replace("$${", "${"))
        assert body == dashboard(s.spec, name)
        declared = {run_metrics.USER_PREFIX + m["name"] for m in s.resources("google_logging_metric")}
        read = metric_types(body)
        assert read <= declared | set(run_metrics.CUSTOM_METRICS), read - declared
        # Every chart the issue asks for is there, each on what it says.
        for wanted in ("steps_per_s", "loss", "eval_loss", "preemptions", "restores", "tier_failing",
                       "capacity_waits", "boots", "stalls", "failures"):
            assert run_metrics.metric_type(name, wanted) in read, wanted
        for custom in ("goodput", "cost_usd", "on_demand_cost_usd"):
            assert run_metrics.CUSTOM_PREFIX + custom in read
        tiles = body["mosaicLayout"]["tiles"]
        cells = set()
        for t in tiles:
            x0, y0 = t.get("xPos", 0), t.get("yPos", 0)  # a position of 0 is omitted (the API drops it)
            assert x0 + t["width"] <= body["mosaicLayout"]["columns"], t
            area = {(x, y) for x in range(x0, x0 + t["width"]) for y in range(y0, y0 + t["height"])}
            assert not area & cells, f"tiles overlap at {t['widget']['title']}"
            cells |= area
        assert body["displayName"] == f"spottrain {name}"


def test_the_budget_counts_the_experiments_label_and_alerts_its_channels(synthesized) -> None:
    s = synthesized["watch"]
    b = s.one("google_billing_budget")
    assert b["billing_account"] == "012345-6789AB-CDEF01" and b["display_name"] == "spottrain watch"
    # No currency unless the experiment states one: the API refuses any but the billing account's.
    assert b["amount"]["specified_amount"] == {"units": "500"}
    f = b["budget_filter"]
    assert f["labels"] == {"spottrain-experiment": "watch"} and f["calendar_period"] == "QUARTER"
    assert f["projects"][0].startswith("projects/${data.google_project.")
    assert [(r["threshold_percent"], r["spend_basis"]) for r in b["threshold_rules"]] == [
        (0.25, "CURRENT_SPEND"), (0.5, "CURRENT_SPEND"), (1, "CURRENT_SPEND"), (1, "FORECASTED_SPEND")]
    # The Budget API takes email channels only: the webhook and the Pub/Sub topic hear the alerts alone.
    channels = s.json["resource"]["google_monitoring_notification_channel"]
    named = [re.fullmatch(r"\$\{google_monitoring_notification_channel\.([^.]+)\.name\}", c)
             for c in b["all_updates_rule"]["monitoring_notification_channels"]]
    assert all(named) and sorted(channels[m.group(1)]["type"] for m in named if m) == ["email", "email"]
    # Through a provider alias that bills the API's quota to the experiment's project.
    providers = s.json["provider"]["google"]
    billing = next(p for p in providers if p.get("alias") == "billing")
    assert billing["user_project_override"] is True and billing["billing_project"] == "my-project-123456"
    assert b["provider"] == "google.billing"
    apis = {r["service"] for r in s.resources("google_project_service")}
    assert {"billingbudgets.googleapis.com", "logging.googleapis.com", "monitoring.googleapis.com",
            "pubsub.googleapis.com"} <= apis
    assert synthesized["example"].resources("google_billing_budget") == []


def test_a_stated_currency_reaches_the_budget() -> None:
    from cdktn import Testing

    from stacks.stack import TrainingStack

    exp = variant({"budget": {"billing_account": "012345-6789AB-CDEF01", "amount_usd": 300,
                              "currency_code": "EUR"}}, "eur")
    synth = json.loads(Testing.synth(TrainingStack(Testing.app(), "eur", exp)))
    (b,) = synth["resource"]["google_billing_budget"].values()
    assert b["amount"]["specified_amount"] == {"currency_code": "EUR", "units": "300"}


@pytest.mark.parametrize(("section", "values", "field"), [
    ("budget", {"billing_account": "12345-6789AB-CDEF01", "amount_usd": 100}, "budget.billing_account"),
    ("budget", {"billing_account": "012345-6789ab-cdef01", "amount_usd": 100}, "budget.billing_account"),
    ("budget", {"billing_account": "012345-6789AB-CDEF01", "amount_usd": 0}, "budget.amount_usd"),
    ("budget", {"billing_account": "012345-6789AB-CDEF01", "amount_usd": 9, "thresholds": [0.9, 0.5]},
     "budget.thresholds"),
    ("budget", {"amount_usd": 9}, "budget.billing_account"),
    ("budget", {"billing_account": "012345-6789AB-CDEF01", "amount_usd": 9, "currency_code": "usd"},
     "budget.currency_code"),
    ("alerts", {"email": ["not an address"]}, "alerts.email"),
    ("alerts", {"webhook_url": "http://hooks.example.com/x"}, "alerts.webhook_url"),
    ("alerts", {"webhook_url": "https://hooks.example.com/x'; rm -rf /"}, "alerts.webhook_url"),
    ("alerts", {"pubsub_topic": "spottrain-alerts"}, "alerts.pubsub_topic"),
    ("alerts", {"stall_minutes": 1}, "alerts.stall_minutes"),
    ("alerts", {"channel": "sms"}, "alerts.channel"),
])
def test_bad_watch_settings_are_refused_naming_the_field(section, values, field) -> None:
    with pytest.raises(ExperimentError) as err:
        parse(merged({section: values}), "example", str(EXAMPLE))
    assert any(line.startswith(f"{EXAMPLE}: {field}") for line in err.value.lines), err.value.lines


def test_the_example_declares_the_defaults() -> None:
    exp = variant({})
    assert exp.alerts == type(exp.alerts)()  # every [alerts] key of the example is the default
    assert "[alerts]" in EXAMPLE.read_text()
