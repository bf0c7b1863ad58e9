"""trainer.checkpoint.background_copy through the checkpointer: a save's copy of the weights and
the optimizer state runs beside the next forward and backward, the optimizer step waits for it,
and the checkpoint holds the state of the save's step, bit for bit.

The copy is held at a gate (an Event) the test opens, so what runs while it is in flight is the
test's choice, not the scheduler's."""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from tests.trainer.support import Policy, checkpointer, run_key
from trainer.checkpoint import background_copy

KEY = run_key()


class Gate:
    """Every tensor copy goes through here: the ones off the saving thread (the background copy)
    wait until ``open()``; each copy's tensor and thread are recorded."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.caller = threading.current_thread()
        self.copied: dict[int, threading.Thread] = {}  # the tensor's data_ptr -> the thread that copied it
        self._copy = background_copy.copy_tensor

    def __call__(self, arena: torch.Tensor, offset: int, nbytes: int, t: torch.Tensor) -> None:
        if threading.current_thread() is not self.caller:
            assert self.opened.wait(60.0), "the gate was never opened"
        self.copied[t.data_ptr()] = threading.current_thread()
        self._copy(arena, offset, nbytes, t)

    def open(self) -> None:
        self.opened.set()

    def behind(self, tensors: Iterator[torch.Tensor]) -> bool:
        """Every one of ``tensors`` was copied off the saving thread."""
        return all(self.copied[t.data_ptr()] is not self.caller for t in tensors)


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    g = Gate()
    monkeypatch.setattr(background_copy, "copy_tensor", g)
    yield g
    g.open()  # a failing test leaves no copy waiting


def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model with BatchNorm and its AdamW after one step (so the optimizer has state)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    forward_backward(model)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def forward_backward(model: torch.nn.Module) -> None:
    model.train()
    model(torch.randn(32, 8)).square().mean().backward()


def state(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict:
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
            "data": {"index": step * 32}}


def frozen(s: Any) -> Any:
    """A deep copy with every tensor cloned: the state as it is now."""
    if torch.is_tensor(s):
        return s.detach().clone()
    if isinstance(s, dict):
        return {k: frozen(v) for k, v in s.items()}
    if isinstance(s, (list, tuple)):
        return type(s)(frozen(v) for v in s)
    return s


def identical(a: Any, b: Any) -> bool:
    """Bit for bit: same structure, same dtypes, shapes and bytes."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return (torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.view(torch.uint8) if a.dim() else a.reshape(1).view(torch.uint8),
                                b.view(torch.uint8) if b.dim() else b.reshape(1).view(torch.uint8)))
    if isinstance(a, dict) and isinstance(b, dict):
        return set(map(str, a)) == set(map(str, b)) and all(
            identical(a[k], b[k] if k in b else b[str(k)]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(identical(x, y) for x, y in zip(a, b))
    return a == b


def ckpt(tmp_path: Path) -> Any:
    return checkpointer(run_dir=tmp_path / "run", policies={"persistent": Policy(every_steps=1, keep=10)}, key=KEY)


def saved(tmp_path: Path, step: int) -> Any:
    """What a fresh checkpointer restores from ``step``'s folder (the newest)."""
    c = ckpt(tmp_path)
    r = c.restore()
    c.close()
    assert r is not None and r.step == step
    return r.state


def test_the_copy_of_the_weights_runs_beside_the_next_step_and_the_optimizer_waits_for_it(
        tmp_path: Path, gate: Gate) -> None:
    model, opt = trained()
    c = ckpt(tmp_path)
    c.bind(model, opt)
    expected = frozen(state(model, opt, 1))
    c.save(1, state(model, opt, 1))  # returns with the copy held at the gate
    assert not c.before_update(timeout=0)  # the optimizer may not write yet
    forward_backward(model)  # the next step's forward and backward run meanwhile
    assert not c.before_update(timeout=0)
    gate.open()
    assert c.before_update()
    opt.step()  # the weights and the optimizer state change only now
    assert not identical(frozen(model.state_dict()), expected["model"])
    assert c.wait(60.0)
    c.close()
    assert gate.behind(model.parameters())
    assert gate.behind(v for s in opt.state.values() for v in s.values())
    assert identical(saved(tmp_path, 1), expected)
    assert c.stats["update_waited_s_total"] >= 0.0 and c.stats["saves"] == 1


def test_buffers_the_next_forward_changes_are_saved_as_of_the_save_step(tmp_path: Path, gate: Gate) -> None:
    model, opt = trained()
    bn = model[1]
    c = ckpt(tmp_path)
    c.bind(model, opt)
    before = (bn.running_mean.clone(), bn.running_var.clone(), bn.num_batches_tracked.clone())
    c.save(1, state(model, opt, 1))
    forward_backward(model)  # changes BatchNorm's running statistics while the weights are copied
    assert not torch.equal(bn.running_mean, before[0])
    gate.open()
    assert c.before_update()
    c.close()
    assert not gate.behind(iter([bn.running_mean]))  # copied at the call, on the saving thread
    got = saved(tmp_path, 1)["model"]
    assert identical((got["1.running_mean"], got["1.running_var"], got["1.num_batches_tracked"]), before)


def test_a_save_with_nothing_bound_copies_everything_at_the_call(tmp_path: Path, gate: Gate) -> None:
    model, opt = trained()
    c = ckpt(tmp_path)  # no bind: no tensor is known to be written by the optimizer alone
    c.save(1, state(model, opt, 1))
    assert c.before_update(timeout=0)
    assert not gate.behind(model.parameters())  # the gate was never opened: all copied at the call
    c.close()


def test_an_emergency_save_during_the_copy_waits_for_it(tmp_path: Path, gate: Gate) -> None:
    model, opt = trained()
    c = ckpt(tmp_path)
    c.bind(model, opt)
    first = frozen(state(model, opt, 1))
    c.save(1, state(model, opt, 1))  # held at the gate
    # The notice: another state (as after a step), saved by the emergency path while the copy of
    # step 1 is in flight. The gate opens only once the emergency save says it waits for that copy;
    # a save that did not wait would finish first, into the buffer the copy still writes.
    later = frozen(state(model, opt, 2))
    later["model"] = {k: v + 1 for k, v in later["model"].items()}

    class OpenWhenWaiting(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "waiting for the previous save's copy" in record.getMessage():
                gate.open()

    handler = OpenWhenWaiting()
    c.log.addHandler(handler)
    old_level = c.log.level
    c.log.setLevel(logging.INFO)
    try:
        report = c.emergency_save(2, later, deadline=time.monotonic() + 60)
    finally:
        c.log.removeHandler(handler)
        c.log.setLevel(old_level)
        gate.open()
    assert report.saved, report.detail
    assert c.before_update(timeout=0)
    c.close()
    assert identical(saved(tmp_path, 2), later)
    (tmp_path / "run" / "step-00000002").rename(tmp_path / "emergency")  # step 1 is the newest left
    assert identical(saved(tmp_path, 1), first)
