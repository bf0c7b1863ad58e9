"""trainer/task.py and the bundled GPT task."""
from __future__ import annotations

import pytest
import torch

from trainer import task as tasks
from trainer.tasks.gpt import CharDataset

CTX = tasks.TaskContext(seed=0, steps=10, device=torch.device("cpu"), rank=0, world_size=1)


def test_load_errors() -> None:
    with pytest.raises(tasks.TaskError, match="cannot import module 'nope_mod'"):
        tasks.load("nope_mod:build")
    with pytest.raises(tasks.TaskError, match="has no attribute 'nothing'"):
        tasks.load("trainer.tasks.gpt:nothing")
    with pytest.raises(tasks.TaskError, match="is not callable"):
        tasks.load("trainer.tasks.gpt:math")  # a module attribute, not callable
    with pytest.raises(tasks.TaskError, match="does not take these arguments"):
        tasks.build("trainer.tasks.gpt:build", CTX, {"n_layers": 2})


def test_gpt_task_trains_a_step() -> None:
    torch.manual_seed(0)
    t = tasks.build("trainer.tasks.gpt:build", CTX, {"n_layer": 1, "n_embd": 32, "n_head": 2, "block_size": 16})
    x, y = t.dataset[3]
    assert x.shape == y.shape == (16,)
    assert torch.equal(x[1:], y[:-1])
    loss = t.model(x[None], y[None])
    loss.backward()
    t.optimizer.step()
    assert loss.item() == pytest.approx(float(torch.log(torch.tensor(float(t.info["vocab"])))), rel=0.2)


def test_char_dataset_windows() -> None:
    ds = CharDataset("abcdefghij", block_size=4, stride=2)
    assert len(ds) == 3
    x, y = ds[2]
    assert x.tolist() == [4, 5, 6, 7] and y.tolist() == [5, 6, 7, 8]
