"""Write the example's webdataset shards: ``python examples/diffusion/shards.py DIR [--shards N]``.

Each sample is a 16x16 grayscale image of soft blobs (a pure function of its index), stored as
raw float32 bytes under ``img.f32`` in POSIX tar shards ``shard-000000.tar``, ... : the layout
webdataset's own ``ShardWriter`` writes, read back with ``webdataset.WebDataset``.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

SIZE = 16


def image(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 + i)
    ys, xs = torch.meshgrid(torch.linspace(0, 1, SIZE), torch.linspace(0, 1, SIZE), indexing="ij")
    img = torch.zeros(SIZE, SIZE)
    for _ in range(3):
        cx, cy, r = torch.rand(3, generator=g).tolist()
        img += torch.exp(-((xs - cx) ** 2 + (ys - cy) ** 2) / (0.02 + 0.05 * r))
    return (img / img.max() * 2 - 1).float()


def write(directory: Path, shards: int = 8, per_shard: int = 64) -> list[Path]:
    import webdataset as wds

    directory.mkdir(parents=True, exist_ok=True)
    with wds.ShardWriter(str(directory / "shard-%06d.tar"), maxcount=per_shard, verbose=0) as sink:
        for i in range(shards * per_shard):
            sink.write({"__key__": f"{i:08d}", "img.f32": image(i).numpy().tobytes()})
    return sorted(directory.glob("shard-*.tar"))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dir", type=Path)
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--per-shard", type=int, default=64)
    a = p.parse_args()
    print("\n".join(str(x) for x in write(a.dir, a.shards, a.per_shard)))
