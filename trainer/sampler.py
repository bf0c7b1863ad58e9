"""The data order: a deterministic permutation per epoch, and a position in global samples.

The sample stream is epoch 0's permutation, then epoch 1's, ...; each permutation is a pure
function of (seed, epoch). The position is the number of samples the whole job (all ranks) has
consumed, so resuming is just restoring one integer, and the order never depends on how often a
run was interrupted. Each global micro-batch of ``batch_size * world_size`` samples is split into
contiguous per-rank slices.
"""
from __future__ import annotations

import torch


def permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    g = torch.Generator()
    # Mix seed and epoch so that (seed, epoch+1) and (seed+1, epoch) give unrelated orders.
    g.manual_seed((seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9) % (2**63))
    return torch.randperm(n, generator=g)


class DataOrder:
    def __init__(self, n: int, *, seed: int, batch_size: int, rank: int = 0, world_size: int = 1):
        self.n, self.seed, self.batch_size = n, seed, batch_size
        self.rank, self.world_size = rank, world_size
        self.consumed = 0  # global samples consumed so far: the resumable position
        self._epoch = -1
        self._perm: torch.Tensor | None = None

    @property
    def epoch(self) -> int:
        return self.consumed // self.n

    def _index(self, pos: int) -> int:
        epoch, offset = divmod(pos, self.n)
        if epoch != self._epoch:
            self._perm, self._epoch = permutation(self.n, self.seed, epoch), epoch
        return int(self._perm[offset])  # type: ignore[index]

    def next_indices(self) -> list[int]:
        """This rank's sample indices of the next global micro-batch; advances the position."""
        start = self.consumed + self.rank * self.batch_size
        indices = [self._index(start + i) for i in range(self.batch_size)]
        self.consumed += self.batch_size * self.world_size
        return indices

    def state_dict(self) -> dict:
        return {"consumed": self.consumed, "epoch": self.epoch, "offset": self.consumed % self.n}

    def load_state_dict(self, state: dict) -> None:
        self.consumed = int(state["consumed"])
