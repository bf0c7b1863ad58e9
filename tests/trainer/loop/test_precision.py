"""trainer/precision.py: a CPU run trains in the precision its fingerprint records (bf16 and fp16
autocast, fp16's grad scaler), resumes exactly through a real SIGTERM, and a precision the
installed PyTorch cannot do is refused naming the file and the field."""
from __future__ import annotations

import threading
import warnings
from pathlib import Path

import pytest
import torch

from trainer.loop import precision
from trainer.config import RunConfig, StatusConfig, load_run_config
from trainer.status import collect
from trainer.train import run
from tests.trainer import example_task
from tests.trainer.support import restore_logging  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("restore_logging")


def _cfg(run_dir: Path, prec: str, **kw: object) -> RunConfig:
    return RunConfig(run_dir=run_dir, steps=20, task="tests.trainer.example_task:build", batch_size=4,
                     grad_accum_steps=3, health_port=None, watch_metadata=False, checkpoint_every_steps=7,
                     precision=prec, device="cpu", **kw)


def _digest(run_dir: Path) -> str:
    return collect(StatusConfig(run_dir=run_dir))["model_digest"]


@pytest.mark.parametrize("prec", ["bf16", "fp16"])
def test_cpu_autocast_is_honoured(prec: str) -> None:
    mixed = precision.setup(prec, torch.device("cpu"), "trainer.toml")
    with mixed.autocast():
        a = torch.ones(2, 2)
        assert torch.mm(a, a).dtype == precision.DTYPES[prec]
    assert (mixed.scaler is not None) == (prec == "fp16")
    plain = precision.setup("fp32", torch.device("cpu"), "trainer.toml")
    with plain.autocast():
        assert torch.mm(a, a).dtype == torch.float32
    assert plain.scaler is None


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals need the main thread")
@pytest.mark.parametrize("prec", ["bf16", "fp16"])
def test_a_cpu_run_in_half_precision_trains_in_it_and_resumes_exactly_through_sigterm(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prec: str) -> None:
    example_task.FETCHES[0] = 0
    assert run(_cfg(tmp_path / "fp32", "fp32")).code == 0
    example_task.FETCHES[0] = 0
    assert run(_cfg(tmp_path / "ref", prec)).code == 0
    ref = _digest(tmp_path / "ref")
    # Other numbers than fp32's: the run trained in the precision its fingerprint records.
    assert ref != _digest(tmp_path / "fp32")

    # 4 samples per micro-batch, 3 per step: fetch 50 is inside step 5's 2nd micro-batch.
    monkeypatch.setenv("SIGTERM_AT_FETCH", "50")
    example_task.FETCHES[0] = 0
    out = run(_cfg(tmp_path / "run", prec))
    assert (out.code, out.steps_run) == (75, 5)
    monkeypatch.delenv("SIGTERM_AT_FETCH")
    out = run(_cfg(tmp_path / "run", prec, checkpoint_every_seconds=0.05))
    assert (out.code, out.steps_run) == (0, 15)
    assert _digest(tmp_path / "run") == ref


def _old_torch_autocast(monkeypatch: pytest.MonkeyPatch) -> None:
    """Autocast as PyTorch 2.1 did on the CPU: bf16 only; another dtype is switched off with a
    warning, and the run would silently compute in fp32."""
    real = torch.autocast

    def autocast(device_type: str, dtype: torch.dtype | None = None, **kw: object) -> torch.autocast:
        if device_type == "cpu" and dtype is not torch.bfloat16:
            warnings.warn("In CPU autocast, but the target dtype is not supported. Disabling autocast.")
            return real(device_type, dtype=dtype, enabled=False)
        return real(device_type, dtype=dtype, **kw)

    monkeypatch.setattr(torch, "autocast", autocast)


def test_a_precision_this_torch_cannot_autocast_is_refused_naming_file_and_field(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _old_torch_autocast(monkeypatch)
    config = tmp_path / "trainer.toml"
    config.write_text('precision = "fp16"\ndevice = "cpu"\nhealth_port = "none"\nwatch_metadata = false\n'
                      'task = "tests.trainer.example_task:build"\n')
    cfg = load_run_config({"run_dir": tmp_path / "run", "steps": 5}, config)
    out = run(cfg)
    assert out.code == 2
    assert out.reason.startswith(f"{config}: precision: 'fp16' cannot train on cpu"), out.reason
    assert "allowed: 'fp32'" in out.reason
    assert not (tmp_path / "run").exists()  # refused before it touched the run dir
    # bf16 still autocasts on that torch: honoured, not refused.
    assert precision.setup("bf16", torch.device("cpu"), str(config)).scaler is None


def test_fp16_without_a_grad_scaler_for_the_device_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_cpu_scaler(device: str = "cuda", *a: object, **kw: object) -> None:
        raise TypeError(f"GradScaler has no {device} implementation")  # PyTorch before torch.amp's

    monkeypatch.setattr(torch.amp, "GradScaler", no_cpu_scaler)
    with pytest.raises(precision.UnsupportedPrecision, match=r"^t\.toml: precision: 'fp16' cannot train on cpu.*"
                                                               r"no grad scaler"):
        precision.setup("fp16", torch.device("cpu"), "t.toml")
