"""Data-parallel plumbing: one process per device under ``torchrun``, a no-op world of one otherwise.

The loop sees a :class:`World` and calls a handful of collectives on it; with one process every
collective returns its input, so the single-process path has no distributed code in it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class World:
    rank: int = 0
    local_rank: int = 0
    size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def any_flags(self, *flags: bool) -> list[bool]:
        """Element-wise OR of boolean flags across ranks (one small all-reduce)."""
        if not self.distributed:
            return list(flags)
        t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32, device=_comm_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [bool(v) for v in t.tolist()]

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.distributed:
            return obj
        box = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=0, device=_comm_device())
        return box[0]

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` as a list on rank 0 (None elsewhere)."""
        if not self.distributed:
            return [obj]
        out: list[Any] | None = [None] * self.size if self.is_main else None
        dist.gather_object(obj, out, dst=0)
        return out

    def scatter(self, objs: list[Any] | None) -> Any:
        """Rank r receives ``objs[r]`` from rank 0."""
        if not self.distributed:
            return objs[0]  # type: ignore[index]
        out: list[Any] = [None]
        dist.scatter_object_list(out, objs if self.is_main else None, src=0)
        return out[0]

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def close(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()


def _comm_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init() -> World:
    """Join the process group when started by torchrun (WORLD_SIZE > 1)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend=backend)
    return World(rank=rank, local_rank=local_rank, size=size)
