"""FSDP2 in the training loop (2 gloo ranks on CPU under torchrun): every rank saves its shard
through torch.distributed.checkpoint; a SIGTERM mid-run saves a sharded emergency checkpoint, and
one process resumes it (resharding 2 -> 1) to the same final model as a run that took the same
world-size path without the signal. Switching parallelism on a run dir is refused, nothing lost."""
from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.trainer.e2e.job_support import STEPS, digests, interrupted, trainer
from tests.trainer.e2e.job_support import config as job_config
from tests.trainer.support import open_gate_on_notice, status, write_config



def sigterm_after(run_dir: Path, config: Path, step: int) -> int:
    """A 2-rank run held after ``step`` until its notice, SIGTERMed on every rank (what systemd does
    to the unit): the step the sharded emergency checkpoint holds, durable on the run dir."""
    hold = run_dir.parent / f"hold-{run_dir.name}"
    p = trainer(run_dir, config, torchrun=2, hold=(hold, step))
    p.wait_for(rf"event=step step={step}/")
    p.signal(signal.SIGTERM, group=True)
    open_gate_on_notice(p, hold)
    p.wait()
    return int(p.wait_for(r"event=preempted step=(\d+) persistent_ok=1").group(1))


@pytest.mark.xdist_group("torchrun")
def test_fsdp_sigterm_then_resume_on_one_process_matches_the_same_path(tmp_path: Path) -> None:
    config = write_config(tmp_path, 'parallelism = "fsdp"\nglobal_batch_size = 8\n', multi_rank=True)
    run_dir = tmp_path / "run"
    saved = sigterm_after(run_dir, config, 6)
    assert 6 <= saved < STEPS
    s = status(run_dir)
    assert s["sharded"] and s["latest_step"] == saved and s["data"]["consumed"] == saved * 8

    # The other layout is refused, and nothing is deleted.
    (tmp_path / "ddp").mkdir()
    ddp = trainer(run_dir, write_config(tmp_path / "ddp", "global_batch_size = 8\n", multi_rank=True))
    assert ddp.wait() == 2
    assert 'this run has parallelism = "ddp", but its tiers hold checkpoints of the other layout' in ddp.output
    assert status(run_dir)["latest_step"] == saved

    one = trainer(run_dir, config)
    assert one.wait() == 0, one.output[-4000:]
    assert one.seen(rf"event=world_size_change step={saved} from=2 to=1 consumed={saved * 8} ")
    final = status(run_dir)
    assert final["latest_step"] == STEPS

    ref = tmp_path / "ref"
    two = trainer(ref, config, "--stop-at-step", str(saved), torchrun=2)
    two.wait()
    two.seen(rf"event=paused step={saved} ")
    assert trainer(ref, config).wait() == 0
    assert final["model_digest"] == status(ref)["model_digest"]


def test_a_named_state_beside_sharded_weights_resumes_bit_for_bit(tmp_path: Path) -> None:
    """``Task.states`` in the sharded layout: saved with the replicated rest next to the shards,
    restored on every rank (issue 29)."""

    config = write_config(tmp_path, 'parallelism = "fsdp"\nglobal_batch_size = 8\n'
                                    'task = "tests.trainer.e2e.tracked_task:build"\n', multi_rank=True)
    ref = trainer(tmp_path / "ref", config, torchrun=2)
    assert ref.wait() == 0, ref.output[-4000:]
    run_dir = tmp_path / "run"
    saved = sigterm_after(run_dir, config, 6)
    p = trainer(run_dir, config, torchrun=2)
    assert p.wait() == 0, p.output[-4000:]
    assert int(p.seen(r"event=restore step=(\d+)").group(1)) == saved
    want = digests(tmp_path / "ref", STEPS)
    assert "states.tracker" in want and digests(run_dir, STEPS) == want
    assert status(run_dir)["model_digest"] == status(tmp_path / "ref")["model_digest"]


def _sharded_digests(run_dir: Path, step: int) -> tuple[dict[str, str], dict]:
    """Every part of a sharded checkpoint by name (the gathered model, and each named state,
    sharded or replicated), and its states as read."""
    from tests.trainer.support import run_key
    from trainer.checkpoint.format import state_digest
    from trainer.checkpoint.reader import read

    found = read(run_dir=run_dir, gcs_uri=None, step=step, key=run_key())
    return {"model": state_digest(found.model), **digests(run_dir, step)}, found.state["states"]


@pytest.mark.xdist_group("torchrun")
def test_a_gan_with_a_sharded_discriminator_and_emas_resumes_bit_for_bit(tmp_path: Path) -> None:
    """Two trained models with two optimizers, an ``AveragedModel`` EMA and a hand-averaged copy
    of the generator, all sharded on 2 ranks (issue 29): SIGTERM, SIGKILL and a restart end where
    an uninterrupted run ends, every state bit for bit; each model exports whole by name."""
    from safetensors.torch import load_file

    from tests.trainer.e2e import sharded_gan_task

    cfg = job_config(tmp_path, 'parallelism = "fsdp"\ntask = "tests.trainer.e2e.sharded_gan_task:build"\n'
                           'batch_size = 4\n')
    ref = trainer(tmp_path / "ref", cfg, torchrun=2)
    assert ref.wait() == 0, ref.output[-4000:]
    interrupted(tmp_path / "run", cfg, torchrun=2)
    want, states = _sharded_digests(tmp_path / "ref", STEPS)
    assert {"model", "states.D", "states.opt_d", "states.ema", "states.ema_plain", "data"} <= set(want)
    got, resumed = _sharded_digests(tmp_path / "run", STEPS)
    assert got == want  # both networks, the discriminator's Adam, both EMAs, the data position
    assert int(resumed["ema"]["n_averaged"]) == int(states["ema"]["n_averaged"]) == STEPS
    # 4 tensors a block, 30 blocks a network: hundreds of sharded tensors, Adam's moments twice that.
    assert len(resumed["D"]) > 120 and len(resumed["opt_d"]["state"]) == len(resumed["D"])
    export = tmp_path / "run" / "export" / f"step-{STEPS:08d}"
    for name, net in [("model", sharded_gan_task.Net(8, 16, 8, 30)), ("model-D", sharded_gan_task.Net(8, 16, 1, 30)),
                      ("model-ema", sharded_gan_task.Net(8, 16, 8, 30)),
                      ("model-ema_plain", sharded_gan_task.Net(8, 16, 8, 30))]:
        net.load_state_dict(load_file(export / f"{name}.safetensors"), strict=True)


@pytest.mark.xdist_group("torchrun")
def test_a_sharded_gan_resumes_on_one_process_like_the_same_path(tmp_path: Path) -> None:
    """The discriminator, its Adam and the EMA reshard 2 -> 1 like the main model (DCP)."""

    cfg = job_config(tmp_path, 'parallelism = "fsdp"\ntask = "tests.trainer.e2e.sharded_gan_task:build"\n'
                           'batch_size = 4\n[task_args]\nema = "averaged"\n')
    saved = sigterm_after(tmp_path / "run", cfg, 6)
    one = trainer(tmp_path / "run", cfg)
    assert one.wait() == 0, one.output[-4000:]
    assert one.seen(rf"event=world_size_change step={saved} from=2 to=1 ")
    two = trainer(tmp_path / "ref", cfg, "--stop-at-step", str(saved), torchrun=2)
    two.wait()
    assert two.seen(rf"event=paused step={saved} ")
    assert trainer(tmp_path / "ref", cfg).wait() == 0
    got, states = _sharded_digests(tmp_path / "run", STEPS)
    assert {"states.D", "states.opt_d", "states.ema"} <= set(got)
    assert got == _sharded_digests(tmp_path / "ref", STEPS)[0] and int(states["ema"]["n_averaged"]) == STEPS


def test_one_optimizer_over_two_sharded_models_is_refused_before_anything_is_saved(tmp_path: Path) -> None:
    from trainer import EXIT_BAD_INPUT

    cfg = job_config(tmp_path, 'parallelism = "fsdp"\ntask = "tests.trainer.e2e.sharded_gan_task:build"\n'
                           'batch_size = 4\n[task_args]\noptim = "one"\nblocks = 2\n')
    p = trainer(tmp_path / "run", cfg)
    assert p.wait() == EXIT_BAD_INPUT, p.output[-3000:]
    line = p.seen(r"event=failed reason=bad_input (.*)").group(1)
    assert line.startswith("task tests.trainer.e2e.sharded_gan_task:build: Task.optimizer: it holds D and model; "
                           "under parallelism = 'fsdp'"), line
    assert "Traceback" not in p.output
    assert not list((tmp_path / "run").glob("step-*"))
