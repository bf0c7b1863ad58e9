"""A preemption notice at any moment of `python -m trainer run`'s start-up: exit 75 with a line
saying so, nothing lost. Each moment is reached deterministically: the trainer holds at the named
point (``SPOTTRAIN_HOLD_STARTUP_AT``), says so, and the test signals it there."""
from __future__ import annotations

import signal
from pathlib import Path

from trainer.startup_notice import HOLD_ENV, POINTS
from tests.trainer.support import REFERENCE_STEPS as STEPS
from tests.trainer.support import start, status, trainer_env, write_config


def _notice_at(run_dir: Path, config: Path, point: str, sig: int = signal.SIGTERM) -> str:
    """Start, wait until start-up holds at ``point``, signal; expect exit 75; the stop line.
    Before the heavy imports ("main", "imports") a fresh interpreter (``fork=False``): a zygote's
    child has torch loaded already, so a notice there would not meet the imports it must survive."""
    p = start(run_dir, STEPS, config, "--checkpoint-every-steps", "10", env=trainer_env(**{HOLD_ENV: point}),
              fork=False if point in ("main", "imports") else None)
    p.wait_for(rf"event=startup_hold point={point} ")
    p.signal(sig)
    assert p.wait() == 75, p.output[-3000:]
    assert "Traceback" not in p.output, p.output[-3000:]
    return p.seen(r"event=preempted step=\S+ detail=notice during start-up.*").group(0)


def test_a_notice_at_every_moment_of_start_up_exits_75_with_a_line_and_loses_nothing(
        tmp_path: Path, reference: dict) -> None:
    config = write_config(tmp_path)
    run_dir = tmp_path / "run"
    # A fresh run: no checkpoint yet, and the line says so rather than calling step 0 durable.
    line = _notice_at(run_dir, config, "restore")
    assert "no checkpoint yet, nothing was trained" in line, line

    p = start(run_dir, STEPS, config, "--checkpoint-every-steps", "10", "--stop-at-step", "10")
    assert p.wait() == 75, p.output[-3000:]
    assert status(run_dir)["latest_step"] == 10
    for point in POINTS:
        line = _notice_at(run_dir, config, point, signal.SIGINT if point == "lease" else signal.SIGTERM)
        if point in ("main", "imports"):
            assert "before the trainer loaded torch); nothing was trained, nothing to save" in line, line
        elif point == "restore":
            assert "step=10 detail=notice during start-up; checkpoint 10 is already durable" in line, line
        else:
            assert "nothing was trained, nothing to save" in line, line
        assert status(run_dir)["latest_step"] == 10, point
    # Nothing was lost and no stale lease or lock was left: the run finishes on the reference's weights.
    p = start(run_dir, STEPS, config, "--checkpoint-every-steps", "10")
    assert p.wait() == 0, p.output[-3000:]
    s = status(run_dir)
    assert s["model_digest"] == reference["model_digest"]
    # The ledger counted the sessions that start-up stopped once it was open as preempted, not crashed.
    assert s["goodput"]["crashes"] == 0, s["goodput"]

