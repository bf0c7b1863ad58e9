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


def _step(orders: list[DataOrder], accum: int) -> list[int]:
    """One optimizer step of a world of ``len(orders)`` ranks: every rank takes ``accum``
    micro-batches; returns the samples the step consumed (all ranks)."""
    out: list[int] = []
    for _ in range(accum):
        for o in orders:
            out += o.next_indices()
    return out


def test_a_world_size_change_skips_and_repeats_no_sample() -> None:
    """2 ranks for 3 steps, then 1 rank, then 3 ranks, each resuming from the saved position and
    keeping a global batch of 6: the samples consumed are exactly the single stream's prefix."""
    n, batch, global_batch = 17, 1, 6  # crosses epoch boundaries on the way
    consumed: list[int] = []
    position = {"consumed": 0}
    for world_size, steps in ((2, 3), (1, 2), (3, 4)):
        orders = [DataOrder(n, seed=5, batch_size=batch, rank=r, world_size=world_size) for r in range(world_size)]
        for o in orders:
            o.load_state_dict(position)
        for _ in range(steps):
            consumed += _step(orders, global_batch // (batch * world_size))
        assert len({o.consumed for o in orders}) == 1
        position = orders[0].state_dict()
    single = _take(DataOrder(n, seed=5, batch_size=1), len(consumed))
    assert consumed == single
    assert position["consumed"] == (3 + 2 + 4) * global_batch
