"""trainer/sampler.py: the data order is a pure function of (seed, epoch) and the position."""
from __future__ import annotations

from trainer.sampler import DataOrder, permutation


def _take(order: DataOrder, batches: int) -> list[int]:
    return [i for _ in range(batches) for i in order.next_indices()]


def test_each_epoch_is_a_permutation_and_epochs_differ() -> None:
    order = DataOrder(10, seed=1, batch_size=5)
    e0, e1 = _take(order, 2), _take(order, 2)
    assert sorted(e0) == sorted(e1) == list(range(10))
    assert e0 != e1
    assert order.epoch == 2


def test_seed_changes_order() -> None:
    assert permutation(50, 1, 0).tolist() != permutation(50, 2, 0).tolist()
    assert permutation(50, 1, 0).tolist() == permutation(50, 1, 0).tolist()


def test_resume_from_state_continues_the_same_stream() -> None:
    whole = _take(DataOrder(7, seed=3, batch_size=3), 10)  # crosses several epoch boundaries
    first = DataOrder(7, seed=3, batch_size=3)
    head = _take(first, 4)
    resumed = DataOrder(7, seed=3, batch_size=3)
    resumed.load_state_dict(first.state_dict())
    assert head + _take(resumed, 6) == whole
    assert first.state_dict() == {"consumed": 12, "epoch": 1, "offset": 5}


def test_ranks_split_the_global_batch() -> None:
    single = _take(DataOrder(20, seed=0, batch_size=4), 5)
    r0 = DataOrder(20, seed=0, batch_size=2, rank=0, world_size=2)
    r1 = DataOrder(20, seed=0, batch_size=2, rank=1, world_size=2)
    merged = []
    for _ in range(5):
        merged += r0.next_indices() + r1.next_indices()
    assert merged == single
    assert r0.consumed == r1.consumed == 20
