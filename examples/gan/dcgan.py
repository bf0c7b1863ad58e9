"""A DCGAN as a spottrain task: two networks, two Adams, alternating updates, its own step.

The generator and discriminator are pytorch/examples' DCGAN at a small image size (``image_size``
16 or 32), with ``blocks`` extra conv + batch-norm layers in each (their depth, for tests at real
sizes). The data are synthetic images (a bright disc at a position and radius drawn from the
sample's index), so the example needs no download.

What makes it a GAN job rather than one model and one optimizer: the task declares the
discriminator and its optimizer by name in ``states``, and its ``step`` runs the alternation the
way the DCGAN example writes it (discriminator on real, then on fake, step it; generator through
the discriminator, step it), calling the models it is handed: under DDP on several ranks they are
the wrappers, which all-reduce each network's gradients. The trainer keeps the data order, the
precision, clipping, checkpoints and the emergency save.

    python -m trainer run --task dcgan:build --steps 200 --run-dir run   # with examples/gan on PYTHONPATH
"""
from __future__ import annotations

import math

import torch
from torch import nn

from trainer.task import Task, TaskContext


class Discs(torch.utils.data.Dataset):
    """``n`` grayscale images of one disc each, a pure function of the index."""

    def __init__(self, n: int, image_size: int):
        self.n, self.size = n, image_size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        cx, cy, r = (torch.rand(3, generator=g) * torch.tensor([0.5, 0.5, 0.2]) + torch.tensor([0.25, 0.25, 0.1])).tolist()
        ys, xs = torch.meshgrid(torch.linspace(0, 1, self.size), torch.linspace(0, 1, self.size), indexing="ij")
        img = ((xs - cx) ** 2 + (ys - cy) ** 2 < r * r).float() * 2 - 1
        return (img.unsqueeze(0),)


def _extra(ch: int, blocks: int) -> list[nn.Module]:
    out: list[nn.Module] = []
    for _ in range(blocks):
        out += [nn.Conv2d(ch, ch, 3, 1, 1, bias=False), nn.BatchNorm2d(ch), nn.LeakyReLU(0.2)]
    return out


class Generator(nn.Module):
    def __init__(self, nz: int = 16, ngf: int = 16, image_size: int = 16, blocks: int = 0):
        super().__init__()
        ups = int(math.log2(image_size)) - 2  # 4x4 -> image_size
        layers: list[nn.Module] = [nn.ConvTranspose2d(nz, ngf * 2 ** (ups - 1), 4, 1, 0, bias=False),
                                   nn.BatchNorm2d(ngf * 2 ** (ups - 1)), nn.ReLU(True)]
        for i in range(ups - 1, 0, -1):
            layers += [nn.ConvTranspose2d(ngf * 2 ** i, ngf * 2 ** (i - 1), 4, 2, 1, bias=False),
                       nn.BatchNorm2d(ngf * 2 ** (i - 1)), nn.ReLU(True)]
        layers += _extra(ngf, blocks)
        layers += [nn.ConvTranspose2d(ngf, 1, 4, 2, 1, bias=False), nn.Tanh()]
        self.main = nn.Sequential(*layers)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.main(z)


class Discriminator(nn.Module):
    def __init__(self, ndf: int = 16, image_size: int = 16, blocks: int = 0):
        super().__init__()
        downs = int(math.log2(image_size)) - 2
        layers: list[nn.Module] = [nn.Conv2d(1, ndf, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True)]
        layers += _extra(ndf, blocks)
        for i in range(downs - 1):
            layers += [nn.Conv2d(ndf * 2 ** i, ndf * 2 ** (i + 1), 4, 2, 1, bias=False),
                       nn.BatchNorm2d(ndf * 2 ** (i + 1)), nn.LeakyReLU(0.2, inplace=True)]
        layers += [nn.Conv2d(ndf * 2 ** (downs - 1), 1, 4, 1, 0, bias=False)]
        self.main = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.main(x).view(-1)


def gan_step(s, batch):  # type: ignore[no-untyped-def]
    """One DCGAN iteration, as pytorch/examples writes it, on the models the trainer hands over."""
    netG, netD = s.models["model"], s.models["D"]
    real = batch[0]
    criterion = nn.BCEWithLogitsLoss()
    noise = torch.randn(real.size(0), netG_nz(netG), 1, 1, device=real.device)
    # (1) the discriminator: maximize log(D(x)) + log(1 - D(G(z)))
    with s.autocast():
        err_real = criterion(netD(real), torch.ones(real.size(0), device=real.device))
    s.backward(err_real)
    fake = netG(noise)
    with s.autocast():
        err_fake = criterion(netD(fake.detach()), torch.zeros(real.size(0), device=real.device))
    s.backward(err_fake)
    s.step("opt_d")
    # (2) the generator: maximize log(D(G(z)))
    with s.autocast():
        err_g = criterion(netD(fake), torch.ones(real.size(0), device=real.device))
    s.backward(err_g)
    s.step("optimizer")
    return err_g, {"d_loss": err_real.detach() + err_fake.detach()}


def netG_nz(netG: nn.Module) -> int:
    return getattr(netG, "module", netG).main[0].in_channels


def build(ctx: TaskContext, *, nz: int = 16, ngf: int = 16, ndf: int = 16, image_size: int = 16, blocks: int = 0,
          lr: float = 2e-4, samples: int = 4096) -> Task:
    netG = Generator(nz, ngf, image_size, blocks).to(ctx.device)
    netD = Discriminator(ndf, image_size, blocks).to(ctx.device)
    opt_g = torch.optim.Adam(netG.parameters(), lr=lr, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(netD.parameters(), lr=lr, betas=(0.5, 0.999))
    return Task(model=netG, optimizer=opt_g, dataset=Discs(samples, image_size), step=gan_step,
                states={"D": netD, "opt_d": opt_d}, info={"example": "dcgan"})
