"""A state of model size from one rank to every rank: its structure as JSON, its tensors as tensors.

A restored checkpoint's tensors are views into one buffer (``whole_model.load_dir``), and pickling a
view serializes its whole storage: ``broadcast_object_list`` of such a state sends (number of
tensors) x (checkpoint size), terabytes for a real DDP job. So nothing of model size goes through
pickle between ranks. The source rank encodes the state as a checkpoint's ``state.json`` holds it
and its ``tensors.bin`` lays it out (``whole_model.encode_state``: plain data, a table of each
tensor's dtype, shape and offset; no pickle on either side); every other rank allocates that byte
arena once, receives the tensors' bytes into it with ``dist.broadcast``, in chunks of at most
``CHUNK`` bytes and a sixteenth of the state, and decodes it as a restore from disk does
(``whole_model.decode_state``).

Peak memory: a receiving rank holds the arena (one copy of the state) and, under NCCL, one chunk on
the device; the source holds its state as restored plus one chunk it packs the tensors' bytes into.
Tensors come back on CPU, contiguous, as views into the arena, as a restore from disk gives them.

``broadcast_state(world, state, src)`` is a collective: every rank of ``world`` calls it, and only
``src``'s ``state`` is read.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from trainer.checkpoint import state_codec, whole_model
from trainer.distributed import comm_device

#: Bytes sent per collective: at most CHUNK (a GiB is 16 calls) and at most a sixteenth of the
#: state (at least MIN_CHUNK), so the source's packing buffer (and a chunk on the device under
#: NCCL) stays noise beside the state at any size.
CHUNK = 64 << 20
MIN_CHUNK = 1 << 20


@dataclasses.dataclass(frozen=True)
class Sent:
    """What one ``broadcast_state`` moved: the structure's bytes (JSON, through the object channel)
    and the tensors' bytes (through ``dist.broadcast``)."""

    structure_bytes: int
    tensor_bytes: int
    tensors: int


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat uint8 tensor (a view when ``t`` is contiguous on CPU)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8)


def broadcast_state(world: Any, state: Any, src: int = 0) -> tuple[Any, Sent]:
    """``src``'s ``state`` on every rank (``src`` keeps its own objects), and what was sent. A
    state that is not plain data raises ``state_codec.NotPlainData`` on ``src`` before anything is
    sent; the other ranks then raise it too (they learn of it through the header)."""
    if not world.distributed:
        return state, Sent(0, 0, 0)
    header: bytes | str = b""
    found: list[torch.Tensor] = []
    table: list[Any] = []
    size = 0
    if world.rank == src:
        try:
            header, found, table, size = whole_model.encode_state(state)
        except state_codec.NotPlainData as e:
            header = f"error: {e}"
    header, size, count = world.broadcast((header, size, len(table)), src=src)
    if isinstance(header, str):
        raise state_codec.NotPlainData(header.removeprefix("error: "))
    device = comm_device()
    mine = world.rank == src
    arena = None if mine else torch.empty(max(size, 1), dtype=torch.uint8)
    step = min(CHUNK, max(MIN_CHUNK, size // 16))
    chunk = torch.empty(min(step, max(size, 1)), dtype=torch.uint8, device=device) \
        if (mine or device.type != "cpu") and size else None
    # Walk the arena in chunks; the source packs each chunk from the tensors that overlap it (the
    # others receive whole chunks: they need only the size).
    spans = [(row[0], row[1]) for row in table]
    k = 0  # the first tensor that may overlap the current chunk
    cached: tuple[int, torch.Tensor] | None = None  # a tensor spanning chunks is made bytes once
    for a in range(0, size, step):
        b = min(size, a + step)
        if mine:
            assert chunk is not None
            view = chunk[: b - a]
            while k < len(spans) and spans[k][0] + spans[k][1] <= a:
                k += 1
            j = k
            while j < len(spans) and spans[j][0] < b:
                off, nbytes = spans[j]
                lo, hi = max(a, off), min(b, off + nbytes)
                if hi > lo:
                    if cached is None or cached[0] != j:
                        cached = (j, _bytes_of(found[j]))
                    view[lo - a:hi - a].copy_(cached[1][lo - off:hi - off])
                j += 1
            dist.broadcast(view, src=src)
        elif chunk is None:  # gloo on CPU: straight into the arena
            assert arena is not None
            dist.broadcast(arena[a:b], src=src)
        else:  # NCCL: through the device, then into the arena
            assert arena is not None
            dist.broadcast(chunk[: b - a], src=src)
            arena[a:b].copy_(chunk[: b - a])
    sent = Sent(structure_bytes=len(header), tensor_bytes=size, tensors=count)
    if mine:
        return state, sent
    assert arena is not None
    return whole_model.decode_state(header, arena, size), sent
