"""A diffusion denoiser trained with an EMA of its weights, from streaming webdataset shards.

The shape of a diffusers training script at a small size: a UNet-like network predicts the noise
added at a random timestep of a cosine schedule; an EMA of its weights (torch's
``AveragedModel`` with ``get_ema_multi_avg_fn``, what diffusers' ``EMAModel`` computes) is updated
after every optimizer step and is the model one ships. The data stream from tar shards
(``shards.py`` writes them; on a VM the experiment's ``[data]`` stages them to ``ctx.data_dir``),
split over ranks and data workers by webdataset itself.

Data larger than the VM's disk streams from the bucket instead, with no local copy: the
experiment's ``[data] source = "gs://BUCKET/PREFIX/shard-{000000..000007}.tar"`` with
``stream = true`` (the trainer's ``--data-url``, ``ctx.data_url``), or ``task_args.data_url``
(upload what ``shards.py`` writes with ``gcloud storage cp DIR/*.tar gs://BUCKET/PREFIX/``). The shards are
checked to be there before training (a missing one: exit 2, one line) and read by each data worker
through the trainer's own Cloud Storage client in ranged reads of ``read_chunk_bytes`` (8 MiB),
retried from the byte offset (``trainer.data.bucket_shards``). The resume is as exact as from a
local directory. The VM's service account needs read on that bucket (docs/porting.md).

What makes it a spottrain job: the EMA is declared by name (``states={"ema": ema}``: saved,
restored, exported as ``model-ema.safetensors``), the EMA update runs in the task's ``step`` after
the optimizer's, and the dataset is an ``IterableDataset``, whose exact position per rank the
trainer keeps through torchdata's ``StatefulDataLoader``.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from trainer.task import Task, TaskContext


class Block(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(cin, cout, 3, padding=1), nn.Conv2d(cout, cout, 3, padding=1)
        self.norm1, self.norm2 = nn.GroupNorm(4, cout), nn.GroupNorm(4, cout)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.silu(self.norm1(self.conv1(x)))
        return torch.nn.functional.silu(self.norm2(self.conv2(h))) + self.skip(x)


class UNet(nn.Module):
    """Two levels down and up, the timestep as an extra input channel; ``blocks`` per level."""

    def __init__(self, width: int = 16, blocks: int = 1):
        super().__init__()
        self.inp = nn.Conv2d(2, width, 3, padding=1)
        self.down1 = nn.Sequential(*[Block(width, width) for _ in range(blocks)])
        self.down2 = nn.Sequential(Block(width, 2 * width), *[Block(2 * width, 2 * width) for _ in range(blocks - 1)])
        self.up1 = nn.Sequential(Block(3 * width, width), *[Block(width, width) for _ in range(blocks - 1)])
        self.out = nn.Conv2d(width, 1, 3, padding=1)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = self.inp(torch.cat([x, t.view(-1, 1, 1, 1).expand_as(x)], 1))
        d1 = self.down1(h)
        d2 = self.down2(torch.nn.functional.avg_pool2d(d1, 2))
        u = torch.nn.functional.interpolate(d2, scale_factor=2)
        return self.out(self.up1(torch.cat([u, d1], 1)))


def shards(where: Path | str, read_chunk_bytes: int | None = None) -> torch.utils.data.IterableDataset:
    """The stream of images: ``where`` is a local directory of ``shard-*.tar``, or a ``gs://`` URL
    of the shards (``gs://BUCKET/PREFIX/shard-{000000..000007}.tar``), read from the bucket."""
    import webdataset as wds

    if str(where).startswith("gs://"):
        from trainer.data import bucket_shards

        urls = bucket_shards.urls(str(where))  # every shard there, or one line naming the missing
        bucket_shards.register(chunk_bytes=read_chunk_bytes)  # webdataset opens gs:// with the trainer's client
    else:
        urls = sorted(str(p) for p in Path(where).glob("shard-*.tar"))
        if not urls:
            raise FileNotFoundError(f"no shard-*.tar in {where} (python examples/diffusion/shards.py DIR)")
    return (wds.WebDataset(urls, shardshuffle=False, nodesplitter=wds.split_by_node,
                           workersplitter=wds.split_by_worker, empty_check=False)
            .map(lambda s: (torch.from_numpy(np.frombuffer(s["img.f32"], dtype=np.float32).copy()).view(1, 16, 16),)))


def alpha_bar(t: torch.Tensor) -> torch.Tensor:
    return torch.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2


def build(ctx: TaskContext, *, width: int = 16, blocks: int = 1, lr: float = 2e-3, ema_decay: float = 0.99,
          shards_dir: str | None = None, data_url: str | None = None, read_chunk_bytes: int | None = None) -> Task:
    model = UNet(width, blocks).to(ctx.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(ema_decay))

    def step(s, batch):  # type: ignore[no-untyped-def]
        x0 = batch[0]
        t = torch.rand(x0.size(0), device=x0.device)
        noise = torch.randn_like(x0)
        a = alpha_bar(t).view(-1, 1, 1, 1)
        with s.autocast():
            loss = torch.nn.functional.mse_loss(s.model(a.sqrt() * x0 + (1 - a).sqrt() * noise, t), noise)
        s.backward(loss)
        s.step("optimizer")
        if s.last:
            ema.update_parameters(model)  # after the optimizer's step, as diffusers' training scripts do
        return loss

    where: Path | str | None = data_url or ctx.data_url or (Path(shards_dir) if shards_dir else ctx.data_dir)
    if where is None:
        raise ValueError("denoiser: give task_args.data_url (gs://...) or shards_dir, or the experiment's [data] "
                         "(staged, or streamed with stream = true)")
    return Task(model=model, optimizer=optimizer, dataset=shards(where, read_chunk_bytes), step=step,
                states={"ema": ema},
                info={"example": "diffusion"})
