"""A user's own task for the issue-10 tests: a tiny GPT whose output head is tied to its token
embedding (as nanoGPT's is), an LR schedule over ``ctx.steps`` or a constant one, and artifacts.

``task_args``: ``n_embd`` (a different width does not fit another run's checkpoint),
``schedule`` ("cosine" over ``ctx.steps`` after a warmup, or "constant"), ``artifacts_every``
(rank 0 writes ``samples/step-N.txt`` every N optimizer steps and ``vocab.txt`` at build; 0: none).
The start-up log line carries ``ctx_steps``, the total the task was built with.
"""
from __future__ import annotations

import math
from importlib import resources

import torch
from torch import nn
from torch.nn import functional as F

from trainer.artifacts import atomic
from trainer.task import Task, TaskContext
from trainer.tasks.gpt import Block, CharDataset


class TiedGPT(nn.Module):
    def __init__(self, vocab: int, block_size: int, n_embd: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList([Block(n_embd, 2, block_size, 0.0)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in nanoGPT

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def build(ctx: TaskContext, n_embd: int = 16, block_size: int = 16, schedule: str = "cosine",
          warmup_steps: int = 3, lr: float = 3e-3, artifacts_every: int = 0) -> Task:
    text = resources.files("trainer").joinpath("data/corpus.txt").read_text(encoding="utf-8")
    data = CharDataset(text[:20000], block_size, block_size)
    model = TiedGPT(data.vocab_size, block_size, n_embd).to(ctx.device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)

    def factor(step: int) -> float:
        if schedule == "constant":
            return 1.0
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, ctx.steps - warmup_steps))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    loss_fn = None
    if artifacts_every and ctx.rank == 0 and ctx.artifacts_dir is not None:
        root = ctx.artifacts_dir
        with atomic(root / "vocab.txt") as tmp:
            tmp.write_text("".join(sorted(data.stoi)), encoding="utf-8")
        calls = [0]

        def loss_fn(m: nn.Module, batch: tuple) -> torch.Tensor:  # one micro-batch = one step here
            calls[0] += 1
            if calls[0] % artifacts_every == 0:
                with atomic(root / "samples" / f"call-{calls[0]:04d}.txt") as tmp:
                    tmp.write_text(f"loss at call {calls[0]}\n")
            return m(*batch)

    return Task(model=model, optimizer=opt, dataset=data, loss_fn=loss_fn,
                scheduler=torch.optim.lr_scheduler.LambdaLR(opt, factor),
                info={"ctx_steps": ctx.steps, "schedule": schedule})
