"""A GAN-shaped task for the sharded layout (issue 29): a generator (the main model) and a
discriminator, each of ``blocks`` linear + LayerNorm blocks, each with its own Adam, alternating
updates in the task's own ``step``, and EMAs of the generator declared in ``Task.states``:
``ema = "averaged"`` (torch's ``AveragedModel`` with ``get_ema_multi_avg_fn``, ``n_averaged``
in its state), ``"plain"`` (a copy of the generator averaged in the step by hand), ``"both"`` or
``"none"``. Under ``parallelism = "fsdp"`` the trainer shards every one of them. ``optim =
"one"``: one Adam over both networks, which the sharded layout refuses (exit 2).

No BatchNorm: FSDP2 keeps buffers whole on every rank and never synchronises them, so running
statistics would differ per rank (docs/porting.md)."""
from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from trainer.task import Task, TaskContext


class Points(torch.utils.data.Dataset):
    """``n`` points on a noisy ring in ``dim`` dimensions, a pure function of the index."""

    def __init__(self, n: int, dim: int):
        self.n, self.dim = n, dim

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        x = torch.randn(self.dim, generator=g)
        return (x / x.norm() + 0.05 * torch.randn(self.dim, generator=g),)


class Net(nn.Module):
    def __init__(self, d_in: int, width: int, d_out: int, blocks: int):
        super().__init__()
        self.inp = nn.Linear(d_in, width)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.GELU())
                                      for _ in range(blocks)])
        self.out = nn.Linear(width, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.inp(x)))


def build(ctx: TaskContext, *, dim: int = 8, nz: int = 8, width: int = 16, blocks: int = 30, lr: float = 1e-3,
          samples: int = 2048, ema: str = "both", optim: str = "two") -> Task:
    netG = Net(nz, width, dim, blocks).to(ctx.device)
    netD = Net(dim, width, 1, blocks).to(ctx.device)
    opt_g = torch.optim.Adam(netG.parameters(), lr=lr, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(netD.parameters(), lr=lr, betas=(0.5, 0.999))
    states: dict[str, Any] = {"D": netD, "opt_d": opt_d}
    if optim == "one":
        opt_g = torch.optim.Adam([*netG.parameters(), *netD.parameters()], lr=lr)
        states = {"D": netD}
    averaged = AveragedModel(netG, multi_avg_fn=get_ema_multi_avg_fn(0.9)) if ema in ("averaged", "both") else None
    plain = copy.deepcopy(netG).requires_grad_(False) if ema in ("plain", "both") else None
    if averaged is not None:
        states["ema"] = averaged
    if plain is not None:
        states["ema_plain"] = plain
    criterion = nn.BCEWithLogitsLoss()

    def step(s: Any, batch: tuple[torch.Tensor]) -> Any:
        G, D = s.models["model"], s.models["D"]
        real = batch[0]
        ones, zeros = torch.ones(real.size(0), 1), torch.zeros(real.size(0), 1)
        noise = torch.randn(real.size(0), nz, device=real.device)
        with s.autocast():
            err_real = criterion(D(real), ones)
        s.backward(err_real)
        fake = G(noise)
        with s.autocast():
            err_fake = criterion(D(fake.detach()), zeros)
        s.backward(err_fake)
        s.step("opt_d")
        with s.autocast():
            err_g = criterion(D(fake), ones)
        s.backward(err_g)
        s.step("optimizer")
        if s.last:
            if averaged is not None:
                averaged.update_parameters(G)  # the sharded generator: DTensor by DTensor
            if plain is not None:
                with torch.no_grad():
                    for pe, pg in zip(plain.parameters(), G.parameters()):
                        pe.lerp_(pg.detach(), 0.2)
        return err_g, {"d_loss": err_real.detach() + err_fake.detach()}

    return Task(model=netG, optimizer=opt_g, dataset=Points(samples, dim), step=step, states=states,
                info={"example": "sharded_gan"})
