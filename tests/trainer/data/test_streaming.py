"""Streaming data (``trainer.data.streaming``): an IterableDataset's exact position, kept across
resumes, with and without data workers, across epochs, and jumped to by a dataset that has one."""
from __future__ import annotations

import pytest
import torch

from trainer.data.streaming import Stream, StreamError
from tests.trainer.data.stream_support import read_in_pieces, take as _take


class Shards(torch.utils.data.IterableDataset):
    """Samples 0..n-1 split over the data workers, the way webdataset's split_by_worker does."""

    def __init__(self, n: int = 40):
        self.n = n

    def __iter__(self):  # type: ignore[no-untyped-def]
        info = torch.utils.data.get_worker_info()
        w, k = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(w, self.n, k):
            yield torch.tensor([i]), torch.tensor([float(i) * 0.5])


class Positioned(Shards):
    """A stream that knows its position (as Hugging Face streaming datasets do)."""

    def __init__(self, n: int = 40):
        super().__init__(n)
        self.start = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        for i in range(self.start, self.n):
            self.start = i + 1
            yield torch.tensor([i]), torch.tensor([float(i) * 0.5])
        self.start = 0

    def state_dict(self) -> dict:
        return {"start": self.start}

    def load_state_dict(self, s: dict) -> None:
        self.start = s["start"]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_resumed_again_and_again_reads_what_an_uninterrupted_one_reads(workers: int) -> None:
    cpu = torch.device("cpu")
    whole = _take(Stream(Shards(), batch_size=4, workers=workers, device=cpu), 27)  # 10 batches an epoch
    # The last resume lands past an epoch's end.
    got, state = read_in_pieces(lambda: Stream(Shards(), batch_size=4, workers=workers, device=cpu), (3, 5, 9, 10))
    assert got == whole
    assert state["epoch"] == 2 and state["taken"] == 7 and state["consumed"] == 27


def test_a_stream_with_its_own_position_is_jumped_to_not_replayed() -> None:
    cpu = torch.device("cpu")
    s = Stream(Positioned(), batch_size=4, workers=0, device=cpu)
    first = _take(s, 3)
    state = s.state_dict()
    assert state["loader"] is not None  # torchdata's StatefulDataLoader holds the dataset's position
    ds = Positioned()
    s2 = Stream(ds, batch_size=4, workers=0, device=cpu)
    s2.load_state_dict(state)
    assert first + _take(s2, 2) == list(range(20))


def test_an_empty_stream_is_refused_not_looped_on() -> None:
    with pytest.raises(StreamError, match="yielded no batch in a whole epoch"):
        Stream(Shards(0), batch_size=4, workers=0, device=torch.device("cpu")).next()


class Stalling(Shards):
    """A stream whose reads stall after its first samples (a shard read that hangs): a worker
    busy in it does not answer torch's request to stop."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        yield from list(super().__iter__())[:4]
        import signal
        signal.pause()  # no signal the stream sends reaches it: SIGTERM is ignored in workers


def test_a_worker_stuck_in_its_dataset_does_not_outlive_the_stream() -> None:
    """torch's shutdown falls back to SIGTERM, which the workers ignore: a worker left stuck would
    be joined forever when the trainer exits (a finished run that never ends). close() kills it."""
    s = Stream(Stalling(), batch_size=4, workers=1, device=torch.device("cpu"))
    assert s.next()[0].tolist() == [[0], [1], [2], [3]]
    workers = list(s._iter._workers)
    s.close()
    assert workers and not any(w.is_alive() for w in workers)
    assert workers[0].exitcode == -9  # killed: it never reached the end of its read
