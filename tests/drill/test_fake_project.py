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
    from drill.iam import synthesize
    from stacks.load import load_file

    ef = load_file(Path(__file__).resolve().parents[2] / "experiments" / "example.toml")
    return synthesize(ef.name, ef.spec)


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
