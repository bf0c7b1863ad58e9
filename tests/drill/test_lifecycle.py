"""The lifecycle drill: the example's synthesized stack deployed to a fake project, trained,
preempted, finished, scaled to zero and destroyed; what is left is exactly the bucket and the key.
The example is applied `watched` (channels and a [budget] added), through the fake project's
strict stand-ins: the counting alerts wait for their metrics, the budget needs its billing account.
And the drill catches a leak: a checkpoint disk with `auto_delete = false` outside a stateful
policy (the synthesized JSON altered so) is left behind after each VM, and the drill names it."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from drill.drill import DrillConfig
from drill.drill import DrillFailure
from drill.lifecycle import BILLING_ACCOUNT, LifecycleResult, main, run_lifecycle, watched
from drill.sandbox import REPO
from drill_support import needs_root

KEY, BUCKET = "example-checkpoint-key", "my-project-123456-example-ckpt"
EXAMPLE = REPO / "experiments" / "example.toml"


def small(tmp: Path, **kw: Any) -> DrillConfig:
    # The reference run is test_drill's question (exact resume); here it would only double the time.
    base = dict(steps=60, preemptions=1, seed=3, window_s=10.0, checkpoint_every_steps=20, disk_mb=64,
                workdir=tmp, reference=False)
    return DrillConfig(**{**base, **kw})


def without_stateful_disk(stack: dict[str, Any]) -> None:
    """The template's checkpoint disk stays `auto_delete = false`; the group no longer keeps it."""
    for group in stack["resource"]["google_compute_instance_group_manager"].values():
        del group["stateful_disk"]


@pytest.fixture(scope="module")
def lifecycle(tmp_path_factory: pytest.TempPathFactory) -> tuple[LifecycleResult, str]:
    lines: list[str] = []
    tmp = tmp_path_factory.mktemp("lifecycle")
    result = run_lifecycle(small(tmp, experiment=watched(EXAMPLE, tmp)), say=lines.append)
    return result, "\n".join(lines)


@needs_root
def test_the_example_leaves_exactly_the_bucket_and_the_key(lifecycle) -> None:
    result, report = lifecycle
    assert result.ok, report
    assert result.drill.ok and len(result.drill.preemptions) == 1 and result.drill.status["latest_step"] == 60
    assert result.drill.group_sizes == [1, 0, 1, 0], report  # scaled to zero after the finish, and again
    assert [(item.kind, item.name, item.terraform) for item in result.left] == [
        ("google_secret_manager_secret", KEY, "abandoned"), ("google_storage_bucket", BUCKET, "abandoned")]
    secret, bucket = result.left
    assert secret.usd_month == pytest.approx(0.06)  # the one version the first boot added
    assert bucket.usd_month is not None and 0 < bucket.usd_month < 0.01  # a few MB of checkpoints
    assert result.destroyed.errors == [] and result.drill.refusals == []
    # The code archives went with the stack; the run's checkpoints and stop markers stayed.
    (deleted,) = result.destroyed.objects_deleted.values()
    assert sorted(n.split("-")[0] for n in deleted) == ["code/trainer", "code/wheels"]
    assert "(runs/example/)" in bucket.size and "soft-deleted by the destroy, billed 7 d" in bucket.size
    assert "lifecycle: PASS: exactly the documented bucket and key remain" in report
    assert "total $0.06/month" in report
    assert "APIs left enabled (no charge" in report and "compute.googleapis.com" in report


@needs_root
def test_the_watched_example_applies_its_alerts_and_budget_through_the_strict_stand_ins(lifecycle) -> None:
    """The first apply of a fresh project succeeds with every alert: the three counting ones 600 s
    into it (after their metrics are known), the budget with the email channel only; the destroy
    takes all of it (nothing of the watch stack is left, above)."""
    result, report = lifecycle
    assert ("watch: 8 alert policies (3 created 600 s into the apply, once their log-based metrics were known), "
            f"16 log-based metrics, channels: email, webhook_tokenauth, budget: billingAccounts/{BILLING_ACCOUNT}"
            ) in report
    assert not any(address.startswith(("google_monitoring", "google_logging", "google_billing"))
                   for address in result.destroyed.forgotten)


@needs_root
def test_a_project_owner_without_a_role_on_the_billing_account_fails_at_the_budget(tmp_path: Path) -> None:
    with pytest.raises(DrillFailure, match=f"apply: .*billing.budgets.create on billingAccounts/{BILLING_ACCOUNT}"):
        run_lifecycle(small(tmp_path, steps=30, preemptions=0, experiment=watched(EXAMPLE, tmp_path)),
                      say=lambda s: None, billing_accounts={})


def test_watched_adds_channels_and_a_budget_and_keeps_the_name(tmp_path: Path) -> None:
    from stacks.load import load_file

    w = load_file(watched(EXAMPLE, tmp_path))
    assert w.name == "example" and w.spec.budget is not None and w.spec.budget.billing_account == BILLING_ACCOUNT
    assert w.spec.budget.currency_code is None  # the account's own
    assert w.spec.alerts.email and w.spec.alerts.webhook_url
    (tmp_path / "again").mkdir()
    again = load_file(watched(tmp_path / "example.toml", tmp_path / "again"))
    assert again.spec.budget == w.spec.budget and again.spec.alerts == w.spec.alerts  # nothing added twice


@needs_root
def test_a_checkpoint_disk_outside_a_stateful_policy_is_left_behind_and_fails_the_drill(tmp_path: Path) -> None:
    lines: list[str] = []
    result = run_lifecycle(small(tmp_path, steps=30, preemptions=0), say=lines.append, alter=without_stateful_disk)
    report = "\n".join(lines)
    assert result.drill.ok, report  # the run itself went well: the leak is only in what it left
    assert not result.ok
    # One disk per VM the group deleted: the finished one, and the one booted by hand afterwards.
    disks = [item for item in result.unexpected if item.kind == "disk"]
    assert len(disks) == 2 and len(result.unexpected) == 2, report
    for d in disks:
        assert d.terraform == "nobody" and d.usd_month == pytest.approx(300 * 0.17)
        assert d.size == "300 GB pd-ssd in us-central1-a, detached"
        assert f"compute disk {d.name} (300 GB pd-ssd in us-central1-a, detached; $51.00/month), which no " \
               "Terraform state knows" in report
    assert "lifecycle: FAIL: left behind:" in report and "total $102.06/month" in report


def test_the_cli_refuses_bad_input_with_status_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--experiment", str(tmp_path / "missing.toml")]) == 2
    assert "missing.toml" in capsys.readouterr().err
    assert main(["--preemptions", "3", "--steps", "50"]) == 2
    assert "steps: 50 is too few" in capsys.readouterr().err
