"""DDP under torchrun with 2 gloo ranks on CPU: a SIGTERM to the whole group mid-run, a restart,
and the same final model as an uninterrupted 2-rank run; the interrupted session loads its data
with workers, the reference inline. (World-size changes: test_e2e_elastic.)"""
from __future__ import annotations

import signal
import sys
from pathlib import Path

from tests.trainer.support import GATE_TASK, Proc, gated, open_gate_on_notice, run_args, status, write_config

STEPS = 20


def torchrun(run_dir: Path, config: Path, *extra: str, nproc: int = 2, env: dict[str, str] | None = None) -> Proc:
    argv = run_args(run_dir, STEPS, config, "--checkpoint-every-steps", "5", *extra)
    # run_args starts with [python, -m, trainer, ...]: run the same module under torchrun.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", *argv[2:]]
    return Proc(cmd, env=env, new_session=True)


def test_ddp_two_ranks_sigterm_and_resume_exactly(tmp_path: Path) -> None:
    config = write_config(tmp_path, f'task = "{GATE_TASK}"\n', multi_rank=True)
    ref = torchrun(tmp_path / "ref", config)
    assert ref.wait() == 0, ref.output[-4000:]

    run_dir, gate = tmp_path / "run", tmp_path / "gate"
    # Each rank's 2 workers serve 6 batches each: held at step 12 only if this test reads the log late.
    p = torchrun(run_dir, config, "--data-workers", "2", env=gated(gate, 6))
    p.wait_for(r"event=step step=7/")
    p.signal(signal.SIGTERM, group=True)  # what systemd does to the unit's processes
    open_gate_on_notice(p, gate)
    p.wait()  # torchrun's own exit status reports the signal; the log says what was saved
    saved = int(p.wait_for(r"event=preempted step=(\d+) persistent_ok=1").group(1))
    assert 7 <= saved < STEPS
    s = status(run_dir)
    assert s["latest_step"] == saved
    assert s["data"]["consumed"] == saved * 2 * 4  # global samples: 2 ranks x batch 4 per step

    p = torchrun(run_dir, config)
    assert p.wait() == 0, p.output[-4000:]
    assert int(p.seen(r"event=restore step=(\d+)").group(1)) == saved
    assert status(run_dir)["model_digest"] == status(tmp_path / "ref")["model_digest"]
    # The state reached rank 1 as tensors: what went through pickle is its structure, not its bytes.
    sent = p.seen(r"restore: step \d+ sent from rank 0 as (\d+) tensors \((\d+) bytes\) .*; (\d+) bytes pickled")
    tensors, tensor_bytes, pickled = (int(x) for x in sent.groups())
    assert tensors > 700 and pickled < 200 * tensors + 65536 < tensor_bytes


def test_a_two_rank_run_seeded_by_init_from_starts_from_the_source_weights(tmp_path: Path) -> None:
    """init_from's weights and optimizer state reach the second rank as tensors (788 of them), and
    a frozen run (lr 0) ends with exactly the source's weights."""
    config = write_config(tmp_path, multi_rank=True)
    src = torchrun(tmp_path / "src", config)
    assert src.wait() == 0, src.output[-4000:]
    frozen = tmp_path / "frozen.toml"
    frozen.write_text(config.read_text().replace("[task_args]", "[task_args]\nlr = 0.0"))
    p = torchrun(tmp_path / "seeded", frozen, "--init-from", str(tmp_path / "src"), "--init-from-optimizer")
    assert p.wait() == 0, p.output[-4000:]
    assert p.seen(r"event=init_from .* layout=whole-model optimizer=1 ")
    assert status(tmp_path / "seeded")["model_digest"] == status(tmp_path / "src")["model_digest"]
