"""bench/gpu_check.sh, the one command a session with a GPU runs, kept working on CPU: the same
checks with gloo, against the real trainer."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_runs_its_checks_on_cpu_and_reports_them(tmp_path: Path) -> None:
    r = subprocess.run(["bash", "bench/gpu_check.sh", "--only", "resume-fp32,torchrun-fsdp,restore-ddp,snapshot,snapshot-overlap",
                        "--snapshot-gib", "0.05", "--restore-gib", "0.05", "--out", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    report = (tmp_path / "gpu_check.md").read_text()
    assert "| resume-fp32 | PASS |" in report
    assert "| torchrun-fsdp | PASS | 2 processes (gloo)" in report
    assert "| restore-ddp | PASS | 2 ranks (gloo)" in report and "every rank holds the saved state" in report
    assert "| snapshot | measured |" in report
    assert "| snapshot-overlap | PASS |" in report
    assert "device: no CUDA device" in report


def test_the_wheels_it_carries_are_all_the_trainer_imports_besides_torch() -> None:
    """A GPU image's Python has torch and what torch needs; everything else the trainer imports
    while it trains must be in gpu_check.sh's WHEELS (google_crc32c was missing: every run on an
    H200 exited 1 at import)."""
    import re

    script = (ROOT / "bench" / "gpu_check.sh").read_text()
    wheels = re.search(r"^WHEELS=\(([^)]*)\)", script, re.M).group(1).split()
    probe = f"""
import importlib.metadata as md, re, sys
allowed = set(sys.stdlib_module_names) | {{"torch", "bench", "trainer", "drill"}}
for req in (md.requires("torch") or []) + [n for w in {wheels!r} for n in [w] + (md.requires(w) or [])]:
    name = re.match(r"[A-Za-z0-9_.-]+", req).group(0)
    try:
        top = (md.distribution(name).read_text("top_level.txt") or "").split()
        files = [str(f).split("/")[0] for f in md.distribution(name).files or []]
    except md.PackageNotFoundError:
        continue
    allowed |= set(top) | {{f.removesuffix(".py") for f in files if not f.endswith((".dist-info", ".pth"))}}
class Refuse:  # what the trainer's own code imports, not torch's optional probes
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in allowed:
            return None
        f = sys._getframe(1)
        while f is not None and f.f_code.co_filename.startswith("<frozen"):
            f = f.f_back
        if f is not None and f.f_code.co_filename.startswith({str(ROOT)!r}):
            raise ModuleNotFoundError(f"not shipped to a GPU image: {{fullname}}")
        return None
sys.meta_path.insert(0, Refuse())
import trainer.train, trainer.checkpoint.sharded, trainer.tasks.gpt, bench.gpu_check
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_the_own_loop_check_runs_the_own_loop_bench_on_the_device(tmp_path: Path) -> None:
    """`own-loop`: bench/own_loop_bench.py through gpu_check.sh (on CPU here, CUDA on a lent GPU):
    a measurement, with both loops' steps/s and their ratio."""
    r = subprocess.run(["bash", "bench/gpu_check.sh", "--only", "own-loop", "--out", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    report = (tmp_path / "gpu_check.md").read_text()
    row = next(line for line in report.splitlines() if line.startswith("| own-loop |"))
    assert row.startswith("| own-loop | measured | steps/s spottrain "), row
    assert "/ plain torch " in row and "= ratio " in row and " on cpu " in row, row
