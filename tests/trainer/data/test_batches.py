"""Data workers that die under the loop (``trainer.data.batches``): real DataLoader workers, real
SIGKILLs; the loop gets the batches inline loading gives, whatever dies."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import torch

from trainer.data.batches import Batches, WorkersDied
from trainer.data.sampler import DataOrder

CPU = torch.device("cpu")


class Samples:
    """A pure function of the index; in a worker, while ``die`` exists, each sample SIGKILLs the
    worker that loads it (as the OOM killer does to a worker whose sample takes the memory)."""

    def __init__(self, die: Path):
        self.die = die

    def __len__(self) -> int:
        return 50

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if torch.utils.data.get_worker_info() is not None and self.die.exists():
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.tensor([i, 3 * i]), torch.tensor(i % 7)


def _batches(ds: Samples, workers: int, **kw: object) -> Batches:
    return Batches(ds, DataOrder(len(ds), seed=11, batch_size=4), workers=workers, device=CPU, seed=11, **kw)


def _inline(ds: Samples, n: int) -> list[tuple]:
    b = _batches(ds, 0)
    return [b.next() for _ in range(n)]


def _same(got: list[tuple], want: list[tuple]) -> bool:
    return len(got) == len(want) and all(
        len(g) == len(w) and all(torch.equal(x, y) for x, y in zip(g, w)) for g, w in zip(got, want))


def test_a_worker_killed_by_sigkill_is_replaced_at_the_position(tmp_path: Path) -> None:
    ds = Samples(tmp_path / "die")
    told: list[WorkersDied] = []
    b = _batches(ds, 2, on_died=told.append)
    try:
        got = [b.next() for _ in range(3)]
        victim = b.pids()[0]
        os.kill(victim, signal.SIGKILL)
        # 20 batches more: the dead worker's turn comes within its prefetch, and again across the epoch's end.
        got += [b.next() for _ in range(20)]
        assert _same(got, _inline(ds, 23))
        assert len(told) == 1, told
        assert told[0].died == {victim: "SIGKILL"} and told[0].deaths == 1 and told[0].restarted
        assert told[0].consumed >= 3 * 4 and told[0].consumed % 4 == 0
        assert b.failure is None and victim not in b.pids() and len(b.pids()) == 2
        assert b.order.consumed == 23 * 4
    finally:
        b.close()


def test_workers_that_keep_dying_are_given_up_and_the_batches_made_inline(tmp_path: Path) -> None:
    """One restart within the window: a death outside it is restarted again, the next one inside
    it gives the workers up; every batch is still the inline one."""
    ds = Samples(tmp_path / "die")
    told: list[WorkersDied] = []
    now = iter([0.0, 200.0, 201.0])  # when each death is found: the second is past the 100 s window
    b = _batches(ds, 2, on_died=told.append, restarts=1, window_s=100.0, clock=lambda: next(now))
    try:
        got = [b.next() for _ in range(2)]
        pids = set(b.pids())
        ds.die.touch()  # from now on every worker dies at its next sample
        got += [b.next() for _ in range(10)]
        assert _same(got, _inline(Samples(tmp_path / "never"), 12))
        assert [(d.deaths, d.restarted) for d in told] == [(1, True), (1, True), (2, False)], told
        assert all(how == "SIGKILL" for d in told for how in d.died.values())
        assert set(told[0].died) <= pids
        assert b.failure is not None and "died 2 times within 100s" in b.failure
        assert b.pids() == [] and b.order.consumed == 12 * 4
    finally:
        b.close()


def test_an_error_of_the_dataset_in_a_live_worker_is_raised_not_restarted(tmp_path: Path) -> None:
    class Broken(Samples):
        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            if i == 13:
                raise KeyError(f"sample {i} is missing")
            return super().__getitem__(i)

    told: list[WorkersDied] = []
    b = _batches(Broken(tmp_path / "die"), 2, on_died=told.append)
    try:
        try:
            for _ in range(13):  # one epoch: sample 13 comes
                b.next()
        except KeyError as e:
            assert "sample 13 is missing" in str(e)
        else:
            raise AssertionError("the dataset's error was not raised")
        assert told == [] and b.failure is None
    finally:
        b.close()
