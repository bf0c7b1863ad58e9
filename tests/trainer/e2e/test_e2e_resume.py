"""Exact resume across real SIGTERM preemptions and SIGKILL crashes (`python -m trainer run`).

Random points are chosen with a seeded RNG and reached by reading the trainer's own log lines
(synchronisation, not sleeping). The final `model_digest` must equal an uninterrupted run's.
"""
from __future__ import annotations

import os
import random
import signal
from pathlib import Path
from typing import Any

import pytest

from trainer.config import StatusConfig
from trainer.status import main as status_main
from tests.trainer.support import REFERENCE_STEPS as STEPS
from tests.trainer.support import (GATE_TASK, Proc, Zygote, gated, open_gate_on_notice, run_args, run_to_end, start,
                                   status, trainer_env, write_config)
from tests.trainer.support import start as start_process


def _config(tmp_path: Path, extra: str = "") -> Path:
    """The test config with the gate task: the plain task's weights, and a loader a test can hold."""
    return write_config(tmp_path, f'task = "{GATE_TASK}"\n' + extra)


def _sigterm_at(run_dir: Path, config: Path, step: int, *extra: str) -> int:
    """Start afresh, SIGTERM once step `step` is logged, expect exit 75; return the saved step. (The
    loader's gate, 5 steps on, only holds a run the test reads late.)"""
    gate = run_dir.parent / f"gate-{run_dir.name}"
    p = start(run_dir, STEPS, config, *extra, env=gated(gate, step + 5))
    p.wait_for(rf"event=step step={step}/")
    p.signal(signal.SIGTERM)
    open_gate_on_notice(p, gate)
    rc = p.wait()
    assert rc == 75, p.output[-3000:]
    saved = int(p.wait_for(r"event=preempted step=(\d+) persistent_ok=1").group(1))
    _assert_at_most_the_step_in_flight(p, signalled_after=step, saved=saved)
    return saved


def _assert_at_most_the_step_in_flight(p: Proc, *, signalled_after: int, saved: int) -> None:
    """The save is at the step the loop had completed when the signal arrived, or the next one.
    (The test may read the log late on a busy machine, so that step can be past `signalled_after`.)"""
    notice = int(p.seen(r"event=preemption_notice reason=SIGTERM completed_step=(\d+)").group(1))
    assert notice >= signalled_after, p.output[-3000:]
    assert notice <= saved <= notice + 1, p.output[-3000:]


def test_sigterm_several_times_resumes_exactly(tmp_path: Path, reference: dict) -> None:
    config, run_dir, gate = _config(tmp_path), tmp_path / "run", tmp_path / "gate"
    rng = random.Random(20261122)
    saved = 0
    for _ in range(3):
        at = rng.randint(saved + 2, saved + 10)
        p = start(run_dir, STEPS, config, "--checkpoint-every-steps", "10", env=gated(gate, at + 5 - saved))
        assert int(p.wait_for(r"event=restore step=(\d+)").group(1)) == saved
        p.wait_for(rf"event=step step={at}/")
        p.signal(signal.SIGTERM)
        open_gate_on_notice(p, gate)
        assert p.wait() == 75, p.output[-3000:]
        saved = int(p.seen(r"event=preempted step=(\d+) persistent_ok=1").group(1))
        _assert_at_most_the_step_in_flight(p, signalled_after=at, saved=saved)
    run_to_end(run_dir, STEPS, config, "--checkpoint-every-steps", "10")
    s = status(run_dir, cli=True)
    assert s["latest_step"] == STEPS
    assert s["model_digest"] == reference["model_digest"]
    g = s["goodput"]
    assert g["preemptions"] == 3 and g["finished"] and g["sessions"] == 4 and g["crashes"] == 0
    assert 0 < g["goodput"] < 1 and g["lost_s"] == 0
    assert g["productive_s"] > 0 and g["restore_s"] > 0 and g["checkpoint_blocked_s"] > 0


def test_resume_with_other_checkpoint_interval_and_second_signal(tmp_path: Path, reference: dict) -> None:
    config, run_dir, gate = _config(tmp_path), tmp_path / "run", tmp_path / "gate"
    local = ("--local-dir", str(tmp_path / "local"))  # the fast tier joins for the later sessions
    first = _sigterm_at(run_dir, config, 9, "--checkpoint-every-steps", "3")
    # A second SIGTERM (and a SIGINT) right behind the first must not abort the save.
    p = start(run_dir, STEPS, config, "--checkpoint-every-steps", "7", *local, env=gated(gate, 21 + 5 - first))
    p.wait_for(r"event=step step=21/")
    for sig in (signal.SIGTERM, signal.SIGTERM, signal.SIGINT):
        p.signal(sig)
    open_gate_on_notice(p, gate)
    assert p.wait() == 75, p.output[-3000:]
    saved = int(p.seen(r"event=preempted step=(\d+) persistent_ok=1").group(1))
    assert p.seen(r"checkpoint step 14 durable on local")
    p = run_to_end(run_dir, STEPS, config, "--checkpoint-every-seconds", "0.2", *local)
    assert int(p.seen(r"event=restore step=(\d+)").group(1)) == saved
    s = status(run_dir, "--local-dir", str(tmp_path / "local"))
    assert s["model_digest"] == reference["model_digest"]


def test_finished_run_exits_at_once_and_mismatch_is_refused(tmp_path: Path, reference: dict,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    config, run_dir, gate = _config(tmp_path), tmp_path / "run", tmp_path / "gate"
    _sigterm_at(run_dir, config, 5)
    p = start(run_dir, STEPS, config, "--seed", "7")
    assert p.wait() == 2
    assert "seed: checkpoint has 0, this run has 7" in p.output
    assert "Traceback" not in p.output
    p = start(run_dir, STEPS, config, env=gated(gate, 0))  # held before its first step
    p.wait_for(r"event=restore step=")
    p.signal(signal.SIGTERM)  # a notice during start-up: the restored checkpoint is already durable
    open_gate_on_notice(p, gate)
    assert p.wait() == 75, p.output[-3000:]
    run_to_end(run_dir, STEPS, config)
    p = run_to_end(run_dir, STEPS, config)
    p.wait_for(r"event=finished step=40 \(already complete\)")
    assert "event=step " not in p.output
    assert status(run_dir)["model_digest"] == reference["model_digest"]
    assert status_main(StatusConfig(run_dir=run_dir)) == 0
    human = capsys.readouterr().out
    assert "newest valid checkpoint: step 40 on persistent" in human
    assert f"model digest: {reference['model_digest']}" in human
    assert "preemptions 2, crashes 0, failures 1, finished yes" in human


def _kill_run(tmp_path: Path, reference: dict, seed: int, kills: int, zygote: Zygote | None) -> None:
    """SIGKILL at random moments (on a step, just after a save started, just after a save was
    durable), `kills` times, restarting each time; the end result must be exact.

    With a zygote, each restart is a process forked from it (same code as `python -m trainer`,
    without paying the torch import again); without, a fresh `python -m trainer run` (``fork=False``:
    this path checks that the forks stand for real interpreters)."""
    config, run_dir, gate = _config(tmp_path), tmp_path / "run", tmp_path / "gate"

    def start(*a: Any, held_after: int | None = None) -> Proc:
        # The gate, 8 steps past the restore, only holds a run the test reads late: killed there.
        env = gated(gate, held_after) if held_after is not None else trainer_env()
        if zygote is None:
            return start_process(*a, env=env, fork=False)
        return zygote.spawn(run_args(*a)[3:], env)

    rng = random.Random(seed)
    args = ("--checkpoint-every-steps", "3")
    restored = 0
    for k in range(kills):
        p = start(run_dir, STEPS, config, *args, held_after=8)
        got = int(p.wait_for(r"event=restore step=(\d+)").group(1))
        assert got >= restored, f"kill {k}: restored {got}, but step {restored} had been restored before"
        restored = got
        moment = rng.choice(["step", "save", "durable"])
        target = rng.randint(restored + 1, restored + 3)  # 10 kills stay below STEPS
        if moment == "step":
            p.wait_for(rf"event=step step={target}/")
        elif moment == "save":
            p.wait_for(r"event=checkpoint_save step=\d+")  # the write is in flight now
        else:
            p.wait_for(r"checkpoint step \d+ durable")
        p.signal(signal.SIGKILL)
        assert p.wait() == -signal.SIGKILL
    p = start(run_dir, STEPS, config, *args)
    assert p.wait() == 0, p.output[-3000:]
    assert status(run_dir)["model_digest"] == reference["model_digest"], p.output[-3000:]


def test_sigkill_crash_consistency_fresh_processes(tmp_path: Path, reference: dict) -> None:
    _kill_run(tmp_path, reference, seed=1, kills=3, zygote=None)


@pytest.mark.parametrize("seed", [2, 3, 4, 5, 6])  # 50 kills
def test_sigkill_crash_consistency(tmp_path: Path, reference: dict, zygote: Zygote, seed: int) -> None:
    _kill_run(tmp_path, reference, seed, kills=10, zygote=zygote)


@pytest.mark.soak
def test_sigkill_soak(tmp_path: Path, reference: dict, zygote: Zygote) -> None:
    total = int(os.environ.get("SPOTTRAIN_SOAK_KILLS", "300"))
    done = 0
    seed = 1000
    while done < total:
        n = min(10, total - done)
        d = tmp_path / f"r{seed}"
        d.mkdir()
        _kill_run(d, reference, seed, kills=n, zygote=zygote)
        done, seed = done + n, seed + 1
