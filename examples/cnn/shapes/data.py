"""Images of eight shapes, drawn on the fly: nothing to download, the same pixels on every machine.

Each image is a shape (``CLASSES``) of random size, position, small rotation and colours on a
random background, with noise. Image ``i`` is drawn from a generator seeded with
``(seed, split, i)`` alone, so ``dataset[i]`` is a pure function of ``i``: what the trainer needs
to choose and replay the order itself. The "eval" split draws other images from the same
distribution.
"""
from __future__ import annotations

import math

import torch

CLASSES = ("disk", "ring", "square", "frame", "diamond", "triangle", "plus", "cross")
SPLITS = {"train": 0, "eval": 1}


class Shapes:
    """``len(ds)`` images; ``ds[i]`` is ``(image float32 (3, S, S), label int64)``."""

    def __init__(self, n: int, *, image_size: int = 24, seed: int = 0, split: str = "train"):
        self.n, self.image_size = n, image_size
        self.base = (seed * len(SPLITS) + SPLITS[split]) << 32
        axis = torch.linspace(-1.0, 1.0, image_size)
        self.y, self.x = torch.meshgrid(axis, axis, indexing="ij")

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        g = torch.Generator().manual_seed(self.base + i)
        label = int(torch.randint(len(CLASSES), (1,), generator=g))
        r = torch.rand(9, generator=g)
        size = 0.35 + 0.45 * float(r[0])  # half-width of the shape, as a fraction of the image's
        cx, cy = (float(r[1]) - 0.5) * 2 * (1 - size), (float(r[2]) - 0.5) * 2 * (1 - size)
        angle = (float(r[3]) - 0.5) * math.radians(30)  # +-15 degrees: a square never looks like a diamond
        cos, sin = math.cos(angle), math.sin(angle)
        dx, dy = self.x - cx, self.y - cy
        u, v = (cos * dx + sin * dy) / size, (-sin * dx + cos * dy) / size
        mask = _shape(CLASSES[label], u, v).float()
        background = 0.5 * torch.rand(3, 1, 1, generator=g)
        foreground = 0.5 + 0.5 * torch.rand(3, 1, 1, generator=g)
        image = background + (foreground - background) * mask
        image = image + 0.1 * torch.randn(image.shape, generator=g)
        return (image - 0.5) / 0.25, torch.tensor(label)


def _shape(name: str, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The shape's pixels in its own coordinates (u, v): unit size, centred."""
    au, av = u.abs(), v.abs()
    if name == "disk":
        return u * u + v * v <= 1
    if name == "ring":
        return (u * u + v * v <= 1) & (u * u + v * v >= 0.45)
    if name == "square":
        return torch.maximum(au, av) <= 0.8
    if name == "frame":
        return (torch.maximum(au, av) <= 0.8) & (torch.maximum(au, av) >= 0.5)
    if name == "diamond":
        return au + av <= 1
    if name == "triangle":
        return (v <= 0.8) & (au <= (v + 0.9) * 0.55)
    if name == "plus":
        return ((au <= 0.25) & (av <= 1)) | ((av <= 0.25) & (au <= 1))
    if name == "cross":
        a, b = (u + v).abs() / math.sqrt(2), (u - v).abs() / math.sqrt(2)
        return ((a <= 0.25) & (b <= 1)) | ((b <= 0.25) & (a <= 1))
    raise ValueError(name)
