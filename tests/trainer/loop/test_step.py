"""trainer.loop.step: the optimizer step of ``StepFn`` waits for the last save's copy of the
weights (``Job.before_update``), after every micro-batch's forward and backward and before anything
writes the weights."""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from trainer.loop.step import Job, StepFn


class Batches:
    def __init__(self) -> None:
        self.taken = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.taken += 1
        return torch.randn(4, 3), torch.randn(4, 1)


@pytest.mark.parametrize("accum,clip", [(1, None), (3, 1.0)])
def test_the_optimizer_step_waits_after_the_backwards_and_before_the_weights_change(accum: int,
                                                                                    clip: float | None) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    task = SimpleNamespace(optimizer=opt, scheduler=None,
                           loss_fn=lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]))
    batches = Batches()
    seen: list[tuple[int, bool, bool]] = []  # at each call: batches taken, grads there, weights as before
    before = [p.detach().clone() for p in model.parameters()]

    def before_update() -> bool:
        seen.append((batches.taken, all(p.grad is not None for p in model.parameters()),
                     all(torch.equal(p, b) for p, b in zip(model.parameters(), before))))
        return True

    job = Job(task, model, None, batches, None, {}, accum, SimpleNamespace(distributed=False), in_place=False,
              before_update=before_update)
    step = StepFn(SimpleNamespace(grad_clip=clip), job, SimpleNamespace(scaler=None, autocast=contextlib.nullcontext),
                  torch.device("cpu"))
    step()
    assert seen == [(accum, True, True)]  # once, after the last backward, the weights untouched
    assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    before = [p.detach().clone() for p in model.parameters()]
    step()
    assert seen[1] == (2 * accum, True, True)
