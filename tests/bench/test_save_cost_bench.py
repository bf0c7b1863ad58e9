"""bench/save_cost_bench.py kept runnable in its quick configuration: every way of saving runs its
windows against the same model, and the checkpointer's save is the overlapped one."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import pytest

from bench import save_cost_bench


def test_every_way_of_saving_runs_its_windows_and_everything_written_is_removed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        logging_restored: None) -> None:
    monkeypatch.setenv("SPOTTRAIN_BENCH_GB", "0.003")
    monkeypatch.setenv("SPOTTRAIN_BENCH_DIR", str(tmp_path))
    save_cost_bench.main(["--steps", "2", "--rounds", "1", "--batch", "8"])
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in out.splitlines() if line.startswith("| ") and "---" not in line}
    assert set(rows) == {"way of saving", *save_cost_bench.WAYS}
    assert all(float(rows[w][0]) > 0 for w in save_cost_bench.WAYS)  # each saved, in its call
    assert out.count("goal <= 0.03") == 4 and out.count("goal <= 0.5") == 4
    assert "interquartile range of every baseline step" in out
    assert list(tmp_path.iterdir()) == []


@contextlib.contextmanager
def a_way(name: str, d: Path) -> Iterator[save_cost_bench._Way]:
    """One way of saving, bound to a small model that has trained a step (AdamW's state exists)."""
    model, opt = save_cost_bench._model(32)
    save_cost_bench._window(model, opt, [save_cost_bench.torch.randn(4, 32)], 1, None, 0)
    way = save_cost_bench._Way(name, model, opt, d)
    try:
        yield way
    finally:
        way.close()


def test_the_checkpointer_in_the_bench_copies_the_weights_beside_the_step(tmp_path: Path) -> None:
    with a_way("spottrain", tmp_path) as way:
        way.save(1)
        assert way._ckpt._copying.snap.copy is not None  # bound as the trainer binds it: a copy runs behind


def test_dcp_with_async_staging_waits_for_its_staging_before_the_optimizer_step(tmp_path: Path) -> None:
    # As DCP's documentation asks: the optimizer step must not write what staging still copies.
    waited: list[str] = []

    class Staging:
        def result(self) -> None:
            waited.append("staging")

    with a_way("DCP, async staging", tmp_path) as way:
        try:
            way._pending = type("Pending", (), {"staging_completion": Staging()})()
            way.before_update()
            assert waited == ["staging"]
            way.after_step(1)  # asking the checkpointer's due() is spottrain's alone
            assert waited == ["staging"]
        finally:
            way._pending = None  # no save of DCP's own for close() to wait for


def test_asking_for_cuda_without_a_gpu_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    if save_cost_bench.torch.cuda.is_available():
        pytest.skip("this machine has a GPU: --device cuda is valid here")
    with pytest.raises(SystemExit) as e:
        save_cost_bench.main(["--device", "cuda"])
    assert e.value.code == 2
    assert "--device cuda: this torch sees no CUDA device" in capsys.readouterr().err


def test_dcp_saves_again_after_a_pytorch_before_2_13_closed_its_stager(tmp_path: Path) -> None:
    # PyTorch 2.11's DefaultStager closes its StateDictStager after a pinned stage, emptying its copy
    # table: the bench's next DCP save failed with KeyError <class 'type'> on an H200.
    with a_way("DCP, reused stager", tmp_path) as way:
        way.save(1)
        way.finish()
        way._stager._state_dict_stager.close()  # what 2.11's _stage does after each stage
        way.save(2)
        way.finish()
        assert way.restaged == 1
        assert any((tmp_path / "dcp").iterdir())
