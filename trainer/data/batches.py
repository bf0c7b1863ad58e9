"""Micro-batches in the trainer's order, loaded in the training process or by worker processes.

``Batches.next()`` returns this rank's next micro-batch on the device and advances the data
position (``DataOrder.consumed``, the one integer a checkpoint keeps). With ``workers`` > 0 a
torch DataLoader prefetches: its batch sampler reads the same order from the position the loop
had when the loader started (after the restore), two batches ahead per worker, pinned on CUDA.
Batches the workers prepared beyond what the loop took are never counted: the position moves only
when ``next()`` hands a batch to the loop, so a checkpoint, and with it a resume, is the same with
or without workers, and so are the weights (the same samples, collated by the same function, in
the same order).

Workers are forked (no re-import of torch and the task per worker, which would add seconds to
every restart), ignore SIGTERM/SIGINT (the trainer decides when to stop; systemd signals the whole
unit), and die with the trainer (PR_SET_PDEATHSIG) if it is killed. ``stop()`` kills them at once
(they hold nothing worth waiting for) so that a preemption notice never waits on a worker busy
with a slow sample; ``close()`` releases the queues and threads afterwards.
"""
from __future__ import annotations

import contextlib
import copy
import ctypes
import logging
import signal
from typing import Any, Iterator

import torch

from trainer.data.sampler import DataOrder

PREFETCH_PER_WORKER = 2


def fetch(dataset: Any, indices: list[int]) -> tuple:
    """The collated micro-batch of ``indices``: exactly what a DataLoader worker makes of them."""
    getitems = getattr(dataset, "__getitems__", None)
    samples = getitems(indices) if getitems is not None else [dataset[i] for i in indices]
    batch = torch.utils.data.default_collate(samples)
    return tuple(batch) if isinstance(batch, (list, tuple)) else (batch,)


class _OrderSampler:
    """A batch sampler over the trainer's order, from position ``start`` on, without end."""

    def __init__(self, order: DataOrder, start: int):
        self.order, self.start = copy.copy(order), start  # its own copy: its epoch cache runs ahead

    def __iter__(self) -> Iterator[list[int]]:
        pos = self.start
        while True:
            yield self.order.indices_at(pos)
            pos += self.order.stride


class _Collate:
    def __call__(self, samples: list) -> tuple:
        batch = torch.utils.data.default_collate(samples)
        return tuple(batch) if isinstance(batch, (list, tuple)) else (batch,)


def _worker_init(_: int) -> None:
    # The trainer alone decides when to stop: a SIGTERM to the whole unit must not kill a worker
    # under a step in flight (the trainer kills its workers itself once it stops).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(Exception):  # Linux: die with the trainer, even on SIGKILL
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Batches:
    """This rank's micro-batches; see the module docstring."""

    def __init__(self, dataset: Any, order: DataOrder, *, workers: int, device: torch.device, seed: int = 0,
                 log: logging.Logger | None = None):
        self.dataset, self.order, self.workers, self.device = dataset, order, workers, device
        self.seed = seed
        self.log = log or logging.getLogger("trainer.data")
        self._iter: Any = None
        self._from = -1  # the position the workers' sampler started at

    def _start(self) -> None:
        pin = self.device.type == "cuda"
        g = torch.Generator()  # the loader's own: drawing its base seed must not move the global RNG
        g.manual_seed(self.seed)
        loader = torch.utils.data.DataLoader(
            self.dataset, batch_sampler=_OrderSampler(self.order, self.order.consumed), num_workers=self.workers,
            collate_fn=_Collate(), pin_memory=pin, prefetch_factor=PREFETCH_PER_WORKER, worker_init_fn=_worker_init,
            multiprocessing_context="fork", generator=g)
        self._iter, self._from = iter(loader), self.order.consumed
        self._taken = 0
        self.log.info("event=data_workers workers=%d from=%d pids=%s", self.workers, self._from,
                      ",".join(map(str, self.pids())))

    def next(self) -> tuple:
        """The next micro-batch on the device; advances the position by one global micro-batch."""
        if self.workers == 0:
            batch = fetch(self.dataset, self.order.indices_at(self.order.consumed))
        else:
            if self._iter is None or self._from + self._taken * self.order.stride != self.order.consumed:
                self.close()  # first batch, or the position moved under us: start from it
                self._start()
            batch = next(self._iter)
            self._taken += 1
        self.order.consumed += self.order.stride
        return tuple(b.to(self.device, non_blocking=True) if torch.is_tensor(b) else b for b in batch)

    def pids(self) -> list[int]:
        return [w.pid for w in getattr(self._iter, "_workers", [])]

    def stop(self) -> None:
        """Kill the workers now (a notice: nothing they hold is worth a second of the save)."""
        it = self._iter
        if it is None:
            return
        # Deregister first: the loader's SIGCHLD handler would take a killed worker for a crash.
        if getattr(it, "_worker_pids_set", False):
            from torch.utils.data._utils import signal_handling

            with contextlib.suppress(Exception):
                signal_handling._remove_worker_pids(id(it))
            it._worker_pids_set = False
        workers = list(getattr(it, "_workers", []))
        for w in workers:
            with contextlib.suppress(Exception):
                w.kill()
        for w in workers:
            with contextlib.suppress(Exception):
                w.join(timeout=5)

    def close(self) -> None:
        """Stop the workers and release the loader's queues and threads."""
        self.stop()
        it, self._iter = self._iter, None
        if it is not None and hasattr(it, "_shutdown_workers"):
            with contextlib.suppress(Exception):
                it._shutdown_workers()
