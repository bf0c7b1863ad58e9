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

A worker that dies under the loop (the kernel's OOM killer, a crash in native code) costs
nothing: the loader starts again at the position, which the dead worker never moved, so the loop
gets the very batches it would have got (``on_died`` hears of it). The death is found where a batch
is asked for, never in whatever the loop runs at that moment: torch's SIGCHLD handler would raise
it there (in a step, in a save), so the workers are kept out of its registry. Within
``RESTART_WINDOW_S``, ``RESTARTS`` deaths are restarted; the next one gives the workers up
(``failure``): the batches are made in the training process from then on (the same batches), and
the loop, seeing ``failure`` after its step, saves and ends the session.
"""
from __future__ import annotations

import contextlib
import copy
import ctypes
import dataclasses
import logging
import multiprocessing.connection
import signal
import time
from typing import Any, Callable, Iterator

import torch

from trainer.data.sampler import DataOrder

PREFETCH_PER_WORKER = 2
#: Worker deaths within ``RESTART_WINDOW_S`` that are restarted; one more gives the workers up.
RESTARTS = 3
RESTART_WINDOW_S = 600.0
#: How long an error from the loader waits for a worker's end before it counts as the dataset's.
EXIT_GRACE_S = 2.0


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


@dataclasses.dataclass(frozen=True)
class WorkersDied:
    """Data workers found dead: ``died`` (pid and how: ``SIGKILL``, ``exit 1``), the position the
    batches come from again, the deaths within the window so far (this one included) and whether
    the workers were started again (False: given up, ``Batches.failure`` says why)."""

    died: dict[int, str]
    consumed: int
    deaths: int
    restarted: bool

    def describe(self) -> str:
        return ",".join(f"{pid}:{how}" for pid, how in sorted(self.died.items()))


def _how(exitcode: int) -> str:
    if exitcode >= 0:
        return f"exit {exitcode}"
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def _unregistered(loader: Any) -> Any:
    """``iter(loader)`` with its workers kept out of torch's SIGCHLD registry. For the workers it
    registers, torch's handler raises a death in the main thread wherever that is then (inside
    a step, a save, a ledger write; or here, as a worker dies at its first sample); ours are found
    dead where a batch is asked for (``Batches._died``)."""
    from torch.utils.data._utils import signal_handling

    register = signal_handling._set_worker_pids
    signal_handling._set_worker_pids = lambda *_: None  # only the main thread starts loaders
    try:
        it = iter(loader)
    finally:
        signal_handling._set_worker_pids = register
    it._worker_pids_set = False  # nothing to take out of the registry at shutdown
    it._spottrain = True  # the trainer's own: its position is DataOrder's (``trainer.loop.undeclared``)
    return it


def _worker_init(_: int) -> None:
    # The trainer alone decides when to stop: a SIGTERM to the whole unit must not kill a worker
    # under a step in flight (the trainer kills its workers itself once it stops).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(Exception):  # Linux: die with the trainer, even on SIGKILL
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def kill_workers(workers: Any) -> None:
    """SIGKILL the data workers still alive (they ignore SIGTERM: ``_worker_init``) and reap them."""
    workers = list(workers)
    for w in workers:
        with contextlib.suppress(Exception):
            if w.is_alive():
                w.kill()
    for w in workers:
        with contextlib.suppress(Exception):
            w.join(timeout=5)


class Batches:
    """This rank's micro-batches; see the module docstring."""

    def __init__(self, dataset: Any, order: DataOrder, *, workers: int, device: torch.device, seed: int = 0,
                 log: logging.Logger | None = None, on_died: Callable[[WorkersDied], None] | None = None,
                 restarts: int = RESTARTS, window_s: float = RESTART_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic):
        self.dataset, self.order, self.workers, self.device = dataset, order, workers, device
        self.seed = seed
        self.log = log or logging.getLogger("trainer.data")
        self.on_died = on_died
        self.restarts, self.window_s, self.clock = restarts, window_s, clock
        #: Why the workers were given up (they kept dying), or None; batches are made here since.
        self.failure: str | None = None
        self._deaths: list[float] = []  # when workers were found dead, within the window
        self._iter: Any = None
        self._from = -1  # the position the workers' sampler started at
        self._stopped = False  # ``stop()`` killed the workers: not a death

    def _start(self) -> None:
        pin = self.device.type == "cuda"
        g = torch.Generator()  # the loader's own: drawing its base seed must not move the global RNG
        g.manual_seed(self.seed)
        loader = torch.utils.data.DataLoader(
            self.dataset, batch_sampler=_OrderSampler(self.order, self.order.consumed), num_workers=self.workers,
            collate_fn=_Collate(), pin_memory=pin, prefetch_factor=PREFETCH_PER_WORKER, worker_init_fn=_worker_init,
            multiprocessing_context="fork", generator=g)
        self._iter, self._from = _unregistered(loader), self.order.consumed
        self._taken, self._stopped = 0, False
        self.log.info("event=data_workers workers=%d from=%d pids=%s", self.workers, self._from,
                      ",".join(map(str, self.pids())))

    def next(self) -> tuple:
        """The next micro-batch on the device; advances the position by one global micro-batch."""
        if self.workers == 0 or self.failure is not None:
            batch = fetch(self.dataset, self.order.indices_at(self.order.consumed))
        else:
            batch = self._from_workers()
        self.order.consumed += self.order.stride
        return tuple(b.to(self.device, non_blocking=True) if torch.is_tensor(b) else b for b in batch)

    def _from_workers(self) -> tuple:
        """The batch at the position from the workers; dead workers are replaced (or given up)."""
        while True:
            if (self._iter is None or self._stopped
                    or self._from + self._taken * self.order.stride != self.order.consumed):
                self.close()  # first batch, or the position moved under us: start from it
                self._start()
            died = self._died()
            if not died:
                try:
                    batch = next(self._iter)
                except Exception:
                    # torch notices a dead worker within its status interval (5 s) while waiting,
                    # or fails to take a batch the worker had queued (its pipe or socket closed
                    # with it, a moment before its exit can be reaped); otherwise the error is the
                    # dataset's own, from a worker that lives on.
                    died = self._died(grace_s=EXIT_GRACE_S)
                    if not died:
                        raise
                else:
                    self._taken += 1
                    return batch
            if not self._replace(died):
                return fetch(self.dataset, self.order.indices_at(self.order.consumed))

    def _died(self, grace_s: float = 0.0) -> dict[int, str]:
        """The current loader's workers that have ended (pid: how); with ``grace_s``, waiting that
        long for one to end, and for the exit of one that is ending."""
        workers = list(getattr(self._iter, "_workers", []))
        if grace_s > 0 and workers:
            for sentinel in multiprocessing.connection.wait([w.sentinel for w in workers], timeout=grace_s):
                for w in workers:
                    if w.sentinel == sentinel:
                        w.join(timeout=grace_s)  # its files are closed: its exit follows at once
        out = {}
        for w in workers:
            code = w.exitcode  # polls (and reaps) the worker
            if code is not None:
                out[w.pid] = _how(code)
        return out

    def _replace(self, died: dict[int, str]) -> bool:
        """Workers died: drop the loader (a dead worker may have left its queue half written) so
        that the next batch starts a new one at the position; True, or False once they keep dying
        (``failure``)."""
        now = self.clock()
        self._deaths = [t for t in self._deaths if now - t < self.window_s] + [now]
        restart = len(self._deaths) <= self.restarts
        self.close()
        event = WorkersDied(died, self.order.consumed, len(self._deaths), restart)
        if not restart:
            self.failure = (f"data workers died {len(self._deaths)} times within {self.window_s:.0f}s "
                            f"(last: {event.describe()})")
        if self.on_died is not None:
            self.on_died(event)
        return restart

    def pids(self) -> list[int]:
        return [w.pid for w in getattr(self._iter, "_workers", [])]

    def stop(self) -> None:
        """Kill the workers now (a notice: nothing they hold is worth a second of the save)."""
        it = self._iter
        if it is None:
            return
        self._stopped = True  # (out of torch's SIGCHLD registry since ``_start``: no crash is raised)
        kill_workers(getattr(it, "_workers", []))

    def close(self) -> None:
        """Stop the workers and release the loader's queues and threads."""
        self.stop()
        it, self._iter = self._iter, None
        if it is not None and hasattr(it, "_shutdown_workers"):
            with contextlib.suppress(Exception):
                it._shutdown_workers()
