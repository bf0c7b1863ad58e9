"""Streaming data: an ``IterableDataset`` read in its own order, its exact position kept per rank.

Webdataset shards, a Hugging Face streaming dataset or files read from the bucket have no length
and no index: the trainer cannot choose their order (``trainer.data.sampler``), so it keeps their
position instead: the epoch and the batches handed out in it. A dataset with a position of its own
(``state_dict()``/``load_state_dict()``: Hugging Face ``datasets``' streaming datasets) is read
through torchdata's ``StatefulDataLoader``, whose ``state_dict()`` holds the dataset's position in
every worker, and a resume jumps there. A stream without one (webdataset keeps no position) is
replayed to it: a fresh loader reads the epoch from its start and the batches before the position
are dropped, which is exact for a stream that is a function of its shards and seed, and costs the
reading of those batches. (torchdata's own fast-forward for such datasets counts the replayed
batches again at the next save, so the trainer counts them itself.)

``Stream`` is what the loop and an own loop take micro-batches from, like ``Batches``: ``next()``
returns this rank's next micro-batch on the device. Its state (the epoch and the loader's position)
differs on every rank (``per_rank``): a checkpoint holds one per rank, so a resume keeps the world
size (``trainer.loop.state`` refuses another). Splitting the stream over ranks and workers is the
dataset's (webdataset's ``split_by_node``/``split_by_worker``, ``datasets.distributed
.split_dataset_by_node``), as in any torch job. At the end of the stream the next epoch starts
(``set_epoch(epoch)`` is called on a dataset that has it).

Workers are forked (no re-import of torch per worker) and ignore SIGTERM, as ``Batches``' are.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch

from trainer.data.batches import _Collate, _worker_init, kill_workers


class StreamError(Exception):
    """The stream cannot be read the way a resume needs (bad input: exit 2)."""


def worker_line(text: str) -> str:
    """An error's message, also of one raised in a data worker: torch re-raises it in the main
    process as ``Type(text)``, ``text`` the worker's traceback, whose last line is
    ``module.Type: message``."""
    text = text.strip()
    if "Original Traceback" not in text:
        return text
    last = text.splitlines()[-1]
    kind, sep, message = last.partition(": ")
    return message if sep and "." in kind and " " not in kind else last


class Stream:
    """This rank's micro-batches of an iterable dataset; see the module docstring."""

    per_rank = True  # its position differs on every rank (``trainer.loop.named_state.per_rank``)

    def __init__(self, dataset: Any, *, batch_size: int, workers: int, device: torch.device, seed: int = 0,
                 log: logging.Logger | None = None):
        try:
            from torchdata.stateful_dataloader import StatefulDataLoader  # type: ignore[import-untyped]
        except ImportError as e:
            raise StreamError(f"an iterable dataset needs torchdata's StatefulDataLoader to keep its position, and "
                              f"torchdata is not installed ({e}); add torchdata to the job's requirements") from None
        self.dataset, self.device = dataset, device
        self.log = log or logging.getLogger("trainer.data")
        self.failure: str | None = None  # the ``Batches`` interface: streams give no workers up
        self.epoch = 0
        self.taken = 0  # micro-batches handed out this epoch (for the logs)
        self.consumed = 0  # micro-batches handed out in all (for the logs)
        g = torch.Generator()  # the loader's own: drawing its base seed must not move the global RNG
        g.manual_seed(seed)
        extra: dict[str, Any] = {"multiprocessing_context": "fork", "worker_init_fn": _worker_init} if workers else {}
        self.loader = StatefulDataLoader(dataset, batch_size=batch_size, num_workers=workers, collate_fn=_Collate(),
                                         pin_memory=device.type == "cuda", generator=g, **extra)
        self._iter: Any = None
        self._workers: list[Any] = []  # every loader worker started and not yet seen dead (``close``)
        self._pending: dict | None = None  # a restored loader position, applied at the next ``iter``
        self._skip = 0  # batches to replay at the next ``iter`` (a restored position without one)
        self.jumps = callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None))

    def next(self) -> tuple:
        for _ in range(2):
            if self._iter is None:
                if self._pending is not None:
                    self.loader.load_state_dict(self._pending)
                    self._pending = None
                set_epoch = getattr(self.dataset, "set_epoch", None)
                if callable(set_epoch):
                    set_epoch(self.epoch)
                self._iter = iter(self.loader)
                self._workers = [w for w in self._workers if w.is_alive()] + list(getattr(self._iter, "_workers", []))
                for _ in range(self._skip):  # the batches before the restored position: read again, dropped
                    next(self._iter)
                self._skip = 0
            try:
                batch = next(self._iter)
            except StreamError as e:  # a data worker's (a shard missing in the bucket): its one line
                raise StreamError(worker_line(str(e))) from None
            except StopIteration:
                if self.taken == 0:
                    raise StreamError("the iterable dataset yielded no batch in a whole epoch (on this rank: is it "
                                      "split over more ranks or workers than it has shards?)") from None
                self._iter, self.epoch, self.taken = None, self.epoch + 1, 0
                continue
            self.taken += 1
            self.consumed += 1
            return tuple(b.to(self.device, non_blocking=True) if torch.is_tensor(b) else b for b in batch)
        raise StreamError("the iterable dataset ended at once in two epochs running")

    def state_dict(self) -> dict:
        loader = None
        if self.jumps:
            loader = self._pending if self._pending is not None else self.loader.state_dict()
        return {"epoch": self.epoch, "taken": self.taken, "consumed": self.consumed, "loader": loader}

    def load_state_dict(self, state: dict) -> None:
        self.close()
        self.epoch, self.taken, self.consumed = int(state["epoch"]), int(state["taken"]), int(state["consumed"])
        if self.jumps and state["loader"] is not None:
            self._pending = state["loader"]
        else:
            self._skip = self.taken

    def stop(self) -> None:
        """Stop the workers now (a notice)."""
        self.close()

    def close(self) -> None:
        """Stop the loader's workers, and kill any that outlive torch's shutdown.

        torch asks each worker to stop, waits up to 5 s, then falls back to SIGTERM, which our
        workers ignore (``_worker_init``). A worker still busy in its dataset (a slow read on a
        loaded machine) would then outlive the loop, and at exit multiprocessing joins it with
        no timeout: a trainer that finished and never exits. So what is left is killed, as
        ``Batches`` kills its own, including workers of an epoch torch itself ended earlier."""
        it, self._iter = self._iter, None
        if it is not None and hasattr(it, "_shutdown_workers"):
            with contextlib.suppress(Exception):
                it._shutdown_workers()
        kill_workers(self._workers)
        self._workers = [w for w in self._workers if w.is_alive()]
