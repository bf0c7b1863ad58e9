"""trainer/state.py: RNG capture/restore, the fingerprint check, the model digest."""
from __future__ import annotations

import random

import pytest
import torch

from trainer.loop.state import ResumeMismatch, check_fingerprint, model_digest, rng_state, set_rng_state


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
    from trainer.loop.state import reseed

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
    from trainer.loop.state import LATER_KEYS, unrecorded

    current = RunConfig(run_dir=tmp_path, steps=5, threads=4).fingerprint(dataset_len=7, device="cpu")
    old = {k: v for k, v in current.items() if k not in LATER_KEYS}  # written before these keys
    assert check_fingerprint(old, current) is None  # accepted ...
    notes = unrecorded(old, current)  # ... with a warning naming each key
    assert [n.split()[1] for n in notes] == ["key=threads", "key=deterministic", "key=device"]
    assert "value=4" in notes[0]
    # Only keys added later are forgiven: a key the run really changed is still refused.
    with pytest.raises(ResumeMismatch, match="seed"):
        check_fingerprint({**old, "seed": 1}, current)


def test_another_torch_is_reported_naming_both_versions_not_refused() -> None:
    from trainer.loop.state import check_versions

    assert check_versions({"torch": torch.__version__}) == []
    assert check_versions({}) == []  # written before the version was recorded in the state
    (note,) = check_versions({"torch": "2.9.0+cu129"})
    assert note.startswith(f"event=torch_version_change from=2.9.0+cu129 to={torch.__version__} ")


def test_another_total_of_steps_needs_extend_steps_and_never_goes_below_the_step_reached() -> None:
    saved, now = {"seed": 1, "steps": 20}, {"seed": 1, "steps": 30}
    with pytest.raises(ResumeMismatch) as e:
        check_fingerprint(saved, now, step=20)
    assert "steps: checkpoint has 20, this run has 30" in str(e.value) and "--extend-steps" in str(e.value)
    assert check_fingerprint(saved, now, step=20, extend_steps=True) == (20, 30)
    assert check_fingerprint(saved, dict(now, steps=20), step=20, extend_steps=True) is None
    assert check_fingerprint(saved, dict(now, steps=15), step=12, extend_steps=True) == (20, 15)
    with pytest.raises(ResumeMismatch, match="steps: 15 is below step 18, which the checkpoint has already reached"):
        check_fingerprint(saved, dict(now, steps=15), step=18, extend_steps=True)
    with pytest.raises(ResumeMismatch, match="seed: checkpoint has 1, this run has 2"):
        check_fingerprint(saved, {"seed": 2, "steps": 30}, step=20, extend_steps=True)
    # Where a run came from is provenance, not a setting: never compared.
    check_fingerprint(dict(saved, init_from={"source": "gs://b/old"}), saved, step=20)


def _schedulers(total: int):
    from torch.optim import lr_scheduler as lrs

    def opt():
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)

    return {"onecycle": lrs.OneCycleLR(opt(), max_lr=1.0, total_steps=total),
            "lambda": lrs.LambdaLR(opt(), lambda s: 1 - s / total),
            "plateau": lrs.ReduceLROnPlateau(opt(), patience=0)}


def test_after_a_change_of_total_a_schedule_runs_on_over_the_new_total() -> None:
    from trainer.loop.state import load_scheduler

    old = _schedulers(20)
    for s in old.values():
        for _ in range(20):
            s.optimizer.step()
            s.step(*([1.0] if "Plateau" in type(s).__name__ else []))
    new = _schedulers(30)
    for name, s in new.items():
        load_scheduler(s, old[name].state_dict(), steps_changed=True)
    onecycle = new["onecycle"]
    assert onecycle.last_epoch == 20 and onecycle.total_steps == 30
    onecycle.optimizer.step()
    onecycle.step()  # the old total would refuse: "Tried to step 22 times ... total steps is 20"
    assert new["plateau"].num_bad_epochs == old["plateau"].num_bad_epochs  # restored whole
    assert new["lambda"].last_epoch == 20
    # Without a change of total, the state is restored as saved (the total included).
    again = _schedulers(30)["onecycle"]
    load_scheduler(again, old["onecycle"].state_dict())
    assert again.total_steps == 20
