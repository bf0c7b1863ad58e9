"""The host copy of one rank's shards that a sharded save writes from (``trainer.checkpoint.sharded``).

``torch.distributed.checkpoint``'s ``StateDictStager`` copies a state dict (DTensors included)
into host buffers that it keeps and reuses from one copy to the next: pinned under CUDA, where
pinning a checkpoint's worth of memory at every save would cost more than the copy itself. This
module owns one stager for the whole run and closes it once, at the end.

Not through DCP's ``DefaultStager``: in the PyTorch releases before 2.13 its ``_stage`` closes
the stager after every copy, which drops the kept buffers and empties the stager's copy table,
so that the next copy of a state dict (its DTensors' placements hold class objects) fails with
``KeyError: <class 'type'>``: an FSDP run on CUDA failed at its second save. Should a stager be
emptied anyway, the next copy starts a fresh one rather than fail.

A PyTorch without ``StateDictStager`` cannot stage sharded saves: ``unavailable()`` says why, and
the trainer refuses ``parallelism = "fsdp"`` there as bad input.
"""
from __future__ import annotations

from typing import Any

import torch


class Unsupported(Exception):
    """This PyTorch cannot stage sharded saves (bad input for ``parallelism = "fsdp"``: exit 2)."""


def _stager_class() -> Any:
    try:
        from torch.distributed.checkpoint._state_dict_stager import StateDictStager
    except ImportError:
        return None
    return StateDictStager


def unavailable() -> str | None:
    """Why this PyTorch cannot make the host copy, or None when it can."""
    if _stager_class() is None:
        return (f"PyTorch {torch.__version__} has no torch.distributed.checkpoint StateDictStager, which "
                "sharded saves stage the shards with")
    return None


class HostCopy:
    """Copies of a state dict in host memory, into the same buffers each time.

    A copy stays valid until the next ``copy()``: the caller writes one out before taking the
    next (``ShardedCheckpointer`` keeps one save in flight at a time)."""

    def __init__(self, *, cuda: bool) -> None:
        cls = _stager_class()
        if cls is None:
            raise RuntimeError(unavailable())
        self._cuda = cuda
        self._new = lambda: cls(pin_memory=cuda, share_memory=False)
        self._stager = self._new()

    def copy(self, state_dict: Any) -> Any:
        """``state_dict`` with every tensor copied to the host (DTensors keep their layout)."""
        if getattr(self._stager, "_deepcopy_dispatch", True) == {}:  # closed by someone: unusable
            self._stager = self._new()
        staged = self._stager.stage(state_dict, non_blocking=self._cuda)
        if self._cuda:
            torch.cuda.synchronize()  # the non-blocking copies are done before anyone reads them
        return staged

    def close(self) -> None:
        """Release the host buffers (and unpin them)."""
        self._stager.close()
