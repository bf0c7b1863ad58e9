"""trainer/sampler.py: the data order is a pure function of (seed, epoch) and the position."""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.data.sampler import DataOrder, Permutation, permutation


def _take(order: DataOrder, batches: int) -> list[int]:
    return [i for _ in range(batches) for i in order.next_indices()]


def test_each_epoch_is_a_permutation_and_epochs_differ() -> None:
    order = DataOrder(10, seed=1, batch_size=5)
    e0, e1 = _take(order, 2), _take(order, 2)
    assert sorted(e0) == sorted(e1) == list(range(10))
    assert e0 != e1
    assert order.epoch == 2


def test_seed_changes_order() -> None:
    def p(seed: int, epoch: int) -> list[int]:
        return [permutation(50, seed, epoch)[i] for i in range(50)]

    assert p(1, 0) != p(2, 0) and p(1, 0) != p(1, 1) and p(2, 0) != p(1, 1)
    assert p(1, 0) == p(1, 0)


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


# Small n exhaustively: n = 1, 2, powers of two and their neighbours, primes, and a few
# arbitrary sizes, each under several (seed, epoch) keys.
SMALL = sorted({1, 2, 3, 4, 5, 7, 8, 9, 13, 15, 16, 17, 31, 32, 33, 61, 64, 65, 97, 127, 128, 129, 251, 256,
                257, 1000, 1021, 1024, 1025, 4093, 4096})


@pytest.mark.parametrize("n", SMALL)
def test_every_sample_exactly_once_for_small_n(n: int) -> None:
    for seed, epoch in ((0, 0), (1, 0), (0, 1), (2**63 - 1, 12345)):
        p = Permutation(n, seed, epoch)
        assert sorted(p[i] for i in range(n)) == list(range(n)), (n, seed, epoch)
    with pytest.raises(IndexError):
        Permutation(n, 0, 0)[n]


def test_large_n_is_statistically_sane_and_independent_of_n_in_memory() -> None:
    """n = 10^10: 20,000 consecutive positions give distinct samples spread evenly over [0, n)
    (chi-square over 20 buckets), with no drift from the position (the correlation of position
    and sample is near 0), and the order's memory does not grow with n."""
    n, k, buckets = 10**10, 20_000, 20
    order = DataOrder(n, seed=7, batch_size=100)
    xs = [i for _ in range(k // 100) for i in order.next_indices()]
    assert len(set(xs)) == k and all(0 <= x < n for x in xs)
    counts = [0] * buckets
    for x in xs:
        counts[x * buckets // n] += 1
    expected = k / buckets
    chi2 = sum((c - expected) ** 2 / expected for c in counts)
    assert chi2 < 43.8  # chi-square, 19 degrees of freedom, p = 0.001
    mean_pos, mean_x = (k - 1) / 2, sum(xs) / k
    cov = sum((i - mean_pos) * (x - mean_x) for i, x in enumerate(xs))
    sd = math.sqrt(sum((i - mean_pos) ** 2 for i in range(k)) * sum((x - mean_x) ** 2 for x in xs))
    assert abs(cov / sd) < 0.03  # |r| of 20,000 independent draws: sd 0.007
    # Consecutive samples are not neighbours (a weak Feistel would map i and i+1 close together).
    assert sum(abs(a - b) < n // 1000 for a, b in zip(xs, xs[1:])) < 60  # expected 40

    assert _peak_bytes(10**10) < 2 * _peak_bytes(10**4) + 4096


def _peak_bytes(n: int) -> int:
    """Peak bytes allocated while making an order over n samples and taking 200 batches of it,
    in a fresh interpreter (threads that earlier tests left running would allocate meanwhile)."""
    code = ("import tracemalloc\nfrom trainer.data.sampler import DataOrder\ntracemalloc.start()\n"
            f"o = DataOrder({n}, seed=7, batch_size=100)\nfor _ in range(200): o.next_indices()\n"
            "print(tracemalloc.get_traced_memory()[1])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[3])
    return int(out.stdout)


def test_an_old_orders_fingerprint_is_refused_naming_the_order() -> None:
    from trainer.config import RunConfig
    from trainer.loop.state import ResumeMismatch, check_fingerprint

    current = RunConfig(run_dir="/tmp/x", steps=3).fingerprint(dataset_len=10)
    old = {k: v for k, v in current.items() if k != "data_order"}  # written before the key existed
    with pytest.raises(ResumeMismatch, match="data_order: checkpoint has None, this run has 2"):
        check_fingerprint(old, current)
