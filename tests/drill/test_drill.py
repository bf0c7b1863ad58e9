"""The preemption drill end to end: real scripts, real trainer, two preemptions, one wiped disk."""
from __future__ import annotations

from pathlib import Path

import pytest

from drill.__main__ import main as drill_main
from drill.drill import EXIT_PREEMPTED, DrillConfig, run_drill
from drill_support import needs_root


@needs_root
def test_drill_two_preemptions_one_wiped_disk(tmp_path: Path) -> None:
    lines: list[str] = []
    cfg = DrillConfig(steps=120, preemptions=2, wipe_disk_after=(1,), seed=3, window_s=10.0,
                      checkpoint_every_steps=25, disk_mb=64, workdir=tmp_path / "drill")
    result = run_drill(cfg, say=lines.append)

    assert result.reference_digest is not None
    assert result.digest == result.reference_digest, "\n".join(lines)
    assert result.ok
    assert [p.index for p in result.preemptions] == [1, 2]
    for p in result.preemptions:
        assert p.trainer_exit == EXIT_PREEMPTED, "\n".join(lines)   # saved, then stopped
        assert p.saved_step is not None and p.resumed_from is not None
        assert p.resumed_from < p.saved_step < cfg.steps
        assert p.next_resumed_from == p.saved_step                  # nothing lost
        assert p.steps_lost == 0
    # The first VM's disk was wiped: the second restored from the durable tier.
    assert result.preemptions[0].wiped_after
    assert result.preemptions[1].resumed_tier == "gcs"
    g = result.status["goodput"]
    assert g["finished"] is True and g["sessions"] == 3
    # Every VM's trainer got the experiment's prices from the rendered scripts (stacks.pricing).
    c = g["cost"]
    assert (c["priced_sessions"], c["unpriced_sessions"]) == (3, 0)
    assert c["cost_so_far"] > 0 and c["on_demand_equivalent"] > 0 and c["savings"] is not None
    assert result.status["latest_step"] == cfg.steps
    # The finished VM stopped paying by itself: it started the experiment's control job, which
    # scaled its group to zero through the (fake) Compute API; a manual resize to 1 later brings a
    # VM that does not train and stops again. Every call of the VMs and of the job was within the
    # grants of the experiment's synthesized stack (the fakes refuse the rest, as Google does).
    assert result.group_sizes == [1, 0, 1, 0], "\n".join(lines)
    assert result.after_finish["group_size"] == 0
    assert result.refusals == [] and len(result.control_runs) >= 2 and not any(result.control_runs)
    assert "IAM: every call within the synthesized stack's grants" in "\n".join(lines)
    # A finished run does not train again on the next boot, and says so.
    assert result.after_finish["startup_rc"] == 0
    assert result.after_finish["unit_started"] is False
    report = "\n".join(lines)
    assert "digest MATCHES" in report and "| 2 |" in report and "goodput" in report


def test_cli_rejects_a_wipe_round_beyond_the_preemptions(capsys: pytest.CaptureFixture[str]) -> None:
    assert drill_main(["--preemptions", "1", "--wipe-disk-round", "2"]) == 2
    assert "wipe_disk_after" in capsys.readouterr().err


def test_cli_rejects_too_few_steps_for_the_preemptions(capsys: pytest.CaptureFixture[str]) -> None:
    assert drill_main(["--preemptions", "3", "--steps", "50"]) == 2
    assert "steps: 50 is too few" in capsys.readouterr().err


def test_cli_names_the_file_and_field_of_a_bad_experiment(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text((Path(__file__).resolve().parents[2] / "experiments" / "example.toml").read_text()
                   .replace("steps = 20000", "steps = -1"))
    assert drill_main(["--experiment", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "bad.toml" in err and "trainer.steps" in err
    assert drill_main(["--experiment", str(tmp_path / "missing.toml")]) == 2
    assert "missing.toml" in capsys.readouterr().err


TWO_GPUS = Path(__file__).resolve().parents[2] / "drill" / "experiments" / "two-gpus.toml"


@needs_root
def test_drill_a_two_gpu_vm_runs_two_ranks_and_resumes_exactly(tmp_path: Path) -> None:
    """gpu_count = 2: the VM runs torchrun with two trainer processes (gloo on CPU here). A
    preemption reaches both ranks, the unit exits 75 (not torchrun's 1), and the final model
    equals an uninterrupted run of the same world size."""
    lines: list[str] = []
    cfg = DrillConfig(experiment=TWO_GPUS, steps=60, preemptions=1, seed=1, window_s=15.0,
                      checkpoint_every_steps=20, disk_mb=64, workdir=tmp_path / "drill")
    result = run_drill(cfg, say=lines.append)
    assert result.reference_digest is not None and result.ok, "\n".join(lines)
    (p,) = result.preemptions
    assert p.trainer_exit == EXIT_PREEMPTED, "\n".join(lines)
    assert p.saved_step is not None and p.next_resumed_from == p.saved_step
    for run in ("reference", "drill"):
        journal = (tmp_path / "drill" / run / "vm" / "journal.log").read_text()
        starts = [line for line in journal.splitlines() if "event=start " in line]
        assert starts and all("world_size=2" in line for line in starts), starts
    assert result.status["latest_step"] == cfg.steps


def test_the_report_explains_a_short_runs_low_goodput() -> None:
    from drill.drill import DrillResult, report

    g = {"goodput": 0.22, "wall_s": 100.0, "sessions": 3, "preemptions": 2, "crashes": 0, "finished": True,
         "productive_s": 22.0, "startup_s": 30.0, "restore_s": 6.0, "downtime_s": 40.0}
    text = report(DrillResult(DrillConfig(), "d", "d", {"goodput": g}))
    assert "goodput 22.0% of 100.0 s wall over 3 session(s)" in text
    assert ("(why so low: this run trains for only 22.0 s, while each of its 3 VM boots pays about 12.0 s of "
            "trainer start-up and restore, plus 40.0 s without a trainer in all") in text
