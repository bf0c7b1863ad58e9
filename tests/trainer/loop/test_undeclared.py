"""The guard against state a job changes but never declared (``trainer.loop.undeclared``), in
process: the real torch optimizer hooks, modules, schedulers and DataLoaders."""
from __future__ import annotations

import pytest
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from trainer.loop.undeclared import Guard, Undeclared


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(6, 4)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def test_a_declared_job_passes_and_its_steps_wait_for_the_copy() -> None:
    model = _net()
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    waits: list[int] = []
    guard = Guard([model, opt, sched], before_update=lambda: waits.append(1))
    try:
        guard.before_first_step()
        _train(model, opt)
        sched.step()
        guard.after_first_step()
        assert waits == [1]  # the declared optimizer's step waited for a save's copy of the weights
    finally:
        guard.close()


def test_an_undeclared_optimizer_is_refused_before_it_changes_a_weight() -> None:
    gen, disc = _net(), _net()
    opt_g, opt_d = torch.optim.Adam(gen.parameters()), torch.optim.Adam(disc.parameters())
    guard = Guard([gen, opt_g])
    try:
        disc(torch.randn(6, 4)).mean().backward()
        before = [p.detach().clone() for p in disc.parameters()]
        with pytest.raises(Undeclared, match="an optimizer Adam over 6 parameter tensors stepped"):
            opt_d.step()
        assert all(torch.equal(a, b) for a, b in zip(before, disc.parameters()))
    finally:
        guard.close()
    opt_d.step()  # the hook is gone with the guard


@pytest.mark.parametrize("kind", ["ema", "scheduler", "bn-beside"])
def test_state_moved_beside_the_declared_job_is_refused_after_the_first_step(kind: str) -> None:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    probe = torch.nn.BatchNorm1d(4)  # a module whose running statistics move, in no checkpoint
    declared = {"ema": [model, opt, sched, probe], "scheduler": [model, opt, ema, probe],
                "bn-beside": [model, opt, ema, sched]}[kind]
    guard = Guard(declared)
    try:
        guard.before_first_step()
        _train(model, opt)
        ema.update_parameters(model)
        sched.step()
        probe(torch.randn(5, 4))
        want = {"ema": "AveragedModel|Sequential", "scheduler": "StepLR", "bn-beside": "BatchNorm1d"}[kind]
        with pytest.raises(Undeclared, match=f"the first step changed state the job never declared .*({want})"):
            guard.after_first_step()
    finally:
        guard.close()


def test_a_plain_dataloader_left_iterating_is_refused() -> None:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 4)), batch_size=8)
    guard = Guard([model, opt])
    try:
        guard.before_first_step()
        it = iter(loader)
        (x,) = next(it)
        _train(model, opt)
        with pytest.raises(Undeclared, match="DataLoader iterating that the job never declared"):
            guard.after_first_step()
    finally:
        guard.close()
    del it
