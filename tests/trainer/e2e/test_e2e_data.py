"""Data workers end to end: the same weights as inline loading across real preemptions and
crashes, the position never counting prefetched batches, and a notice that does not wait for
workers stuck on slow samples."""
from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

from tests.trainer.support import REFERENCE_STEPS as STEPS
from tests.trainer.support import (GATE_TASK, gated, open_gate_on_notice, run_to_end, start, status, trainer_env,
                                   write_config)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has released everything
    except FileNotFoundError:
        return True


def test_workers_give_the_inline_weights_across_sigterm_and_sigkill(tmp_path: Path, reference: dict) -> None:
    """2 workers, SIGTERM after step 14; 1 worker, SIGKILL at step 23 (checkpoint 20 survives);
    inline to the end: the final weights are the inline reference's, bit for bit. The gate task
    parks each worker after a set number of samples, so every signal finds the run mid-way."""
    config, run_dir, gate = write_config(tmp_path), tmp_path / "run", tmp_path / "gate"
    args = ("--checkpoint-every-steps", "10", "--task", GATE_TASK)
    # Batches go round-robin to the 2 workers: 7 batches each, and the loop waits for batch 15.
    p = start(run_dir, STEPS, config, *args, "--data-workers", "2", env=gated(gate, 7))
    pids = [int(x) for x in p.wait_for(r"event=data_workers workers=2 from=0 pids=([\d,]+)").group(1).split(",")]
    p.wait_for(r"event=step step=14/")
    p.signal(signal.SIGTERM)
    open_gate_on_notice(p, gate)  # the step in flight completes and is saved
    assert p.wait() == 75, p.output[-3000:]
    saved = int(p.seen(r"event=preempted step=(\d+) persistent_ok=1").group(1))
    assert saved in (14, 15)  # the step it had completed, or the one it was waiting to load
    assert all(_gone(pid) for pid in pids), "a data worker outlived the trainer"
    s = status(run_dir)
    # Workers had prepared batches beyond the save: only the ones the loop took count.
    assert s["latest_step"] == saved and s["data"]["consumed"] == saved * 4

    p = start(run_dir, STEPS, config, *args, "--data-workers", "1", env=gated(gate, 23 - saved))
    pids = [int(p.wait_for(rf"event=data_workers workers=1 from={saved * 4} pids=(\d+)").group(1))]
    for line in (r"checkpoint step 20 durable on persistent", r"event=step step=23/"):  # the save is asynchronous
        p.seen_or_wait(line)
    p.signal(signal.SIGKILL)  # the trainer alone: its parked worker must follow it (PR_SET_PDEATHSIG)
    p.wait()
    deadline = time.monotonic() + 60
    while not all(_gone(pid) for pid in pids):
        assert time.monotonic() < deadline, "a data worker outlived the SIGKILLed trainer"
        time.sleep(0.05)

    p = run_to_end(run_dir, STEPS, config, *args)
    assert int(p.seen(r"event=restore step=(\d+)").group(1)) == 20
    assert status(run_dir)["model_digest"] == reference["model_digest"]


def test_a_notice_does_not_wait_for_workers_busy_on_slow_samples(tmp_path: Path) -> None:
    """The loop is parked inside step 6 (its batch in hand); both workers are stuck on samples of
    batches 6 and 7 that never finish. A SIGTERM: the step in flight completes, the emergency save
    is durable, the process exits 75 and no worker survives it, while the samples are still stuck."""
    slow = tmp_path / "slow"
    slow.mkdir()
    for gate in ("workers", "loop-gate"):
        (slow / gate).touch()
    # 4 samples a batch, batches dealt round-robin to 2 workers: a worker's 4th batch (after 12
    # samples) is batch 6 or 7, which the workers reach while the loop waits in step 6.
    env = {"SLOW_DIR": str(slow), "SLOW_AFTER": "12", "PARK_STEP": "6"}
    config = write_config(tmp_path, 'task = "tests.trainer.e2e.slow_data_task:build"\ndata_workers = 2\n')
    p = start(tmp_path / "run", STEPS, config, env=trainer_env(**env))
    try:
        deadline = time.monotonic() + 240
        while not ((slow / "loop").exists() and len(list(slow.glob("worker-*"))) == 2):
            assert p.p.poll() is None and time.monotonic() < deadline, p.output[-3000:]
            time.sleep(0.05)
        pids = [int(f.read_text()) for f in slow.glob("worker-*")]
        p.signal(signal.SIGTERM)
        p.wait_for(r"event=preemption_notice reason=SIGTERM completed_step=5")
        (slow / "loop-gate").unlink()
        assert p.wait() == 75, p.output[-3000:]
        p.seen(r"event=preempted step=6 persistent_ok=1")
        assert (slow / "workers").exists()  # the slow samples never finished
        assert all(_gone(pid) for pid in pids), "a data worker outlived the trainer"
        s = status(tmp_path / "run")
        assert s["latest_step"] == 6 and s["data"]["consumed"] == 6 * 4
    finally:
        p.kill()
        (slow / "workers").unlink(missing_ok=True)


def test_a_worker_killed_by_sigkill_costs_nothing(tmp_path: Path, reference: dict) -> None:
    """A data worker SIGKILLed at step 5 of a run that has saved nothing yet: new workers take over
    at the position, the same session trains to the end and its weights are the uninterrupted
    reference's, bit for bit; the death is in the log and the ledger."""
    config, run_dir = write_config(tmp_path), tmp_path / "run"
    p = start(run_dir, STEPS, config, "--checkpoint-every-steps", "100", "--data-workers", "2")
    try:
        pids = [int(x) for x in p.wait_for(r"event=data_workers workers=2 from=0 pids=([\d,]+)").group(1).split(",")]
        p.wait_for(r"event=step step=5/")
        os.kill(pids[0], signal.SIGKILL)
        died = p.wait_for(r"event=data_workers_died step=(\d+) consumed=(\d+) died=(\S+) deaths=1 restarted=1")
        step, consumed = int(died.group(1)), int(died.group(2))
        assert died.group(3) == f"{pids[0]}:SIGKILL" and step >= 5 and consumed >= step * 4, died.group(0)
        new = p.wait_for(rf"event=data_workers workers=2 from={consumed} pids=([\d,]+)").group(1)
        assert pids[0] not in {int(x) for x in new.split(",")}
        assert p.wait() == 0, p.output[-3000:]
    finally:
        p.kill()
    assert "event=failed" not in p.output and p.output.count("event=restore ") == 1, p.output[-3000:]
    s = status(run_dir)
    assert s["latest_step"] == STEPS and s["model_digest"] == reference["model_digest"]
    from trainer.observe.ledger import LEDGER_DIR, LEDGER_FILE, read_events

    told = [e for e in read_events(run_dir / LEDGER_DIR / LEDGER_FILE) if e["event"] == "data_workers_died"]
    assert [(e["step"], e["consumed"], e["died"], e["restarted"]) for e in told] == \
        [(step, consumed, f"{pids[0]}:SIGKILL", True)]


def test_workers_that_keep_dying_save_the_step_and_exit_to_be_restarted(tmp_path: Path, reference: dict) -> None:
    """From step 5 on every data worker is SIGKILLed at its first sample: three restarts, then
    the workers are given up; the step finishes with batches made in the trainer, is saved durably
    and the trainer exits 1 (the unit restarts it). The next session resumes from that step and
    ends at the reference's weights, bit for bit."""
    die = tmp_path / "die"
    config = write_config(tmp_path, 'task = "tests.trainer.e2e.dying_data_task:build"\ndata_workers = 2\n')
    run_dir = tmp_path / "run"
    env = trainer_env(DIE_FILE=str(die))
    p = start(run_dir, STEPS, config, "--checkpoint-every-steps", "100", env=env)
    try:
        p.wait_for(r"event=step step=5/")
        die.touch()
        assert p.wait() == 1, p.output[-3000:]
    finally:
        p.kill()
    deaths = [(int(m.group(1)), int(m.group(2))) for m in
              (re.search(r"deaths=(\d+) restarted=(\d)", line) for line in p.lines if "event=data_workers_died" in line)
              if m]
    assert deaths == [(1, 1), (2, 1), (3, 1), (4, 0)], p.output[-3000:]
    saved = int(p.seen(r"event=failed reason=data_workers data workers died 4 times within \d+s "
                       r"\(last: [\d,]+:SIGKILL[^)]*\); step (\d+) is saved and durable").group(1))
    assert saved >= 5 and "Traceback" not in p.output, p.output[-3000:]
    s = status(run_dir)
    assert s["latest_step"] == saved and s["data"]["consumed"] == saved * 4

    die.unlink()  # the memory is back: the restarted trainer resumes with workers
    p = run_to_end(run_dir, STEPS, config, "--checkpoint-every-steps", "100", env=env)
    assert int(p.seen(r"event=restore step=(\d+)").group(1)) == saved
    assert status(run_dir)["model_digest"] == reference["model_digest"]
