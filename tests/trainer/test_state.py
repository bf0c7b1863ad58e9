"""trainer/state.py: RNG capture/restore, the fingerprint check, the model digest."""
from __future__ import annotations

import random

import pytest
import torch

from trainer.state import ResumeMismatch, check_fingerprint, model_digest, rng_state, set_rng_state


def test_rng_round_trip() -> None:
    saved = rng_state()
    a = (random.random(), torch.rand(3).tolist())
    set_rng_state(saved)
    assert (random.random(), torch.rand(3).tolist()) == a


def test_fingerprint_mismatch_names_settings() -> None:
    check_fingerprint({"seed": 1}, {"seed": 1})
    with pytest.raises(ResumeMismatch) as e:
        check_fingerprint({"seed": 1, "batch_size": 4}, {"seed": 2, "batch_size": 8})
    msg = str(e.value)
    assert "seed: checkpoint has 1, this run has 2" in msg
    assert "batch_size: checkpoint has 4, this run has 8" in msg


def test_world_size_in_an_older_fingerprint_does_not_block_an_elastic_resume() -> None:
    check_fingerprint({"seed": 1, "world_size": 2}, {"seed": 1})  # no error: the world may change


def test_model_digest_is_order_independent_and_bit_sensitive() -> None:
    a = {"w": torch.ones(2, 2), "b": torch.zeros(3), "s": torch.tensor(1.5)}
    b = {"s": torch.tensor(1.5), "b": torch.zeros(3), "w": torch.ones(2, 2)}
    assert model_digest(a) == model_digest(b)
    c = dict(a, w=torch.nextafter(torch.ones(2, 2), torch.tensor(2.0)))
    assert model_digest(a) != model_digest(c)
    assert model_digest(a) != model_digest(dict(a, b=torch.zeros(3, dtype=torch.float64)))


def test_reseed_after_a_world_size_change_is_reproducible_and_per_rank() -> None:
    from trainer.state import reseed

    def draw(step: int, rank: int) -> tuple[float, float]:
        reseed(7, step, rank)
        return random.random(), float(torch.rand(()))

    assert draw(10, 0) == draw(10, 0)
    assert len({draw(10, 0), draw(10, 1), draw(11, 0)}) == 3
