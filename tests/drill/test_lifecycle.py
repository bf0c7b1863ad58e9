"""The lifecycle drill: the example's synthesized stack deployed to a fake project, trained,
preempted, finished, scaled to zero and destroyed; what is left is exactly the bucket and the key.
And the drill catches a leak: a checkpoint disk with `auto_delete = false` outside a stateful
policy (the synthesized JSON altered so) is left behind after each VM, and the drill names it."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from drill.drill import DrillConfig
from drill.lifecycle import LifecycleResult, main, run_lifecycle
from drill_support import needs_root

KEY, BUCKET = "example-checkpoint-key", "my-project-123456-example-ckpt"


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
    result = run_lifecycle(small(tmp_path_factory.mktemp("lifecycle")), say=lines.append)
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
