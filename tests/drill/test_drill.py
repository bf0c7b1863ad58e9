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
        assert p.save_s is not None and p.no_save is None, "\n".join(lines)  # the trainer's measured time
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
    # Every session outlived its VM: the VMs shipped their logs, and `trainer logs` reads them back
    # in order, each with how it ended (the fourth boot, after the finish, started no trainer).
    logs = "\n".join(result.logs)
    assert "4 boot(s) of 1 VM(s), 3 trainer session(s)" in logs, logs
    assert logs.count("ended: preempted: emergency save of step") == 2 and "ended: finished at step 120" in logs


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
    # No cached reference (`reference_cache`): this test reads the reference VM's own journal.
    cfg = DrillConfig(experiment=TWO_GPUS, steps=60, preemptions=1, seed=1, window_s=15.0,
                      checkpoint_every_steps=20, disk_mb=64, workdir=tmp_path / "drill", reference_cache=None)
    result = run_drill(cfg, say=lines.append)
    assert result.reference_digest is not None and result.ok, "\n".join(lines)
    (p,) = result.preemptions
    assert p.trainer_exit == EXIT_PREEMPTED, "\n".join(lines)
    assert p.saved_step is not None and p.next_resumed_from == p.saved_step
    for run in ("reference", "drill"):
        journal = (tmp_path / "drill" / run / "vm" / "journal.log").read_text()
        starts = [line for line in journal.splitlines() if "event=start " in line]
        assert starts and all("world_size=2" in line for line in starts), starts
    # Multi-rank: the VM trains the model of hundreds of tensors (drill.drill.many_tensors), so
    # that the restore between its ranks is one of a real shape.
    vm_config = tmp_path / "drill" / "reference" / "vm" / "upper" / "etc" / "spottrain" / "trainer.toml"
    assert "task_args = {n_embd = 16, n_layer = 16}" in vm_config.read_text()
    assert result.status["latest_step"] == cfg.steps


OWN_LOOP = Path(__file__).resolve().parents[2] / "drill" / "experiments" / "own-loop.toml"


@needs_root
def test_drill_an_own_loop_script_resumes_exactly(tmp_path: Path) -> None:
    """`trainer.script`: the VM runs `python -m trainer run`, which runs pytorch/examples' MNIST-style
    script (examples/own_loop/train.py) from the shipped code directory with its own loop; a
    preemption is an emergency save of the step it finished, and the final model equals an
    uninterrupted run's. (Its net saves about 14 MiB a step: the drill's default disk, not a smaller one.)"""
    lines: list[str] = []
    cfg = DrillConfig(experiment=OWN_LOOP, steps=60, preemptions=1, seed=2, window_s=15.0,
                      checkpoint_every_steps=10, disk_mb=128, workdir=tmp_path / "drill")
    result = run_drill(cfg, say=lines.append)
    assert result.reference_digest is not None and result.ok, "\n".join(lines)
    (p,) = result.preemptions
    assert p.trainer_exit == EXIT_PREEMPTED, "\n".join(lines)
    assert p.saved_step is not None and p.next_resumed_from == p.saved_step and p.steps_lost == 0
    for run in ("reference", "drill"):
        journal = (tmp_path / "drill" / run / "vm" / "journal.log").read_text()
        starts = [line for line in journal.splitlines() if "event=start " in line]
        assert starts and all("script=train.py" in line for line in starts), starts
    assert result.status["latest_step"] == cfg.steps
    assert result.status["goodput"]["finished"] is True
    assert result.group_sizes[:2] == [1, 0], "\n".join(lines)  # a finished script stops paying too


def test_multi_rank_experiments_train_a_model_of_hundreds_of_tensors() -> None:
    from drill.drill import many_tensors
    from stacks.experiment import Pool
    from stacks.load import load_file

    two = many_tensors(load_file(TWO_GPUS).spec)
    assert two.trainer.config["task_args"] == {"n_layer": 16, "n_embd": 16}
    assert two.trainer.config["batch_size"] == 8  # the rest of the experiment's settings kept
    example = load_file(Path(__file__).resolve().parents[2] / "experiments" / "example.toml").spec
    assert many_tensors(example) == example  # one VM, one GPU: as written
    pooled = example.model_copy(update={"pool": Pool.model_validate({"min_nodes": 1, "max_nodes": 2})})
    assert many_tensors(pooled).trainer.config["task_args"]["n_layer"] == 16
    sized = pooled.model_copy(update={"trainer": pooled.trainer.model_copy(
        update={"config": {"task_args": {"n_layer": 3}}})})
    assert many_tensors(sized) == sized  # the experiment chose its model's size


def test_the_report_explains_a_short_runs_low_goodput() -> None:
    from drill.drill import DrillResult, report

    g = {"goodput": 0.22, "wall_s": 100.0, "sessions": 3, "preemptions": 2, "crashes": 0, "finished": True,
         "productive_s": 22.0, "startup_s": 30.0, "restore_s": 6.0, "downtime_s": 40.0}
    text = report(DrillResult(DrillConfig(), "d", "d", {"goodput": g}))
    assert "goodput 22.0% of 100.0 s wall over 3 session(s)" in text
    assert ("(why so low: this run trains for only 22.0 s, while each of its 3 VM boots pays about 12.0 s of "
            "trainer start-up and restore, plus 40.0 s without a trainer in all") in text


def test_the_table_shows_the_emergency_save_the_real_trainer_measured(tmp_path: Path) -> None:
    """The drill reads each round's save time from the trainer's own event=preempted line: a real
    trainer is preempted (SIGTERM) and its log goes through the drill's parser into the table."""
    import signal

    from drill.drill import DrillResult, Preemption, emergency_save, report
    from tests.trainer.support import GATE_TASK, gated, open_gate_on_notice, start, write_config

    gate = tmp_path / "gate"  # held at step 8 only if this test reads the log late
    p = start(tmp_path / "run", 40, write_config(tmp_path), "--checkpoint-every-steps", "10", "--task", GATE_TASK,
              env=gated(gate, 8))
    p.wait_for(r"event=step step=3/")
    p.signal(signal.SIGTERM)
    open_gate_on_notice(p, gate)
    assert p.wait() == EXIT_PREEMPTED, p.output[-3000:]
    logged = p.seen(r"event=preempted step=(\d+) .*\bseconds=([\d.]+)")
    round_ = Preemption(index=1, boot=1, trainer_exit=EXIT_PREEMPTED)
    emergency_save(round_, p.output)
    assert round_.saved_step == int(logged.group(1))
    assert round_.save_s == float(logged.group(2)) and round_.persistent_ok is True
    row = next(line for line in report(DrillResult(DrillConfig(), "d", "d", {}, [round_])).splitlines()
               if line.startswith("| 1 |"))
    assert row.split(" | ")[4] == f"{float(logged.group(2)):.2f}", row


@pytest.mark.parametrize(("journal", "cell"), [
    ("event=preempted step=20 detail=notice during start-up; checkpoint 20 is already durable",
     "none: notice during start-up"),
    ("event=preempted step=none detail=stopped while waiting for gcs; nothing was trained, nothing to save",
     "none: stopped while waiting for gcs"),
    ("event=step step=7/40 loss=1.0", "none logged (trainer exit -9)"),
])
def test_a_round_without_an_emergency_save_says_why(journal: str, cell: str) -> None:
    from drill.drill import DrillResult, Preemption, emergency_save, report

    round_ = Preemption(index=1, boot=1, trainer_exit=-9)
    emergency_save(round_, journal)
    assert round_.save_s is None
    row = next(line for line in report(DrillResult(DrillConfig(), "d", "d", {}, [round_])).splitlines()
               if line.startswith("| 1 |"))
    assert row.split(" | ")[4] == cell, row


PROBE_TASK = '''\
import spottrain_drill_probe  # the requirement of this code_dir: the host's venv does not have it

from trainer.tasks.gpt import build as gpt


def build(ctx, **task_args):
    assert spottrain_drill_probe.ANSWER == 42
    return gpt(ctx, **task_args)
'''


@needs_root
def test_the_drill_installs_the_code_dirs_locked_requirements_as_a_deploy_does(tmp_path: Path, monkeypatch) -> None:
    """A code_dir whose requirements.txt names a package the host's venv lacks: the drill's VM
    gets what a deploy ships (the trainer, the code and the locked wheels, installed offline by the
    startup script), so the task imports it. The trainer's own wheels are the committed lock's
    real ones; the probe package comes from a local index."""
    import importlib.util
    import os

    from stacks.lock import lock, this_python
    from stacks.load import load_file
    from stacks.wheels import CACHE_ENV, INDEX_ENV, build_wheel, for_python, lock_path, locked_wheels, read_lock, wheel_set

    assert importlib.util.find_spec("spottrain_drill_probe") is None
    repo = Path(__file__).resolve().parents[2]
    index = tmp_path / "index"
    index.mkdir()
    trainer_lock = read_lock(repo / "locks" / f"py{this_python()}-glibc2.35.lock")
    for wheel in locked_wheels(trainer_lock).glob("*.whl"):
        os.link(wheel, index / wheel.name)
    build_wheel(index, "spottrain-drill-probe", "1.0", files={"spottrain_drill_probe/__init__.py": "ANSWER = 42\n"})
    code = tmp_path / "code"
    code.mkdir()
    (code / "probetask.py").write_text(PROBE_TASK)
    (code / "requirements.txt").write_text("spottrain-drill-probe\n")
    exp = tmp_path / "probe.toml"
    exp.write_text((repo / "experiments" / "example.toml").read_text()
                   .replace('task = "trainer.tasks.gpt:build"', f'code_dir = "{code}"\ntask = "probetask:build"')
                   + "\n[trainer.config]\nthreads = 1\n[trainer.config.task_args]\nn_layer = 1\nn_embd = 32\n"
                   "block_size = 32\nstride = 32\n")
    monkeypatch.setenv(INDEX_ENV, str(index))
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    # `make lock EXPERIMENT=...`: the drill's lock, for the Python its VM stand-in runs.
    spec = for_python(load_file(exp).spec, this_python())
    ws = wheel_set(spec, code)
    made = lock(ws, lock_path(ws, code), index=str(index))
    assert made.path == code / f"requirements.py{this_python()}-glibc2.35.lock"
    assert "spottrain-drill-probe" in read_lock(made.path).versions()

    # One VM, as `make drill` boots it (the reference run of a drill), trained to the end.
    from drill.drill import Deployment, render
    from drill.net import free_port

    cfg = DrillConfig(experiment=exp, steps=30, preemptions=0, checkpoint_every_steps=10, disk_mb=64)
    rendered = render(cfg, free_port(), trainer_source=repo / "trainer", code_dir=tmp_path / "archives")
    assert any(name.startswith("code/wheels-") for name, _ in rendered.uploads)
    with Deployment(tmp_path / "vm", rendered, cfg, lambda line: None, repo) as dep:
        dep.run_to_end()  # DrillFailure (with the journal) if the task cannot import its requirement
        journal = dep.vm.journal()
    assert "wheels, offline)" in journal  # the startup script installed them, as on a VM
    assert f"event=step step={cfg.steps}/{cfg.steps}" in journal


def test_a_reference_is_run_once_for_its_key_and_only_a_clean_one_is_kept(tmp_path: Path) -> None:
    from drill.drill import cached_reference

    runs: list[str] = []

    def run(digest: str | None, refusals: list | None = None):
        def go():
            runs.append(digest or "none")
            return {"status": {"model_digest": digest, "latest_step": 3}, "refusals": refusals or [],
                    "control_runs": [0]}
        return go

    assert cached_reference(tmp_path, "k1", run("d1")) == (True, {"status": {"model_digest": "d1", "latest_step": 3},
                                                                   "refusals": [], "control_runs": [0]})
    ran, got = cached_reference(tmp_path, "k1", run("other"))
    assert not ran and got["status"]["model_digest"] == "d1" and runs == ["d1"]
    # A reference that failed (no digest) or met a refusal is not kept: the next drill runs it again.
    assert cached_reference(tmp_path, "k2", run(None))[0] and cached_reference(tmp_path, "k2", run(None))[0]
    assert cached_reference(tmp_path, "k3", run("d3", [["sa", "perm", "res"]]))[0]
    assert cached_reference(tmp_path, "k3", run("d3"))[0]
    assert runs == ["d1", "none", "none", "d3", "d3"]
