"""What the end-to-end tests of jobs share (test_e2e_any_job, test_e2e_fsdp): a job's config, its
launch on one process or under torchrun, the run a Spot VM gets (SIGTERM, power lost, a restart),
and the digest of every part of a checkpoint by name."""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from tests.trainer.support import REPO, Proc, open_gate_on_notice, run_args, trainer_env
from trainer import EXIT_PREEMPTED

EXAMPLES = REPO / "examples"
STEPS = 16


def env(*code: Path) -> dict[str, str]:
    """The trainer's environment with the example's code on the path, as the VM's code_dir is."""
    return trainer_env(PYTHONPATH=os.pathsep.join([str(REPO), *map(str, code)]))


def config(tmp: Path, body: str) -> Path:
    path = tmp / "trainer.toml"
    path.write_text("log_every_steps = 1\nprogress_every_s = 0.5\n" + body)
    return path


def digests(run_dir: Path, step: int) -> dict[str, str]:
    """Every part of step ``step``'s checkpoint by name: the model, optimizer, scheduler, data
    position, and each named state."""
    from trainer.checkpoint.format import state_digest
    from trainer.checkpoint.reader import read
    from tests.trainer.support import run_key

    state = read(run_dir=run_dir, gcs_uri=None, step=step, key=run_key()).state
    out = {k: state_digest(state[k]) for k in ("model", "optimizer", "scheduler", "data") if state.get(k) is not None}
    out.update({f"states.{k}": state_digest(v) for k, v in state.get("states", {}).items()})
    out.update({f"rank_states.{r}": state_digest(v) for r, v in enumerate(state.get("rank_states") or [])})
    return out


def trainer(run_dir: Path, cfg: Path, *extra: str, code: tuple[Path, ...] = (), torchrun: int = 0,
            hold: tuple[Path, int] | None = None) -> Proc:
    """The job's run; ``hold``: (a file, a step): held after that step while the file exists
    (``tests/trainer/e2e/held.py``), so that a signal always finds it mid-way."""
    argv, environ = run_args(run_dir, STEPS, cfg, "--checkpoint-every-steps", "4", *extra), env(*code)
    if hold is not None:
        argv[2] = "tests.trainer.e2e.held"
        hold[0].touch()
        environ.update(HOLD_FLAG=str(hold[0]), HOLD_AT_STEP=str(hold[1]))
    if torchrun:  # the same module under torchrun, one rank per process
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun}",
                "-m", *argv[2:]]
    return Proc(argv, env=environ, new_session=bool(torchrun))


def interrupted(run_dir: Path, cfg: Path, *extra: str, code: tuple[Path, ...] = (), torchrun: int = 0) -> Proc:
    """SIGTERM after step 5 (the emergency save, exit 75), SIGKILL after step 10 once step 8's
    save is durable (power lost), then a restart that finishes: the run a Spot VM gets. (Each
    interrupted session is held at its step until then: the examples' steps take milliseconds.)"""
    hold = run_dir.parent / f"hold-{run_dir.name}"
    p = trainer(run_dir, cfg, *extra, code=code, torchrun=torchrun, hold=(hold, 5))
    p.wait_for(r"event=step step=5/")
    p.signal(signal.SIGTERM, group=bool(torchrun))
    open_gate_on_notice(p, hold)
    rc = p.wait()
    saved = int(p.wait_for(r"event=preempted step=(\d+) persistent_ok=1").group(1))
    assert torchrun or rc == EXIT_PREEMPTED, p.output[-3000:]
    p = trainer(run_dir, cfg, *extra, code=code, torchrun=torchrun, hold=(hold, 10))
    assert int(p.wait_for(r"event=restore step=(\d+)").group(1)) == saved
    p.wait_for(r"event=step step=10/")
    p.seen_or_wait(r"checkpoint step 8 durable on persistent")  # the cadence's save, before power is lost
    p.power_off()
    p.wait()
    p = trainer(run_dir, cfg, *extra, code=code, torchrun=torchrun)
    assert p.wait() == 0, p.output[-4000:]
    assert int(p.seen(r"event=restore step=(\d+)").group(1)) >= 8
    return p
