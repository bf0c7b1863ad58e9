"""main.py as cdktn runs it: a real subprocess, real files, real exit status."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from stack_support import EXAMPLE, FIXTURES

ROOT = Path(__file__).resolve().parents[2]


def run_main(tmp_path: Path, target: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "SPOTTRAIN_EXPERIMENTS": str(target),
           "CDKTF_OUTDIR": str(tmp_path / "out"), "CHECKPOINT_DISABLE": "1",
           "DISABLE_VERSION_CHECK": "1"}
    return subprocess.run([sys.executable, str(ROOT / "main.py")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_bad_file_exits_2_with_one_line_per_problem_and_no_traceback(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(EXAMPLE.read_text()
                   .replace('gpu_type = "nvidia-l4"', 'gpu_type = "nvidia-tesla-t4"')
                   .replace("steps = 20000", "steps = -5"))
    proc = run_main(tmp_path, bad)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == [
        f"{bad}: machine.gpu_type: g2-standard-8 has nvidia-l4 built in, not 'nvidia-tesla-t4'; "
        'allowed: "nvidia-l4"',
        f"{bad}: trainer.steps: Input should be greater than or equal to 1, got -5",
    ]
    assert not (tmp_path / "out").exists()


def test_toml_syntax_error_exits_2(tmp_path):
    bad = tmp_path / "broken.toml"
    bad.write_text("[gcp]\nproject = 'unterminated\n")
    proc = run_main(tmp_path, bad)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"{bad}: TOML syntax error: ")
    assert "line 2" in proc.stderr


@pytest.mark.xdist_group("stacks")
def test_folder_override_synthesizes_one_stack_per_file_and_warns_on_budget(tmp_path):
    proc = run_main(tmp_path, FIXTURES)
    assert proc.returncode == 0, proc.stderr
    stacks = sorted(p.name for p in (tmp_path / "out" / "stacks").iterdir())
    assert stacks == ["a3-regional", "l4-pool", "n1-v100-standard"]
    a3 = json.loads((tmp_path / "out" / "stacks" / "a3-regional" / "cdk.tf.json").read_text())
    assert "google_compute_region_instance_group_manager" in a3["resource"]
    # 9 GB at 960 MB/s (2000 GB x 0.48) = 9.4 s of 20: fits; the pool's (fsdp: 8 GB / 2 nodes =
    # 4 GB per node at 480 MB/s = 8.3 s of 20) fits; the N1 one (32 GB at 240 MB/s = 133 s of
    # 110, standard) does not.
    warnings = [line for line in proc.stderr.splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and "n1-v100-standard.toml" in warnings[0]


def test_a_bad_file_is_answered_before_cdktn_is_imported(tmp_path):
    """Reading and checking an experiment (main.py, preflight, cost, demo) imports no cdktn: its
    jsii runtime costs seconds to start (3.8 CPU-seconds for a bad file's one line, before), and a
    bad file is answered without it."""
    bad = tmp_path / "broken.toml"
    bad.write_text("[gcp]\nproject = 'unterminated\n")
    probe = ("import sys\n"
             "from pathlib import Path\n"
             "import stacks.cost, stacks.demo, stacks.deploy, stacks.preflight\n"
             "from stacks.app import main\n"
             f"rc = main(Path({str(bad)!r}))\n"
             "print(rc, sorted(m for m in ('cdktn', 'constructs', 'jsii') if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "2 []", proc.stdout + proc.stderr
    assert proc.stderr.startswith(f"{bad}: TOML syntax error: ")
