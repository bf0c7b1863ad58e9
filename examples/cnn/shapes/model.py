"""A small ResNet for image classification: residual blocks with batch norm. Plain PyTorch.

``ResNet(num_classes, width, blocks)`` maps images ``(N, 3, H, W)`` to logits ``(N, num_classes)``.
Three stages of ``blocks`` residual blocks each, ``width``, ``2 * width`` and ``4 * width``
channels wide, the last two halving the resolution; then global average pooling and a linear head.
Batch norm keeps running statistics in buffers (``running_mean``, ``running_var``,
``num_batches_tracked``): they are part of ``state_dict()``, so checkpoints and the export carry
them, and ``model.eval()`` uses them.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm, added to the input (a 1x1 projection when the shape
    changes)."""

    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, num_classes: int = 8, width: int = 16, blocks: int = 1, in_channels: int = 3):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        layers: list[nn.Module] = []
        c_in = width
        for stage, c_out in enumerate((width, 2 * width, 4 * width)):
            for b in range(blocks):
                layers.append(BasicBlock(c_in, c_out, stride=2 if stage > 0 and b == 0 else 1))
                c_in = c_out
        self.stages = nn.Sequential(*layers)
        self.head = nn.Linear(c_in, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(images))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
