"""trainer/host_copy.py: the host copy a sharded save writes from reuses its buffers from one
save to the next, holds the state of the moment it was taken, survives a stager that someone
emptied, and a PyTorch without DCP's stager refuses fsdp as bad input."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer.checkpoint import host_copy
from trainer.config import load_run_config
from trainer.checkpoint.host_copy import HostCopy
from trainer.train import run
from tests.trainer.support import restore_logging  # noqa: F401  (fixture)


def _state(model: torch.nn.Module) -> dict:
    # A class object among the values, as every DTensor's placements have them.
    return {"model": model.state_dict(), "kind": torch.nn.Linear, "groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]}


def test_copies_reuse_their_host_buffers_and_hold_the_state_of_their_moment() -> None:
    model = torch.nn.Linear(4, 3)
    host = HostCopy(cuda=False)
    try:
        first = host.copy(_state(model))
        ptr = first["model"]["weight"].data_ptr()
        assert ptr != model.weight.data_ptr()  # a copy, not the live weights
        before = first["model"]["weight"].clone()
        with torch.no_grad():
            model.weight.add_(1.0)
        assert torch.equal(first["model"]["weight"], before)  # training goes on: the copy holds still
        second = host.copy(_state(model))
        assert second["model"]["weight"].data_ptr() == ptr  # the same buffer, not a new one per save
        assert torch.equal(second["model"]["weight"], model.weight.detach())
        assert second["kind"] is torch.nn.Linear and second["groups"] == [{"lr": 0.1, "betas": (0.9, 0.99)}]
    finally:
        host.close()


def test_a_stager_emptied_by_a_close_elsewhere_is_replaced_not_fatal() -> None:
    model = torch.nn.Linear(4, 3)
    host = HostCopy(cuda=False)
    host.copy(_state(model))
    host._stager.close()  # what DCP's DefaultStager did after every stage before PyTorch 2.13
    again = host.copy(_state(model))
    assert torch.equal(again["model"]["weight"], model.weight.detach()) and again["kind"] is torch.nn.Linear
    host.close()


@pytest.mark.usefixtures("restore_logging")
def test_fsdp_on_a_torch_without_the_stager_is_refused_naming_the_field(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_copy, "_stager_class", lambda: None)
    assert "has no torch.distributed.checkpoint StateDictStager" in (host_copy.unavailable() or "")
    with pytest.raises(RuntimeError):
        HostCopy(cuda=False)
    cfg = load_run_config({"run_dir": tmp_path / "run", "steps": 3, "parallelism": "fsdp", "health_port": None,
                           "task": "tests.trainer.example_task:build"}, None)
    out = run(cfg)
    assert out.code == 2
    assert out.reason.startswith("command line: parallelism: 'fsdp' cannot run here: PyTorch "), out.reason
    assert "allowed: 'ddp'" in out.reason
