"""trainer/evaluation.py: evaluation in the real loop leaves the weights bit-identical, whether
it is an eval set or a callable, and whether it is switched on or off between restarts."""
from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from trainer.config import RunConfig, StatusConfig
from trainer.loop.evaluation import isolated
from trainer.status import collect
from trainer.train import run
from tests.trainer.support import restore_logging  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("restore_logging")


def _cfg(run_dir: Path, mode: str, **kw: object) -> RunConfig:
    kw = {"eval_batches": 3, **kw}
    return RunConfig(run_dir=run_dir, steps=20, task="tests.trainer.eval_task:build", task_args={"mode": mode},
                     batch_size=4, health_port=None, watch_metadata=False, checkpoint_every_steps=5, **kw)


def _scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(run_dir / "tensorboard"))
    ea.Reload()
    return [(e.step, e.value) for e in ea.Scalars(tag)] if tag in ea.Tags()["scalars"] else []


@pytest.mark.parametrize("mode", ["dataset", "callable"])
def test_evaluation_leaves_the_weights_bit_identical(tmp_path: Path, mode: str) -> None:
    assert run(_cfg(tmp_path / "plain", mode)).code == 0
    assert run(_cfg(tmp_path / "eval", mode, eval_every_steps=4)).code == 0
    plain, evaluated = (collect(StatusConfig(run_dir=tmp_path / d)) for d in ("plain", "eval"))
    assert evaluated["model_digest"] == plain["model_digest"]
    points = _scalars(tmp_path / "eval", "eval/loss")
    assert [s for s, _ in points] == [4, 8, 12, 16, 20] and all(0 <= v < 10 for _, v in points)
    assert _scalars(tmp_path / "plain", "eval/loss") == []
    if mode == "callable":
        assert [s for s, _ in _scalars(tmp_path / "eval", "eval/mean_x")] == [4, 8, 12, 16, 20]


def test_evaluation_may_be_switched_on_at_a_resume(tmp_path: Path) -> None:
    assert run(_cfg(tmp_path / "plain", "dataset")).code == 0
    assert run(_cfg(tmp_path / "run", "dataset", stop_at_step=10)).code == 75
    assert run(_cfg(tmp_path / "run", "dataset", eval_every_steps=3, eval_batches=2)).code == 0
    assert (collect(StatusConfig(run_dir=tmp_path / "run"))["model_digest"]
            == collect(StatusConfig(run_dir=tmp_path / "plain"))["model_digest"])
    assert [s for s, _ in _scalars(tmp_path / "run", "eval/loss")] == [12, 15, 18, 20]


def test_isolated_puts_back_every_rng_and_every_module_mode() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5), torch.nn.BatchNorm1d(2))
    model.train()
    model[2].eval()  # a frozen part the user keeps in eval mode
    before = (random.getstate(), torch.get_rng_state(), np.random.get_state()[1].copy())
    with isolated(model):
        assert not any(m.training for m in model.modules())
        random.random(), torch.rand(3), np.random.rand()
        assert not torch.is_grad_enabled()
    assert random.getstate() == before[0] and torch.equal(torch.get_rng_state(), before[1])
    assert (np.random.get_state()[1] == before[2]).all()
    assert [m.training for m in model.modules()] == [True, True, True, False]
