"""Data-parallel plumbing: one process per device under ``torchrun``, a no-op world of one otherwise.

The loop sees a :class:`World` and calls a handful of collectives on it; with one process every
collective returns its input, so the single-process path has no distributed code in it.

Under ``torchrun`` with several nodes (elastic, c10d rendezvous) the world is re-formed after every
node loss or join: the agent restarts its workers, and each new world may have another size and
another rank-to-node mapping. ``node_leader`` (local rank 0) is the one process per VM that runs
the VM's own machinery: the health server, the metadata preemption watcher, and its goodput
ledger. Global rank 0 speaks for the job (logs, DDP checkpoints).
"""
from __future__ import annotations

import ctypes
import datetime
import os
import pickle
import socket
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist


@dataclass
class World:
    rank: int = 0
    local_rank: int = 0
    size: int = 1
    local_size: int = 1
    node_rank: int = 0  # torchrun's GROUP_RANK: this node's index in the current world
    restart_count: int = 0  # torchrun's TORCHELASTIC_RESTART_COUNT: worker-group restarts so far
    #: Bytes this rank sent or received pickled through ``broadcast``: small decisions only. A state
    #: of model size travels as tensors (``trainer.checkpoint.broadcast``); the restore reports this
    #: count, so a regression that pickles one shows in the log and fails a test.
    object_bytes: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_node_leader(self) -> bool:
        return self.local_rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def nodes(self) -> int:
        return max(1, self.size // max(1, self.local_size))

    def any_flags(self, *flags: bool) -> list[bool]:
        """Element-wise OR of boolean flags across ranks (one small all-reduce)."""
        if not self.distributed:
            return list(flags)
        t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32, device=comm_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [bool(v) for v in t.tolist()]

    def max_float(self, value: float) -> float:
        """The largest ``value`` over all ranks."""
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=comm_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank, through pickle: for small values (what
        ``broadcast_object_list`` does, with the bytes counted in ``object_bytes``)."""
        if not self.distributed:
            return obj
        device = comm_device()
        data = pickle.dumps(obj) if self.rank == src else b""
        size = torch.tensor([len(data)], dtype=torch.int64, device=device)
        dist.broadcast(size, src=src)
        n = int(size.item())
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == src
               else torch.empty(n, dtype=torch.uint8)).to(device)
        dist.broadcast(buf, src=src)
        self.object_bytes += n
        if self.rank == src:
            return obj
        host = buf.cpu()
        return pickle.loads(ctypes.string_at(host.data_ptr(), n))

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, indexed by rank, on every rank."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` as a list on rank 0 (None elsewhere)."""
        if not self.distributed:
            return [obj]
        out: list[Any] | None = [None] * self.size if self.is_main else None
        dist.gather_object(obj, out, dst=0)
        return out

    def run_watching(self, work: Callable[[], Any] | None, stop: Callable[[], bool],
                     poll_s: float = 0.25) -> tuple[bool, Any]:
        """Run ``work`` on a thread of every rank that has one (None: nothing to do here) while
        every rank polls ``stop`` (one small all-reduce per poll): (False, rank 0's result on
        every rank) once every rank's work is done, or (True, None) as soon as ``stop()`` is true
        on some rank; the work is then left to itself. An exception in rank 0's work is raised
        on every rank."""
        result: list[Any] = []
        done = threading.Event()

        def run() -> None:
            try:
                result.append(work())  # type: ignore[misc]
            except BaseException as e:  # noqa: BLE001 - raised below, on every rank
                result.append(e)
            finally:
                done.set()

        if work is not None:
            threading.Thread(target=run, name="watched-work", daemon=True).start()
        else:
            done.set()
        while True:
            stopped, busy = self.any_flags(stop(), not done.wait(poll_s))
            if stopped:
                return True, None
            if not busy:
                break
        out = self.broadcast(result[0] if self.is_main and result else None)
        if isinstance(out, BaseException):
            raise out
        return False, out

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def close(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()


def node_name() -> str:
    """This VM's name (in the ledger, the writer lease, logs): ``SPOTTRAIN_NODE`` if set, else the
    host name."""
    return os.environ.get("SPOTTRAIN_NODE") or socket.gethostname()


def comm_device() -> torch.device:
    """Where a collective's tensors live: this rank's GPU under NCCL, the CPU under gloo."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init(timeout_s: float | None = None) -> World:
    """Join the process group when started by torchrun (WORLD_SIZE > 1).

    ``timeout_s`` bounds every collective: a peer that vanished without closing its sockets (a
    VM powered off) then fails the survivors' collective instead of hanging them, so that the
    torchrun agent restarts them into a smaller world.
    """
    env = os.environ
    size = int(env.get("WORLD_SIZE", "1"))
    restarts = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if size <= 1:
        return World(restart_count=restarts)
    rank, local_rank = int(env["RANK"]), int(env.get("LOCAL_RANK", "0"))
    local_size = int(env.get("LOCAL_WORLD_SIZE", "1"))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        # A dead peer raises in the survivors instead of leaving a collective waiting forever.
        env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    kwargs: dict[str, Any] = {}
    if timeout_s is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend=backend, **kwargs)
    return World(rank=rank, local_rank=local_rank, size=size, local_size=local_size,
                 node_rank=int(env.get("GROUP_RANK", "0")), restart_count=restarts)
