"""Your own loop under spottrain against the same loop without it: steps/s side by side.

- ``spottrain``: examples/own_loop/train.py (pytorch/examples' MNIST, its `# spottrain` lines) run
  the way a VM runs it, `python -m trainer run --script examples/own_loop/train.py`, in-process
  (`trainer.train.run`): the run's data order (`run.batches`), its steps (`run.steps`: the notice
  flag, the checkpoint cadence at the defaults, the health beat, the step events, the undeclared-
  state guard), checkpointing at the defaults (the automatic Young/Daly interval);
- ``plain torch``: the same script as pytorch/examples has it, without spottrain: the same
  `Net`, `Strokes` data, Adadelta, per-epoch `StepLR`, batch size and steps, a `DataLoader`
  shuffling with a seeded generator, no trainer at all (`plain_loop` below).

Each run is its own process (a fresh interpreter: no variant inherits the other's torch
settings or warm caches), and the variants alternate, so that the machine's load hits both alike.
Only the loop is timed, from before the first step to after the last: spottrain's start-up, restore
and final save are outside (they are paid once per session, not per step; BENCHMARKS.md has the save
benches), and so are the plain loop's imports and model construction. 1 torch thread for both
(the trainer's default ``threads``); spottrain also keeps its default ``deterministic = true``
(`torch.use_deterministic_algorithms`), part of what its path costs.

Three figures per run: the whole loop (first step to last), and the steady state, from the start
of step ``WARM`` to the start of the last step (both loops stamp the start of each step: the
spottrain one where `run.steps()` hands it out), which leaves out what a session pays once at its
first steps (spottrain's check for undeclared state scans the process's objects around step 1);
and that steady span's steps per second of *CPU time* of the whole process (``time.process_time``:
every thread, spottrain's checkpoint, health and lease threads included). On a shared machine the
wall figures move with other jobs' load by up to 2x between rounds; the CPU time a step costs moves
far less, so it is what shows the overhead there (on an idle machine or a GPU both say the same).
Each ratio is also taken per round (the two variants of a round ran back to back) and its median
given, which a load drift over the whole bench does not bias.

Goal: steps/s of the spottrain loop / the plain loop >= 0.98.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import runpy
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "examples" / "own_loop" / "train.py"
WARM = 10  # the steady state starts at this step
VARIANTS = {"plain": "plain torch (no spottrain)", "spottrain": "spottrain own loop (`trainer run --script`)"}


def _script_args(batch: int, samples: int) -> list[str]:
    return ["--batch-size", str(batch), "--samples", str(samples)]


def plain_loop(steps: int, batch: int, samples: int, device: str = "cpu", seed: int = 0) -> dict[str, Any]:
    """The example's loop as pytorch/examples writes it, without spottrain: its own epochs over a
    shuffling DataLoader, a per-epoch scheduler, nothing else (on CUDA, one synchronisation at the
    end, before the clock stops)."""
    import torch
    import torch.nn.functional as F
    from torch.optim.lr_scheduler import StepLR

    torch.set_num_threads(1)
    example = runpy.run_path(str(SCRIPT), run_name="own_loop_example")  # Net and Strokes, untouched
    torch.manual_seed(seed)
    model = example["Net"]().to(device)
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    scheduler = StepLR(optimizer, step_size=1, gamma=0.7)
    loader = torch.utils.data.DataLoader(example["Strokes"](samples), batch_size=batch, shuffle=True,
                                         drop_last=True, generator=torch.Generator().manual_seed(seed))
    model.train()
    done = 0
    stamps: list[float] = []
    cpu: list[float] = []
    t0 = time.monotonic()
    while done < steps:
        for data, target in loader:
            stamps.append(time.monotonic())
            cpu.append(time.process_time())
            data, target = data.to(device), target.to(device)
            optimizer.zero_grad()
            output = model(data)
            loss = F.nll_loss(output, target)
            loss.backward()
            optimizer.step()
            done += 1
            if done == steps:
                break
        scheduler.step()  # per epoch, as the original
    if device == "cuda":
        torch.cuda.synchronize()
    loop_s = time.monotonic() - t0
    return {"steps": done, "loop_s": loop_s, "saves": 0, "final_loss": float(loss), **_steady(stamps, cpu)}


def _steady(stamps: list[float], cpu: list[float]) -> dict[str, float]:
    """Steps/s from the start of step ``WARM`` to the start of the last one, in wall time and in
    the process's CPU time (none in a short run)."""
    if len(stamps) <= WARM + 1:
        return {"steady_steps_per_s": float("nan"), "cpu_steps_per_s": float("nan")}
    n = len(stamps) - 1 - WARM
    return {"steady_steps_per_s": n / (stamps[-1] - stamps[WARM]), "cpu_steps_per_s": n / (cpu[-1] - cpu[WARM])}


def spottrain_loop(steps: int, batch: int, samples: int, run_dir: Path, device: str = "cpu") -> dict[str, Any]:
    """The example under `python -m trainer run --script`, in this process: the trainer's own
    timing of the loop (`trainer.loop.steps.Steps.loop_s`, the same span as `plain_loop`'s)."""
    import trainer.run
    from trainer.config import RunConfig
    from trainer.train import run

    runs: list[Any] = []
    prepare = trainer.run.prepare

    def keep(s: Any) -> Any:  # the Run the script iterates, to read its Steps' timing afterwards
        runs.append(prepare(s))
        return runs[-1]

    trainer.run.prepare = keep  # type: ignore[assignment]
    stamps: list[float] = []
    cpu: list[float] = []
    steps_of = trainer.run.Run.steps

    def stamped(self: Any) -> Any:  # the start of each step, as the script's loop receives it
        for step in steps_of(self):
            stamps.append(time.monotonic())
            cpu.append(time.process_time())
            yield step

    trainer.run.Run.steps = stamped  # type: ignore[method-assign]
    cfg = RunConfig(run_dir=run_dir, steps=steps, health_port=None, watch_metadata=False, batch_size=batch, device=device,
                    script=str(SCRIPT.relative_to(REPO)), script_args=_script_args(batch, samples))
    out = run(cfg)
    if out.code != 0 or not runs or runs[0].outcome is None:
        raise SystemExit(f"own_loop_bench: the spottrain run failed: exit {out.code} {out.reason}")
    steps_obj = runs[0].outcome
    saves = sorted(p.name for p in run_dir.glob("step-*"))
    return {"steps": steps_obj.done - runs[0].start_step, "loop_s": steps_obj.loop_s, "saves": len(saves),
            "final_loss": steps_obj._loss, **_steady(stamps, cpu)}


def _one(variant: str, steps: int, batch: int, samples: int, root: Path, device: str = "cpu") -> dict[str, Any]:
    """One run of ``variant`` in a fresh interpreter (`--one`); its figures as a dict."""
    path = os.environ.get("PYTHONPATH")  # kept after the repository (gpu_check.sh's carried wheels)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO) + (os.pathsep + path if path else "")}
    if not env.get("SPOTTRAIN_CHECKPOINT_KEY_FILE"):  # a throwaway key, never the user's default
        key = root / "checkpoint.key"
        if not key.exists():
            key.write_bytes(os.urandom(32))
            key.chmod(0o600)
        env["SPOTTRAIN_CHECKPOINT_KEY_FILE"] = str(key)
    run_dir = Path(tempfile.mkdtemp(dir=root))
    proc = subprocess.run([sys.executable, "-m", "bench.own_loop_bench", "--one", variant, "--steps", str(steps),
                           "--batch", str(batch), "--samples", str(samples), "--run-dir", str(run_dir),
                           "--device", device],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"own_loop_bench: {variant} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n"
                           f"{proc.stderr[-4000:]}")
    result = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    result["steps_per_s"] = result["steps"] / result["loop_s"]
    return result


def measure(steps: int, rounds: int, batch: int, samples: int, device: str = "cpu") -> dict[str, list[dict[str, Any]]]:
    results: dict[str, list[dict[str, Any]]] = {k: [] for k in VARIANTS}
    order = list(VARIANTS)
    with tempfile.TemporaryDirectory(prefix="spottrain-own-loop-bench-") as tmp:
        for i in range(rounds):
            for variant in order[i % 2:] + order[:i % 2]:  # alternate: no variant always runs first
                results[variant].append(_one(variant, steps, batch, samples, Path(tmp), device))
    return results


def table(results: dict[str, list[dict[str, Any]]], steps: int, batch: int, samples: int, device: str = "cpu") -> str:
    import torch

    mean_s = statistics.mean(r["loop_s"] for rs in results.values() for r in rs)
    lines = [
        f"examples/own_loop/train.py (MNIST Net, 1.2 M parameters, Adadelta, StepLR), batch {batch}, {samples} "
        f"samples, {steps} steps x {len(results['plain'])} rounds, interleaved, 1 torch thread, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        + (f"{torch.cuda.get_device_name(0)}, " if device == "cuda" else "") +
        f"{mean_s:.0f} s per loop",
        "",
        "| variant | figure | steps/s (median) | ratio of the medians | ratio per round (median) | steps/s per round |",
        "|---|---|---|---|---|---|",
    ]
    figures = {"steps_per_s": "wall, whole loop", "steady_steps_per_s": f"wall, from step {WARM}",
               "cpu_steps_per_s": f"CPU time, from step {WARM}"}
    for key, rs in results.items():
        for fig, label in figures.items():
            base = statistics.median(r[fig] for r in results["plain"])
            sps = statistics.median(r[fig] for r in rs)
            paired = statistics.median(r[fig] / p[fig] for r, p in zip(rs, results["plain"]))
            each = ", ".join(f"{r[fig]:.2f}" for r in rs)
            lines.append(f"| {VARIANTS[key]} | {label} | {sps:.2f} | {sps / base:.3f} | {paired:.3f} | {each} |")
    saves = statistics.median(r["saves"] for r in results["spottrain"])
    lines += ["", f"Saves: {saves:.0f}, spottrain's checkpoints on disk after the run, the final one included "
              "(made after the timed loop); the default interval saves first 60 s after start."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--samples", type=int, default=6000)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where both loops train (bench/gpu_check.sh's own-loop check: cuda)")
    p.add_argument("--one", choices=sorted(VARIANTS), help=argparse.SUPPRESS)  # one run, its figures as JSON
    p.add_argument("--run-dir", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args(argv or [])  # `python -m bench` calls main() with its own argv in sys.argv
    if a.one == "plain":
        print(json.dumps(plain_loop(a.steps, a.batch, a.samples, a.device)))
        return
    if a.one == "spottrain":
        print(json.dumps(spottrain_loop(a.steps, a.batch, a.samples, a.run_dir, a.device)))
        return
    t0 = time.monotonic()
    results = measure(a.steps, a.rounds, a.batch, a.samples, a.device)
    print(table(results, a.steps, a.batch, a.samples, a.device))
    print(f"\n(measured in {time.monotonic() - t0:.0f}s)")


if __name__ == "__main__":
    main(sys.argv[1:])
