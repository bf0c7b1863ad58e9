"""The shapes ResNet as a spottrain task: ``task = "shapes.task:build"`` with this directory as
``trainer.code_dir``.

The trainer calls ``build(ctx, **task_args)`` once per process start, after seeding Python and
torch from ``ctx.seed`` (so the initial weights are the same in every restart), and owns the rest:
the loop, the data order, checkpoints, exact resume. ``task_args`` (``[trainer.config.task_args]``
in the experiment) are the keyword arguments below.
"""
from __future__ import annotations

import math

import torch
from torch.nn import functional as F

from shapes.data import CLASSES, Shapes
from shapes.model import ResNet
from trainer.task import Task, TaskContext


def cross_entropy(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, dict]:
    """The loss of one micro-batch (the model returns logits, the trainer wants the loss) and the
    batch's accuracy, a metric of the task's own: in the step line and TensorBoard as ``acc``."""
    images, labels = batch
    logits = model(images)
    return F.cross_entropy(logits, labels), {"acc": (logits.argmax(dim=1) == labels).float().mean()}


def build(
    ctx: TaskContext,
    *,
    width: int = 16,
    blocks: int = 1,
    image_size: int = 24,
    images: int = 50_000,
    eval_images: int = 1_000,
    lr: float = 3e-3,
    weight_decay: float = 0.05,
    warmup_steps: int = 20,
) -> Task:
    model = ResNet(num_classes=len(CLASSES), width=width, blocks=blocks).to(ctx.device)
    # No weight decay on batch norm and biases (1-D tensors): the usual choice for a ResNet.
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=lr)

    def lr_factor(step: int) -> float:  # warmup, then cosine to a tenth over the job's ctx.steps
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, ctx.steps - warmup_steps))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return Task(
        model=model,
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor),
        dataset=Shapes(images, image_size=image_size, split="train"),
        # Held out: evaluated every `eval_every_steps` without touching the training's randomness.
        eval_dataset=Shapes(eval_images, image_size=image_size, split="eval"),
        loss_fn=cross_entropy,
        info={"params": sum(p.numel() for p in model.parameters()), "classes": len(CLASSES)},
    )
