"""Tasks ported the way users port them, keeping code that a checkpoint would silently miss: the
trainer must refuse each one (exit 2) before anything is saved. ``kind`` picks the port."""
from __future__ import annotations

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from trainer.task import Task, TaskContext


class Pairs(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        x = torch.randn(4, generator=g)
        return x, x.sum(0, keepdim=True)


class NoState:
    """A custom object a job declares, without state_dict()/load_state_dict()."""


def build(ctx: TaskContext, *, kind: str) -> Task:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    second = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt2 = torch.optim.SGD(second.parameters(), lr=1e-2)
    mse = torch.nn.functional.mse_loss
    plain = lambda m, batch: mse(m(batch[0]), batch[1])  # noqa: E731

    if kind == "optimizer_in_loss_fn":  # a GAN port: the second network's update hidden in loss_fn
        def loss_fn(m, batch):  # type: ignore[no-untyped-def]
            x, y = batch
            mse(second(x), y).backward()
            opt2.step()
            opt2.zero_grad()
            return mse(m(x), y)
        return Task(model=model, optimizer=opt, dataset=Pairs(), loss_fn=loss_fn)
    if kind == "ema_hook":  # diffusers' EMAModel pattern: an EMA stepped by an optimizer hook
        ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
        opt.register_step_post_hook(lambda *_: ema.update_parameters(model))
        return Task(model=model, optimizer=opt, dataset=Pairs(), loss_fn=plain, info={"ema": id(ema)})
    if kind == "optimizer_list":
        return Task(model=model, optimizer=[opt, opt2], dataset=Pairs(), loss_fn=plain)  # type: ignore[arg-type]
    if kind == "not_stateful":
        return Task(model=model, optimizer=opt, dataset=Pairs(), states={"noise": NoState()}, loss_fn=plain)
    if kind == "loader_as_dataset":
        return Task(model=model, optimizer=opt, dataset=torch.utils.data.DataLoader(Pairs(), batch_size=4), loss_fn=plain)
    if kind == "unwrapped_step":  # under DDP, the step trains model.module: gradients never all-reduced
        def step(s, batch):  # type: ignore[no-untyped-def]
            x, y = batch
            bare = getattr(s.model, "module", s.model)
            loss = mse(bare(x), y)
            s.backward(loss)
            s.step()
            return loss
        return Task(model=model, optimizer=opt, dataset=Pairs(), step=step)
    raise ValueError(kind)
