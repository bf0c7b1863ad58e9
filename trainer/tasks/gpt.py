"""The bundled default task: a small GPT, over the shipped character corpus or token shards.

Small enough to train a few hundred steps on one CPU thread in seconds, real enough to exercise
everything the trainer restores: AdamW moments, a warmup+cosine LR schedule, dropout RNG.
``task_args`` scale it (``n_layer``, ``n_head``, ``n_embd``, ``block_size``), e.g. for the bench.

By default it trains on the shipped corpus, character-level, holding out its last
``eval_fraction`` for evaluation. With ``data`` it trains on nanoGPT-format token shards
(``trainer.data.token_shards``) instead: ``data = "train.bin"`` and ``eval_data = "val.bin"`` (a
file, a directory of ``.bin`` files or a glob, relative to the staged ``ctx.data_dir`` unless
absolute), ``token_dtype`` (``uint16`` or ``uint32``), ``vocab_size`` (default 50304, GPT-2's
vocabulary padded) and ``stride``.
"""
from __future__ import annotations

import math
from importlib import resources

import torch
import torch.nn as nn
from torch.nn import functional as F

from trainer.task import Task, TaskContext, TaskError
from trainer.data.token_shards import TokenShardError, TokenShards, find_shards


class CharDataset:
    """Windows of ``block_size + 1`` characters, one every ``stride`` characters: (x, y) pairs."""

    def __init__(self, text: str, block_size: int, stride: int, chars: list[str] | None = None):
        chars = chars or sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(chars)}
        self.vocab_size = len(chars)
        self.data = torch.tensor([self.stoi[c] for c in text], dtype=torch.long)
        self.block_size = block_size
        self.stride = stride

    def __len__(self) -> int:
        return max(0, (len(self.data) - self.block_size - 1) // self.stride + 1)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.stride : i * self.stride + self.block_size + 1]
        return chunk[:-1], chunk[1:]


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = nn.MultiheadAttention(n_embd, n_head, dropout=dropout, batch_first=True)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd), nn.Dropout(dropout)
        )
        mask = torch.triu(torch.ones(block_size, block_size, dtype=torch.bool), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.size(1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=self.mask[:t, :t], need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int, dropout: float):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, block_size, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def build(
    ctx: TaskContext,
    *,
    n_layer: int = 2,
    n_head: int = 4,
    n_embd: int = 64,
    block_size: int = 64,
    stride: int = 32,
    dropout: float = 0.1,
    lr: float = 3e-3,
    weight_decay: float = 0.1,
    warmup_steps: int = 20,
    eval_fraction: float = 0.1,
    data: str | None = None,
    eval_data: str | None = None,
    token_dtype: str = "uint16",
    vocab_size: int = 50304,
) -> Task:
    eval_dataset: object | None
    if data is None:
        text = resources.files("trainer").joinpath("data/corpus.txt").read_text(encoding="utf-8")
        cut = int(len(text) * (1 - eval_fraction))
        chars = sorted(set(text))  # the vocabulary of the whole corpus, so that both splits share it
        dataset = CharDataset(text[:cut], block_size, stride, chars)
        eval_dataset = CharDataset(text[cut:], block_size, block_size, chars) if eval_fraction > 0 else None
        vocab_size = dataset.vocab_size
    else:
        try:
            dataset = TokenShards(find_shards(data, ctx.data_dir), block_size=block_size, dtype=token_dtype,
                                  stride=stride, vocab_size=vocab_size)
            eval_dataset = (TokenShards(find_shards(eval_data, ctx.data_dir), block_size=block_size,
                                        dtype=token_dtype, vocab_size=vocab_size) if eval_data is not None else None)
        except TokenShardError as e:
            raise TaskError(f"task_args: data: {e}") from None
    model = GPT(vocab_size, block_size, n_layer, n_head, n_embd, dropout).to(ctx.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)

    def lr_factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, ctx.steps - warmup_steps))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    params = sum(p.numel() for p in model.parameters())
    return Task(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        dataset=dataset,
        eval_dataset=eval_dataset,
        tokens_per_sample=block_size,
        info={"params": params, "vocab": vocab_size, "samples": len(dataset)},
    )
