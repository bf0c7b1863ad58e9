"""Load the exported weights into your own model class; its accuracy on images it never saw.

    python examples/cnn/evaluate.py cnn.safetensors [--images N]

Needs only torch and safetensors (not spottrain): the export is a plain state dict. The model's
and the data's sizes come from the sidecar (``cnn.json``, written next to the weights by
``python -m trainer export``): the run's ``task_args``, where a size the run left out is the
default that ``ResNet`` and ``Shapes`` share with ``shapes.task.build``.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from shapes.data import Shapes
from shapes.model import ResNet


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("weights", type=Path, help="FILE.safetensors from `python -m trainer export`")
    p.add_argument("--images", type=int, default=2000, help="held-out images to classify")
    a = p.parse_args()

    sidecar = json.loads(a.weights.with_suffix(".json").read_text())  # step, task_args, digest...
    args = sidecar["task_args"]
    model = ResNet(**{k: args[k] for k in ("width", "blocks") if k in args})
    model.load_state_dict(load_file(a.weights), strict=True)  # every weight and batch-norm buffer
    model.eval()  # batch norm now uses the running statistics that came with the weights

    data = Shapes(a.images, split="eval", **{k: args[k] for k in ("image_size",) if k in args})
    correct = 0
    with torch.no_grad():
        for start in range(0, len(data), 250):
            images, labels = zip(*(data[i] for i in range(start, min(start + 250, len(data)))))
            correct += int((model(torch.stack(images)).argmax(1) == torch.stack(labels)).sum())
    print(f"step {sidecar['step']}: accuracy {correct / len(data):.3f} on {len(data)} held-out images "
          f"(chance: {1 / 8:.3f})")


if __name__ == "__main__":
    main()
