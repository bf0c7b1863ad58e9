"""The fake project's inventory on the example's synthesized stack: disks go the way Compute Engine
takes them (stateful, delete rule, auto_delete), and the destroy leaves what the provider leaves."""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from drill.fake_project import FakeProject, ProjectError

GROUP = "example-group"


@pytest.fixture(scope="module")
def stack() -> dict[str, Any]:
    from stacks.stack import synthesized
    from stacks.load import load_file

    ef = load_file(Path(__file__).resolve().parents[2] / "experiments" / "example.toml")
    return synthesized(ef.name, ef.spec)


def applied(stack: dict[str, Any], tmp_path: Path, change: Any = None) -> FakeProject:
    s = copy.deepcopy(stack)
    if change is not None:
        change(s["resource"]["google_compute_instance_group_manager"])
    files = {}
    for o in s["resource"]["google_storage_bucket_object"].values():
        files[o["name"]] = tmp_path / o["name"].replace("/", "_")
        files[o["name"]].write_bytes(b"archive")
    project = FakeProject("my-project-123456")
    project.apply(s, files)
    return project


def disks(p: FakeProject) -> dict[str, str | None]:
    return {t.name: t.attached_to for t in p.things.values() if t.kind == "disk"}


def test_a_stateful_disk_survives_repair_and_goes_when_the_group_scales_to_zero(stack, tmp_path) -> None:
    with applied(stack, tmp_path) as p:
        p.instance_up(GROUP, "vm")
        (boot, ckpt) = sorted(disks(p), key=lambda n: "checkpoints" in n)
        p.instance_down(GROUP, "vm", target_size=1)  # preempted: the group recreates it
        assert disks(p) == {ckpt: None}
        p.instance_up(GROUP, "vm")
        assert disks(p)[ckpt] == "vm" and len(disks(p)) == 2  # the same disk, reattached; a new boot disk
        p.instance_down(GROUP, "vm", target_size=0)  # finished: deleted for good
        assert disks(p) == {}
        p.destroy()
        left, apis = p.left()
        assert [(x.kind, x.terraform, x.promised) for x in left] == [
            ("google_secret_manager_secret", "abandoned", True), ("google_storage_bucket", "abandoned", True)]
        assert len(apis) == len(stack["resource"]["google_project_service"])
        assert p.objects() == {} and p.soft_deleted_bytes == 2 * len(b"archive")


def test_a_stateful_disk_whose_rule_is_never_is_left_behind_with_its_cost(stack, tmp_path) -> None:
    def never(groups: dict[str, Any]) -> None:
        for g in groups.values():
            g["stateful_disk"][0]["delete_rule"] = "NEVER"

    with applied(stack, tmp_path, never) as p:
        p.instance_up(GROUP, "vm")
        p.instance_down(GROUP, "vm", target_size=1)
        p.instance_up(GROUP, "vm")
        p.resize(GROUP, 0)  # the group scaled in while the VM ran: deleted for good
        p.destroy()
        (disk,) = [x for x in p.left()[0] if x.kind == "disk"]
        assert disk.terraform == "nobody" and not disk.promised
        assert disk.size == "300 GB pd-ssd in us-central1-a, detached" and disk.usd_month == pytest.approx(51.0)


def test_a_deleted_group_takes_its_running_vms_and_their_stateful_disks(stack, tmp_path) -> None:
    with applied(stack, tmp_path) as p:
        p.instance_up(GROUP, "vm")  # never scaled to zero: the destroy deletes the group under it
        p.destroy()
        assert disks(p) == {} and not [t for t in p.things.values() if t.kind == "instance"]


def test_apply_refuses_an_archive_the_stack_does_not_declare(stack, tmp_path) -> None:
    s = json.loads(json.dumps(stack))
    stray = tmp_path / "stray"
    stray.write_bytes(b"x")
    with FakeProject("my-project-123456") as p, pytest.raises(ProjectError, match="the drill ships code/other"):
        p.apply(s, {"code/other-0123.tar.gz": stray})


def test_a_plan_after_the_apply_changes_nothing_and_the_dashboard_reads_back_as_written(stack, tmp_path) -> None:
    """Monitoring answers a dashboard without its default values (a tile at xPos 0): a stack that
    writes them shows the dashboard changed at every `make diff`."""
    with applied(stack, tmp_path) as p:
        assert p.plan(stack) == []
        (address,) = [f"google_monitoring_dashboard.{k}" for k in stack["resource"]["google_monitoring_dashboard"]]
        zeros = copy.deepcopy(stack)
        (d,) = zeros["resource"]["google_monitoring_dashboard"].values()
        body = json.loads(d["dashboard_json"])
        body["mosaicLayout"]["tiles"][0]["xPos"] = 0
        d["dashboard_json"] = json.dumps(body)
        assert p.plan(zeros) == [address]


@pytest.fixture(scope="module")
def budgeted() -> dict[str, Any]:
    """The example with a budget and every kind of alert channel (what the stack hands the budget)."""
    import tempfile

    from stacks.stack import synthesized
    from stacks.load import load_file

    text = (Path(__file__).resolve().parents[2] / "experiments" / "example.toml").read_text()
    text = text.replace("[alerts]\n", '[alerts]\nemail = ["oncall@example.com"]\n'
                        'webhook_url = "https://hooks.example.com/x?token=t"\n', 1)
    text += '\n[budget]\nbilling_account = "012345-6789AB-CDEF01"\namount_usd = 100\n'
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "example.toml"
        f.write_text(text)
        ef = load_file(f)
        return synthesized(ef.name, ef.spec)


def _apply_budget(stack: dict[str, Any], tmp_path: Path, accounts: dict[str, str]) -> None:
    s = copy.deepcopy(stack)
    files = {}
    for o in s["resource"]["google_storage_bucket_object"].values():
        files[o["name"]] = tmp_path / o["name"].replace("/", "_")
        files[o["name"]].write_bytes(b"archive")
    with FakeProject("my-project-123456", billing_accounts=accounts) as p:
        p.apply(s, files)


def test_the_budget_is_refused_as_the_budget_api_refuses_it(budgeted, tmp_path) -> None:
    account = "012345-6789AB-CDEF01"
    # A project Owner alone holds nothing on the billing account.
    with pytest.raises(ProjectError, match=f"billing.budgets.create on billingAccounts/{account}"):
        _apply_budget(budgeted, tmp_path, {})
    # The stack's budget: email channels only, the account's currency left to the account.
    _apply_budget(budgeted, tmp_path, {account: "EUR"})
    webhook = copy.deepcopy(budgeted)
    (b,) = webhook["resource"]["google_billing_budget"].values()
    (key,) = [k for k, c in webhook["resource"]["google_monitoring_notification_channel"].items()
              if c["type"] == "webhook_tokenauth"]
    b["all_updates_rule"]["monitoring_notification_channels"].append(f"${{google_monitoring_notification_channel.{key}.name}}")
    with pytest.raises(ProjectError, match="is webhook_tokenauth; budgets take email channels only"):
        _apply_budget(webhook, tmp_path, {account: "EUR"})
    usd = copy.deepcopy(budgeted)
    (b,) = usd["resource"]["google_billing_budget"].values()
    b["amount"]["specified_amount"]["currency_code"] = "USD"
    with pytest.raises(ProjectError, match="currency_code USD does not match the billing account's currency EUR"):
        _apply_budget(usd, tmp_path, {account: "EUR"})


def _policies_without(stack: dict[str, Any], change: Any) -> dict[str, Any]:
    s = copy.deepcopy(stack)
    change(s["resource"])
    return s


def _no_wait(resources: dict[str, Any]) -> None:
    """The stack as it was: the counting policies created as soon as their metrics are."""
    for metric in resources["google_logging_metric"].values():
        metric.pop("provisioner", None)


def _short_wait(resources: dict[str, Any]) -> None:
    for metric in resources["google_logging_metric"].values():
        if "provisioner" in metric:
            metric["provisioner"] = [{"local-exec": {"command": "sleep 30"}}]


def test_the_first_apply_of_a_fresh_project_creates_the_counting_alerts_after_their_metrics_are_known(
        stack, tmp_path) -> None:
    """Monitoring refuses an alert policy naming a log-based metric created less than 10 minutes
    before (404 "Cannot find metric(s)"; hashicorp/terraform-provider-google#11102): each counted
    metric's provisioner sleeps 600 s once it exists, and the threshold policies that name it wait
    for that; the log-match policies need no metric and do not wait."""
    with applied(stack, tmp_path) as p:
        resources = stack["resource"]
        waits = {f"google_logging_metric.{k}" for k, m in resources["google_logging_metric"].items()
                 if m.get("provisioner") == [{"local-exec": {"command": "sleep 600"}}]}
        counted = {f"google_logging_metric.{k}" for k in resources["google_logging_metric"]
                   if any(n in k for n in ("-boots_", "-preemptions_", "-capacity_waits_"))}
        assert waits == counted and len(counted) == 3
        known = max(p.created[m] for m in counted) + 600
        for key, policy in resources["google_monitoring_alert_policy"].items():
            (condition,) = policy["conditions"]
            at = p.created[f"google_monitoring_alert_policy.{key}"]
            assert (at >= known) == ("condition_threshold" in condition), key
        assert p.plan(stack) == []  # and the next apply has nothing to create, nor to wait for


@pytest.mark.parametrize("change", [_no_wait, _short_wait], ids=["no-wait", "a-30-s-wait"])
def test_an_alert_policy_on_a_metric_created_moments_before_is_refused_with_monitorings_404(
        stack, tmp_path, change) -> None:
    with pytest.raises(ProjectError, match=r'Error 404: Cannot find metric\(s\) that match type = '
                                           r'"logging.googleapis.com/user/spottrain/example/(boots|preemptions|'
                                           r'capacity_waits)"'):
        applied(_policies_without(stack, change), tmp_path)


def test_a_policy_on_a_metric_nobody_declared_is_refused_and_one_the_project_holds_is_not(stack, tmp_path) -> None:
    """A metric the project already holds (an earlier apply, more than 10 minutes ago) is known: a
    policy added later on it needs no wait; one naming a metric that exists nowhere never passes."""
    s = _policies_without(stack, _no_wait)
    only_metrics = copy.deepcopy(s)
    del only_metrics["resource"]["google_monitoring_alert_policy"]
    with applied(only_metrics, tmp_path) as p:
        p.clock += 600  # ten minutes later
        p.gcs.stop()
        p.apply(s, {o["name"]: tmp_path / o["name"].replace("/", "_")
                    for o in s["resource"]["google_storage_bucket_object"].values()})
        assert "google_monitoring_alert_policy" in {a.split(".")[0] for a in p.state}
    ghost = copy.deepcopy(stack)
    (policy, *_) = [p for p in ghost["resource"]["google_monitoring_alert_policy"].values()
                    if "condition_threshold" in p["conditions"][0]]
    policy["conditions"][0]["condition_threshold"]["filter"] = \
        'metric.type="logging.googleapis.com/user/spottrain/example/nothing" AND resource.type="gce_instance"'
    with pytest.raises(ProjectError, match='match type = "logging.googleapis.com/user/spottrain/example/nothing"'):
        applied(ghost, tmp_path)
