"""`make chaos` (drill.chaos): the matrix's catalogue, its selection, and one real cell end to end.

The whole matrix takes minutes and runs with `make chaos` only; this is its smoke test: the
harness runs a cell against the real trainer and reports it as the table says.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from drill.chaos.faults import FAULTS, MOMENTS, NotTheTrainers
from drill.chaos.matrix import Result, cells
from drill.chaos.report import row, table
from drill.chaos.rig import REPO
from drill.small_fs import SmallFs


def test_every_fault_has_a_cell_or_a_reason_at_every_moment() -> None:
    for fault in FAULTS.values():
        assert set(fault.na) <= set(MOMENTS), fault.key
        assert all(reason.strip() for reason in fault.na.values()), fault.key
        # Only what `trainer run` never reads may have no cell at all (its reasons say who reads it).
        assert fault.moments() or isinstance(fault, NotTheTrainers), f"{fault.key} has no cell at all"
        assert set(fault.blank_pd) <= set(fault.moments()), fault.key
        assert set(fault.unfinishable) <= set(fault.moments()), fault.key
    assert len(cells()) == len(FAULTS) * len(MOMENTS)


def test_a_selection_picks_cells_by_fault_and_moment() -> None:
    assert cells("gcs-down:startup") == [("gcs-down", "startup")]
    assert cells("pd-full") == [("pd-full", m) for m in MOMENTS]
    assert cells("gcs-*:final, ssd-full:restore") == [(k, "final") for k in FAULTS if k.startswith("gcs-")] + [
        ("ssd-full", "restore")]
    assert cells("nothing-like-it") == []


def test_the_table_shows_why_a_cell_is_not_applicable_and_what_a_failed_one_broke() -> None:
    na = Result("ssd-full", "restore", na=FAULTS["ssd-full"].na["restore"])
    failed = Result("gcs-down", "emergency", stopped=13, resumed=5, exits=[("first", "killed"), ("boot 1", "0")],
                    digest_equal=True, violations=["8 step(s) lost"])
    text = table([na, failed])
    assert "| n/a | a replacement VM's local SSD is blank" in row(na)
    assert "| emergency | 5 | 8 | first killed, boot 1 0 | no | no | yes | FAIL | 8 step(s) lost |" in text


def test_an_unknown_selection_is_bad_input() -> None:
    out = subprocess.run([sys.executable, "-m", "drill.chaos", "--cells", "nope:never", "--list"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "no cell matches 'nope:never'" in out.stderr


@pytest.mark.skipif(not SmallFs.possible("ext4"), reason="the chaos matrix mounts real disks: root only")
def test_one_cell_runs_the_real_trainer_and_keeps_the_promise(tmp_path: Path) -> None:
    from drill.chaos.matrix import run_matrix

    logs: list[str] = []
    [r] = run_matrix([("gcs-burst", "emergency")], tmp_path, log=logs.append)
    assert r.verdict == "PASS", (r.violations, logs)
    assert (r.stopped, r.resumed, r.lost, r.unpickled, r.fresh_start, r.digest_equal) == (13, 13, 0, "no", False, True)
    assert [role for role, _ in r.exits] == ["first", "boot 1"] and r.exits[-1] == ("boot 1", "0")
    burst = (tmp_path / "gcs-burst-emergency" / "first.log").read_text()
    assert "injected 429 by the fault proxy" in burst and "injected 503 by the fault proxy" in burst


def test_reliability_md_shows_the_current_fault_model() -> None:
    from drill.chaos.report import embedded, fault_model

    assert embedded((REPO / "RELIABILITY.md").read_text(), "fault-model") == fault_model(), (
        "RELIABILITY.md is stale: python -m drill.chaos --fault-model (or a full run with --record)")


def test_the_harness_finds_a_copy_in_the_bucket_that_is_not_what_its_manifest_lists(gcs_proxy) -> None:
    """The check behind "no corrupt copy kept" (drill.attacker.intact), which the matrix applies to
    every step a trainer reported durable on GCS: it must see one flipped byte."""
    import json

    from drill.attacker import digest, intact, plant

    client, data = gcs_proxy.client(direct=True), bytes(range(256)) * 16
    manifest = {"files": {"tensors.bin": digest("blake3-of-16MiB-chunk-blake3s", data)}}
    plant(client, gcs_proxy.uri, "step-00000005/manifest.json", json.dumps(manifest).encode())
    plant(client, gcs_proxy.uri, "step-00000005/tensors.bin", data)
    assert intact(client, gcs_proxy.uri, 5) is None
    assert intact(client, gcs_proxy.uri, 6) is None  # not there at all: nothing to judge
    plant(client, gcs_proxy.uri, "step-00000005/tensors.bin", data[:100] + bytes([data[100] ^ 1]) + data[101:])
    assert intact(client, gcs_proxy.uri, 5) == "tensors.bin is not what its manifest lists (4096 bytes, manifest: 4096)"


def test_a_cell_may_lose_only_the_steps_its_fault_destroys() -> None:
    """A power-off, or the only copy of a step rotting, destroys steps by design: the cell allows
    those and no more, and the table says how many it allowed."""
    from drill.chaos.matrix import Result

    r = Result("nodes2-power-off", "periodic", stopped=12, resumed=10, allowed=2, digest_equal=True,
               exits=[("first", "a:killed b:1"), ("boot 1", "0")])
    assert r.too_many_lost is None
    assert "| 10 | 2 (2 allowed) | first a:killed b:1, boot 1 0 |" in row(r)
    r.resumed = 5
    assert r.too_many_lost == ("7 step(s) lost: the job had completed step 12, the next boot resumed from 5 "
                               "(2 allowed: 10 was the newest that survived the fault)")
    assert Result("gcs-down", "emergency", stopped=13, resumed=12).too_many_lost is not None


def _node(tmp_path: Path, name: str, lines: list[str], code: int):
    from drill.chaos.rig import Node
    from drill.metadata_server import MetadataServer

    node = Node(name, SmallFs(tmp_path / f"pd-{name}"), SmallFs(tmp_path / f"ssd-{name}"), MetadataServer())
    argv = [sys.executable, "-c", f"print({chr(10).join(lines)!r}); raise SystemExit({code})"]
    return node, argv


def test_a_two_node_job_reads_as_one_trainer(tmp_path: Path) -> None:
    """A boot of two nodes (drill.chaos.rig.Job) over real processes: its status is the nodes' when
    they agree and a failure when they do not; its run dir is the disk of the node that logged
    rank 0; a cell flags a boot whose rank 0 is not on the node the rig meant to lead it."""
    import threading
    from types import SimpleNamespace

    from drill.chaos.matrix import Cell
    from drill.chaos.rig import Job, Trainer

    def job(codes: tuple[int, int], leader: str) -> Job:
        cond = threading.Condition()
        started = []
        for name, rank, code in (("a", 1, codes[0]), ("b", 0, codes[1])):
            node, argv = _node(tmp_path, name, [
                f"INFO trainer event=start steps=20 world_size=2 node={name} node_rank={rank} restart=0",
                "INFO trainer event=restore step=10 tier=gcs path=b:gs://x/step-00000010 seconds=1 world_size=2",
                f"INFO trainer event=step step={10 + rank}/20 loss=1"], code)
            started.append((node, Trainer(f"boot {name}", argv, {}, tmp_path / f"{name}.log", node.run_dir,
                                          cond=cond)))
        return Job("boot 1", started, leader)

    agreed = job((75, 75), "b")
    assert agreed.wait_for(r"node=b node_rank=(\d)").group(1) == "0"
    assert agreed.finish() == 75 and agreed.exit == "75" and agreed.killed is None
    assert agreed.ranks() == {"a": 1, "b": 0} and agreed.run_dir == tmp_path / "pd-b"
    assert agreed.restored() == (10, "b:gs://x/step-00000010") and agreed.steps() == [10, 11]

    split = job((0, 1), "a")
    assert split.finish() == 1 and split.exit == "a:0 b:1"
    cell = Cell(SimpleNamespace(jobs=[agreed, split]), FAULTS["nodes2-power-off"], "periodic", "", print)
    cell.check_leaders()
    assert cell.r.violations == ["boot 1: node b got rank 0, the rig meant node a"]
    assert cell.r.notes == ["rank 0 on node: boot 1 b, boot 1 b"]


@pytest.mark.xdist_group("torchrun")
@pytest.mark.skipif(not SmallFs.possible("ext4"), reason="the chaos matrix mounts real disks: root only")
def test_the_rig_gives_rank_0_to_the_node_it_means_to_lead(tmp_path: Path, gcs_proxy) -> None:
    """Two real torchrun agents on the coordinator's store: the rendezvous ranks nodes by address,
    and the rig's addresses put rank 0 on node b although node a's agent started first."""
    from drill.chaos.rig import Rig, key_env

    with Rig(tmp_path, gcs_proxy.emulator, "lead", key_env(tmp_path), nodes=2) as rig:
        rig.lead("b")
        job = rig.start("probe", park=[2])
        try:
            assert rig.parked(job, 2, timeout=120), job.output[-3000:]
            assert job.ranks() == {"a": 1, "b": 0}
            assert job.run_dir == rig.node_list[1].run_dir
        finally:
            job.kill()


@pytest.mark.skipif(not SmallFs.possible("ext4"), reason="the chaos matrix mounts real disks: root only")
def test_the_planted_first_boot_cell_trains_beside_the_planted_checkpoints(tmp_path: Path) -> None:
    """Issue 28: checkpoints planted before a run's first boot once stopped it on every boot (exit
    2). The cell's first boot sets them aside and trains; the next boot resumes its own step."""
    from drill.chaos.matrix import run_matrix

    logs: list[str] = []
    [r] = run_matrix([("planted-first-boot", "startup")], tmp_path, log=logs.append)
    assert r.verdict == "PASS", (r.violations, logs)
    assert (r.stopped, r.resumed, r.lost, r.unpickled, r.fresh_start, r.digest_equal) == (13, 13, 0, "no", False, True)
    assert "first set aside steps 15,16 (saved before: no)" in r.notes, r.notes
    assert [role for role, _ in r.exits] == ["first", "boot 1"] and r.exits == [("first", "75"), ("boot 1", "0")]
