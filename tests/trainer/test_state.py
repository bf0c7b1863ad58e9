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


def test_settings_that_change_the_numbers_are_in_the_fingerprint(tmp_path) -> None:
    from trainer.config import RunConfig

    base = RunConfig(run_dir=tmp_path, steps=5).fingerprint(dataset_len=7, device="cpu")
    for change, key in (({"threads": 2}, "threads"), ({"deterministic": False}, "deterministic")):
        other = RunConfig(run_dir=tmp_path, steps=5, **change).fingerprint(dataset_len=7, device="cpu")
        with pytest.raises(ResumeMismatch, match=rf"{key}: checkpoint has "):
            check_fingerprint(base, other)
    gpu = RunConfig(run_dir=tmp_path, steps=5).fingerprint(dataset_len=7, device="cuda")
    with pytest.raises(ResumeMismatch, match="device: checkpoint has 'cpu', this run has 'cuda'"):
        check_fingerprint(base, gpu)


def test_a_checkpoint_older_than_a_fingerprint_key_resumes_with_a_warning_naming_it(tmp_path) -> None:
    from trainer.config import RunConfig
    from trainer.state import LATER_KEYS

    current = RunConfig(run_dir=tmp_path, steps=5, threads=4).fingerprint(dataset_len=7, device="cpu")
    old = {k: v for k, v in current.items() if k not in LATER_KEYS}  # written before these keys
    notes = check_fingerprint(old, current)
    assert [n.split()[1] for n in notes] == ["key=threads", "key=deterministic", "key=device"]
    assert "value=4" in notes[0]
    # Only keys added later are forgiven: a key the run really changed is still refused.
    with pytest.raises(ResumeMismatch, match="seed"):
        check_fingerprint({**old, "seed": 1}, current)


def test_another_torch_is_reported_naming_both_versions_not_refused() -> None:
    from trainer.state import check_versions

    assert check_versions({"torch": torch.__version__}) == []
    assert check_versions({}) == []  # written before the version was recorded in the state
    (note,) = check_versions({"torch": "2.9.0+cu129"})
    assert note.startswith(f"event=torch_version_change from=2.9.0+cu129 to={torch.__version__} ")
