"""Each rank's exit status under torchrun, which itself exits 1 whenever a rank fails.

torchrun and the trainer run as `Proc`s: forked from the worker's zygote, ranks and all, as
`python -m torch.distributed.run` / `python -m trainer` would start (tests/trainer/zygote.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.trainer.support import Proc, trainer_env

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=2",
            "--max-restarts=0", "-m", "trainer", "run"]


def test_every_rank_records_its_status_under_torchrun(tmp_path: Path) -> None:
    exit_dir = tmp_path / "exit"
    exit_dir.mkdir()
    # Bad input (steps must be > 0): every rank exits 2, torchrun says 1.
    proc = Proc([*TORCHRUN, "--run-dir", str(tmp_path / "run"), "--steps", "0"],
                env=trainer_env(SPOTTRAIN_EXIT_DIR=str(exit_dir)))
    assert proc.wait() == 1, proc.output[-3000:]
    recorded = {p.name: p.read_text() for p in exit_dir.iterdir()}
    # torchrun stops rank 1 as soon as rank 0 has failed: it may die before it records anything
    # (trainer.sh then keeps torchrun's 1); what it records is its own 2.
    assert recorded.get("rank-0") == "2\n" and set(recorded) <= {"rank-0", "rank-1"}
    assert set(recorded.values()) == {"2\n"}


def test_an_earlier_rounds_status_is_forgotten_when_a_rank_starts(tmp_path: Path) -> None:
    (tmp_path / "rank-0").write_text("75\n")
    env = {**os.environ, "SPOTTRAIN_EXIT_DIR": str(tmp_path), "LOCAL_RANK": "0"}
    proc = subprocess.run([sys.executable, "-c", "from trainer import exit_status; exit_status.starting()"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "rank-0").exists()


def test_a_usage_error_is_recorded_too(tmp_path: Path) -> None:
    proc = Proc([sys.executable, "-m", "trainer", "run", "--no-such-flag"], env=trainer_env(SPOTTRAIN_EXIT_DIR=str(tmp_path)))
    assert proc.wait() == 2, proc.output[-3000:]
    assert (tmp_path / "rank-0").read_text() == "2\n"


def test_sigterm_to_torchrun_reaches_every_rank_and_each_records_75(tmp_path: Path) -> None:
    """What systemd's stop does on a multi-GPU VM: SIGTERM to torchrun (through trainer.sh), which
    passes it to every rank; they save together and each exits 75, while torchrun says 1."""
    import signal

    exit_dir = tmp_path / "exit"
    config = tmp_path / "trainer.toml"
    config.write_text('device = "cpu"\nwatch_metadata = false\nlog_every_steps = 1\n'
                      "checkpoint_every_steps = 1000\n[task_args]\nn_layer = 1\nn_embd = 16\n")
    proc = Proc([*TORCHRUN, "--run-dir", str(tmp_path / "run"), "--steps", "100000", "--health-port", "0",
                 "--config", str(config)], env=trainer_env(SPOTTRAIN_EXIT_DIR=str(exit_dir)))
    try:
        proc.wait_for(r"event=step ")  # the two ranks train
        proc.signal(signal.SIGTERM)
        rc = proc.wait(120)
    finally:
        proc.kill()
    assert "world_size=2" in proc.output
    assert rc == 1, proc.output[-3000:]
    assert {p.name: p.read_text() for p in exit_dir.iterdir()} == {"rank-0": "75\n", "rank-1": "75\n"}
    assert "event=preempted" in proc.output
