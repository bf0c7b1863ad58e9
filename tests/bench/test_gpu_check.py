"""bench/gpu_check.sh, the one command a session with a GPU runs, kept working on CPU: the same
checks with gloo, against the real trainer."""
from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_runs_its_checks_on_cpu_and_reports_them(tmp_path: Path) -> None:
    r = subprocess.run(["bash", "bench/gpu_check.sh", "--only", "resume-fp32,torchrun-fsdp,snapshot",
                        "--snapshot-gib", "0.05", "--out", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    report = (tmp_path / "gpu_check.md").read_text()
    assert "| resume-fp32 | PASS |" in report
    assert "| torchrun-fsdp | PASS | 2 processes (gloo)" in report
    assert "| snapshot | measured |" in report
    assert "device: no CUDA device" in report
