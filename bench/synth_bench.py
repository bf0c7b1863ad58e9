"""Synthesis time against the import floor, measured side by side in one run.

Each measurement is a fresh Python process (what `cdktn synth` pays every time):
  import floor  - import cdktn and the provider submodules the stack uses, nothing else;
  example       - `main.py` on experiments/example.toml;
  ten           - `main.py` on ten experiments (the example in ten shapes) at once.
Goal: ten experiments synthesize in at most 1.5x the import floor. Repeats: $BENCH_REPEATS (5).
"""

from __future__ import annotations

import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "experiments" / "example.toml"
GOAL = 1.5

IMPORT_FLOOR = """
import stacks  # environment defaults only
import cdktn
from cdktn_provider_google import (compute_firewall, compute_health_check,
    compute_instance_group_manager, compute_instance_template, compute_network, compute_router,
    compute_router_nat, compute_region_instance_group_manager, compute_subnetwork,
    project_iam_member, provider, service_account, storage_bucket, storage_bucket_iam_member)
"""

#: Ten experiment shapes: (name, TOML lines replaced in the example).
SHAPES: list[tuple[str, dict[str, str]]] = [
    ("l4", {}),
    ("l4x4", {'machine_type = "g2-standard-8"': 'machine_type = "g2-standard-48"',
              "gpu_count = 1": "gpu_count = 4"}),
    ("h100", {'machine_type = "g2-standard-8"': 'machine_type = "a3-highgpu-8g"',
              'gpu_type = "nvidia-l4"': 'gpu_type = "nvidia-h100-80gb"',
              "gpu_count = 1": "gpu_count = 8"}),
    ("a100", {'machine_type = "g2-standard-8"': 'machine_type = "a2-highgpu-1g"',
              'gpu_type = "nvidia-l4"': 'gpu_type = "nvidia-tesla-a100"'}),
    ("a100-80", {'machine_type = "g2-standard-8"': 'machine_type = "a2-ultragpu-1g"',
                 'gpu_type = "nvidia-l4"': 'gpu_type = "nvidia-a100-80gb"'}),
    ("t4", {'machine_type = "g2-standard-8"': 'machine_type = "n1-standard-8"',
            'gpu_type = "nvidia-l4"': 'gpu_type = "nvidia-tesla-t4"'}),
    ("v100", {'machine_type = "g2-standard-8"': 'machine_type = "n1-standard-8"',
              'gpu_type = "nvidia-l4"': 'gpu_type = "nvidia-tesla-v100"'}),
    ("regional", {'zones = ["us-central1-a"]': 'zones = ["us-central1-a", "us-central1-b"]',
                  'placement = "zonal"': 'placement = "regional"'}),
    ("standard", {'provisioning = "spot"': 'provisioning = "standard"',
                  'termination_action = "DELETE"': ""}),
    ("no-ssh", {"iap_ssh = true": "iap_ssh = false"}),
]


def write_experiments(folder: Path) -> None:
    base = EXAMPLE.read_text()
    for name, edits in SHAPES:
        text = base
        for old, new in edits.items():
            assert old in text, (name, old)
            text = text.replace(old, new)
        tomllib.loads(text)
        (folder / f"bench-{name}.toml").write_text(text)


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Wall seconds, and CPU seconds of the process and its children (Node included): the CPU
    figure is steadier on a shared machine."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main() -> None:
    repeats = int(os.environ.get("BENCH_REPEATS", "5"))
    py = sys.executable
    with tempfile.TemporaryDirectory(prefix="spottrain-bench-") as tmp:
        folder = Path(tmp) / "ten"
        folder.mkdir()
        write_experiments(folder)
        env = {**os.environ, "CDKTF_OUTDIR": str(Path(tmp) / "out"), "CHECKPOINT_DISABLE": "1",
               "DISABLE_VERSION_CHECK": "1", "PYTHONPATH": str(ROOT)}
        cases = {
            "import floor (cdktn + provider bindings)": [py, "-c", IMPORT_FLOOR],
            "synth example (1 stack)": [py, "main.py"],
            "synth ten experiments": [py, "main.py"],
        }
        envs = {
            "synth example (1 stack)": {**env, "SPOTTRAIN_EXPERIMENTS": str(EXAMPLE)},
            "synth ten experiments": {**env, "SPOTTRAIN_EXPERIMENTS": str(folder)},
        }
        times: dict[str, list[float]] = {k: [] for k in cases}
        cpus: dict[str, list[float]] = {k: [] for k in cases}
        timed(cases["import floor (cdktn + provider bindings)"], env)  # warm the file cache
        for _ in range(repeats):  # interleaved, so drift hits every case alike
            for key, cmd in cases.items():
                wall, cpu = timed(cmd, envs.get(key, env))
                times[key].append(wall)
                cpus[key].append(cpu)
    floor_key = "import floor (cdktn + provider bindings)"
    floor = statistics.median(times[floor_key])
    cpu_floor = statistics.median(cpus[floor_key])
    cpu = platform.processor() or platform.machine()
    print(f"### synth_bench: {platform.node() or 'host'}, {cpu}, {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}, {repeats} repeats\n")
    print("| measurement | wall median s | wall min-max s | x floor (wall) | CPU median s "
          "| x floor (CPU) |")
    print("|---|---:|---:|---:|---:|---:|")
    for key, samples in times.items():
        med, cpu = statistics.median(samples), statistics.median(cpus[key])
        print(f"| {key} | {med:.2f} | {min(samples):.2f}-{max(samples):.2f} | "
              f"{med / floor:.2f} | {cpu:.2f} | {cpu / cpu_floor:.2f} |")
    ratio = statistics.median(times["synth ten experiments"]) / floor
    cpu_ratio = statistics.median(cpus["synth ten experiments"]) / cpu_floor
    verdict = "meets" if ratio <= GOAL else "MISSES"
    print(f"\nten experiments / import floor = {ratio:.2f} wall, {cpu_ratio:.2f} CPU "
          f"({verdict} the goal of <= {GOAL})")


if __name__ == "__main__":
    main()
