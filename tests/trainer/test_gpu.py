"""trainer/gpu.py: the GPU against the PyTorch build's arch list, decided on CPU with injected
capabilities (no GPU here), and the trainer refusing such a GPU as bad input (exit 2)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer import EXIT_BAD_INPUT, gpu
from trainer.config import RunConfig
from trainer.train import run
from tests.trainer.support import restore_logging  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("restore_logging")

#: torch.cuda.get_arch_list() of the x86_64 CUDA 12.9 builds of PyTorch 2.8/2.9 (the default
#: image family's), per pytorch/pytorch .ci/manywheel/build_cuda.sh: 7.0 ... 12.0+PTX.
CU129 = ["sm_70", "sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120"]
#: CUDA 12.6 builds still carried Maxwell and Pascal.
CU126 = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]


@pytest.mark.parametrize(("gpu_name", "capability", "arch_list", "ok"), [
    ("P100", (6, 0), CU129, False),   # Pascal: dropped from the cu128/cu129 builds
    ("P4", (6, 1), CU129, False),
    ("V100", (7, 0), CU129, True),
    ("T4", (7, 5), CU129, True),
    ("A100", (8, 0), CU129, True),
    ("L4", (8, 9), CU129, True),      # no sm_89 cubin: the sm_86 one runs (same major, minor >=)
    ("H100", (9, 0), CU129, True),
    ("P100", (6, 0), CU126, True),
    ("P4", (6, 1), CU126, True),      # sm_60 code runs on 6.1
    ("future", (12, 1), CU129, True),  # sm_120 cubin, and the PTX besides
    ("future", (13, 0), CU129, True),  # only the compute_120 PTX: JIT-compiled for newer GPUs
    ("future", (13, 0), CU129[:-1], False),  # without PTX nothing runs on a newer major
    ("H100", (9, 0), ["sm_90a"], True),   # architecture-specific code: exactly that one
    ("next", (9, 1), ["sm_90a"], False),
    ("any", (6, 0), [], True),        # a CPU (or ROCm) build: nothing to check
])
def test_which_gpus_a_build_runs_on(gpu_name, capability, arch_list, ok):
    assert gpu.runs_on(capability, arch_list) is ok


def test_the_message_names_the_gpu_its_sm_and_the_builds_arch_list():
    msg = gpu.problem("Tesla P100-PCIE-16GB", (6, 0), CU129, "2.9.0+cu129")
    assert msg is not None
    assert "Tesla P100-PCIE-16GB" in msg and "sm_60" in msg and "2.9.0+cu129" in msg
    assert " ".join(CU129) in msg
    assert gpu.problem("NVIDIA L4", (8, 9), CU129, "2.9.0+cu129") is None


def test_cpu_devices_are_not_checked():
    gpu.check(torch.device("cpu"))  # nothing to ask, nothing raised


def test_the_trainer_refuses_an_unsupported_gpu_as_bad_input(tmp_path: Path, monkeypatch, capfd):
    """Exit 2 (RestartPreventExitStatus of the unit) before any kernel runs, with the reason."""
    described = []

    def fake_p100(device):  # the hardware query, standing in for a GPU that cannot exist here
        described.append(device)
        return "Tesla P100-PCIE-16GB", (6, 0), CU129, "2.9.0+cu129"

    monkeypatch.setattr(gpu, "_describe", fake_p100)
    cfg = RunConfig(run_dir=tmp_path / "run", steps=5, task="tests.trainer.example_task:build",
                    batch_size=4, health_port=None, watch_metadata=False, device="cuda")
    out = run(cfg)
    assert out.code == EXIT_BAD_INPUT
    assert described and described[0].type == "cuda"
    err = capfd.readouterr().err
    assert "event=failed reason=bad_input GPU Tesla P100-PCIE-16GB has compute capability " \
           "sm_60" in err, err
    assert not list((tmp_path / "run").glob("step-*"))  # nothing trained, nothing saved

