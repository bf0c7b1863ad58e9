"""What one save costs the training loop, measured in the loop, side by side in one run.

A model of 16 linear layers with BatchNorm and its AdamW (the state is the weights and the two
moments: ``SPOTTRAIN_BENCH_GB`` of them, default 0.75) trains on random batches. In each round
every way of saving gets a window of ``--steps`` training steps with one save at its start, each
right after a window of the same steps without a save (the baseline it is compared with), the
order rotating from round to round:

- ``spottrain``: ``Checkpointer.save`` (the persistent tier, a signed manifest), bound to the
  model and the optimizer as the trainer binds them: the weights and the optimizer state are
  copied beside the next forward and backward, and the optimizer step calls ``before_update``;
  the loop asks ``due()`` at every step, as the trainer's does, and the write runs at the lowest
  CPU priority until a quarter of the time between two of its saves has passed
  (``trainer.checkpoint.yielding``; here about 10 s, more than a window);
- ``DCP, reused stager``: ``torch.distributed.checkpoint.async_save`` with one ``DefaultStager``
  kept for the run (no async staging: the call returns once the state is copied);
- ``DCP, async staging``: the same with ``use_async_staging``: the call returns at once and the
  optimizer step waits for ``staging_completion``, as DCP's documentation asks;
- ``torch.save+fsync``: the plain synchronous save of the same state.

Per way of saving, medians over the rounds:

- ``call``: seconds until the save call returned (what earlier tables called blocked time);
- ``held``: the call plus the next optimizer step's wait for the copy, both timed in the loop;
- ``step lost``: the duration of the step with the save (the call to the end of the next
  optimizer step) minus the median step of the baseline window;
- ``step lost, paired``: the same minus the baseline window's first step instead (the first step
  of a window follows the previous window's end, as the step with a save does);
- ``window lost``: the window's steps minus as many baseline steps: also what the save's
  background work (copy, hashing, write) took from the steps while it ran on the same cores.

Where a step's time varies by more than the goal (a CPU-bound loop on a small shared VM), the
table says how much a step varies and what the medians can resolve: more ``--rounds`` resolve more.

Goal: the loop loses per save (``step lost``) <= 0.03 of ``torch.save``+fsync and <= 0.5 of
DCP's reused-stager call. Run: ``python -m bench save_cost_bench`` or ``python -m
bench.save_cost_bench [--steps N] [--rounds N] [--batch N] [--threads N] [--device cuda]`` (the
loop's torch threads, default 1 as the trainer's ``threads``); ``SPOTTRAIN_BENCH_DIR`` (directory
on the disk to measure, default the system temp dir). Everything written is removed at the end.

With ``--device cuda`` the model, its optimizer state and the batches live on the GPU: the
checkpointer then copies on a side stream into pinned memory and the optimizer's stream waits on
an event, DCP stages into pinned memory with non-blocking copies, and a step ends when the
training stream has run it (that stream alone is synchronized, so a copy on another stream is not
waited for by the timing itself). A GPU step is short at the default batch; ``--batch`` sets how
much work a step is.
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from bench.checkpoint_bench import KEY, _machine

LAYERS = 16
MiB = 1 << 20
GiB = 1 << 30
WAYS = ("spottrain", "DCP, reused stager", "DCP, async staging", "torch.save+fsync")


def _width(state_bytes: float) -> int:
    """The layers' width for a state (weights + AdamW's two moments) of about ``state_bytes``."""
    return max(16, int(math.sqrt(state_bytes / 3 / LAYERS / 4)) // 16 * 16)


def _model(width: int, device: str = "cpu") -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(width, width), torch.nn.BatchNorm1d(width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _step_end(x: torch.Tensor) -> float:
    """When the step that produced ``x`` has run: on CUDA its stream's work is asynchronous, so
    wait for that stream (not the device: a side stream's copy must not be waited for here)."""
    if x.is_cuda:
        torch.cuda.current_stream(x.device).synchronize()
    return time.perf_counter()


class _Way:
    """One way of saving: ``save(step)`` (the call), ``before_update()`` (what the optimizer step
    waits for), ``done()`` (its background work finished) and ``finish()`` (wait for it)."""

    def __init__(self, name: str, model: torch.nn.Module, opt: torch.optim.Optimizer, d: Path) -> None:
        self.name, self.model, self.opt, self.d = name, model, opt, d
        self._pending: Any = None
        self.yielded = False  # the newest save's write began at the lowest priority
        self._ckpt: Any = None
        self._stager: Any = None
        self._dispatch: dict = {}
        self.restaged = 0  # saves whose stager had been closed by the previous one (PyTorch < 2.13)
        if name.startswith("spottrain"):
            from trainer.checkpoint.checkpointer import Checkpointer
            from trainer.checkpoint.tiers import Cadence, tier_table

            # A cadence the windows never reach: the bench decides when to save; due() then
            # applies only the bound on how long the write may yield, as between a trainer's saves.
            tiers = tier_table(d / name.replace(" ", "-"), cadence={"persistent": Cadence(every_steps=10**9)}, keep=1)
            self._ckpt = Checkpointer(tiers, key=KEY)
            self._ckpt.bind(model, opt)  # as the trainer binds them
        elif name.startswith("DCP"):
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            # Said at every save, from DCP's threads too: one process, as intended here.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")

            on_gpu = next(model.parameters()).is_cuda
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=on_gpu,
                                                        use_shared_memory=False,
                                                        use_async_staging=name.endswith("async staging"),
                                                        use_non_blocking_copy=on_gpu))
            # Before PyTorch 2.13, DefaultStager closes its StateDictStager after each pinned stage,
            # which empties the table its copy dispatches on: the next save fails with
            # KeyError <class 'type'> (seen on an H200 with 2.11). Given back before every save, DCP
            # runs as that release does otherwise, its pinned buffers freed and allocated again.
            inner = getattr(self._stager, "_state_dict_stager", None)
            self._dispatch = dict(getattr(inner, "_deepcopy_dispatch", None) or {})

    def state(self, step: int) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict(), "step": step,
                "rng": torch.get_rng_state()}

    def save(self, step: int) -> None:
        if self._ckpt is not None:
            before = self._ckpt.stats["writes_yielded"]
            self._ckpt.save(step, self.state(step))
            self.yielded = self._ckpt.stats["writes_yielded"] > before
        elif self._stager is not None:
            import torch.distributed.checkpoint as dcp

            shutil.rmtree(self.d / "dcp", ignore_errors=True)  # one checkpoint at a time, as keep=1
            inner = getattr(self._stager, "_state_dict_stager", None)
            if inner is not None and self._dispatch and not inner._deepcopy_dispatch:
                inner._deepcopy_dispatch.update(self._dispatch)
                self.restaged += 1
            self._pending = dcp.async_save(self.state(step), checkpoint_id=str(self.d / "dcp"),
                                           async_stager=self._stager, no_dist=True)
        else:
            p = self.d / "plain.pt"
            with open(p, "wb") as f:
                torch.save(self.state(step), f)
                f.flush()
                os.fsync(f.fileno())

    def before_update(self) -> None:
        if self._ckpt is not None:
            self._ckpt.before_update()
        elif self._pending is not None and hasattr(self._pending, "staging_completion"):
            self._pending.staging_completion.result()

    def after_step(self, step: int) -> None:
        if self._ckpt is not None:
            self._ckpt.due(step)  # the trainer asks at every step

    def _writes(self) -> list[Any]:
        if self._pending is None:
            return []
        return [self._pending.upload_completion] if hasattr(self._pending, "upload_completion") else [self._pending]

    def done(self) -> bool:
        if self._ckpt is not None:
            return not self._ckpt._writer.busy()
        return all(f.done() for f in self._writes())

    def finish(self) -> None:
        if self._ckpt is not None:
            self._ckpt.wait()
        for f in self._writes():
            f.result()
        self._pending = None

    def close(self) -> None:
        self.finish()
        if self._ckpt is not None:
            self._ckpt.close()
        if self._stager is not None:
            self._stager.close()


def _window(model: torch.nn.Module, opt: torch.optim.Optimizer, batches: list[torch.Tensor], steps: int,
            way: _Way | None, step: int) -> dict[str, Any]:
    """``steps`` training steps, a save by ``way`` before the first; each step's seconds."""
    ends: list[float] = []
    call = wait = 0.0
    t0 = time.perf_counter()
    if way is not None:
        way.save(step)
        call = time.perf_counter() - t0
    for k in range(steps):
        x = batches[k % len(batches)]
        model(x).square().mean().backward()
        if way is not None:
            t1 = time.perf_counter()
            way.before_update()
            wait += time.perf_counter() - t1
        opt.step()
        opt.zero_grad(set_to_none=True)
        if way is not None:
            way.after_step(step)
        ends.append(_step_end(x))
    durations = [e - s for s, e in zip([t0] + ends, ends)]
    out = {"steps": durations, "call": call, "held": call + wait,
           "done_in_window": way.done() if way is not None else True,
           "yielded": way is not None and way.yielded}
    if way is not None:
        way.finish()  # outside the window: the next one starts with nothing in the background
    return out


def measure(gb: float, steps: int, rounds: int, batch: int, d: Path,
            device: str = "cpu") -> tuple[dict[str, list[dict]], int]:
    width = _width(gb * GiB)
    model, opt = _model(width, device)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(batch, width, generator=g).to(device) for _ in range(4)]
    _window(model, opt, batches, 2, None, 0)  # AdamW's state exists from here on, as after a restore
    ways = {name: _Way(name, model, opt, d) for name in WAYS}
    results: dict[str, list[dict]] = {name: [] for name in WAYS}
    step = 0
    try:
        for name in WAYS:  # warm-up: every buffer allocated, every lazy import done
            step += 1
            _window(model, opt, batches, 1, ways[name], step)
        for r in range(rounds):
            order = list(WAYS[r % len(WAYS):] + WAYS[:r % len(WAYS)])
            for name in order:
                base = _window(model, opt, batches, steps, None, 0)
                step += 1
                got = _window(model, opt, batches, steps, ways[name], step)
                b = statistics.median(base["steps"])
                got["base_step"] = b
                got["base_steps"] = base["steps"]
                got["first_lost"] = got["steps"][0] - base["steps"][0]  # paired by position
                got["step_lost"] = got["steps"][0] - b
                got["window_lost"] = sum(got["steps"]) - steps * b
                got["restaged"] = ways[name].restaged
                results[name].append(got)
    finally:
        for w in ways.values():
            w.close()
    return results, width


def table(results: dict[str, list[dict]], *, gb_state: float, width: int, steps: int, batch: int,
          loads: list[float], machine: str, seconds: float, device: str = "cpu") -> str:
    med = {name: {k: statistics.median(r[k] for r in rs) for k in ("call", "held", "step_lost", "first_lost",
                                                                     "window_lost", "base_step")}
           for name, rs in results.items()}
    rounds = len(results[WAYS[0]])
    base = statistics.median(r["base_step"] for rs in results.values() for r in rs)
    q = statistics.quantiles([x for rs in results.values() for r in rs for x in r["base_steps"]], n=4)
    iqr = q[2] - q[0]
    # The median of `rounds` differences of two steps, each step's spread estimated from the
    # baseline's interquartile range (sigma ~ IQR / 1.349): about what the "lost" medians resolve.
    resolution = 1.2533 * math.sqrt(2) * iqr / 1.349 / math.sqrt(max(1, rounds))
    lines = [
        f"Machine: {machine}. Training on {device}. Load average (1 min) during the run: {min(loads):.1f}-{max(loads):.1f}. "
        f"State: {gb_state:.2f} GiB ({LAYERS} x Linear({width}, {width}) + BatchNorm1d, AdamW's two moments), "
        f"batch {batch}, median step without a save {base:.3f} s; "
        f"windows of {steps} steps, {rounds} rounds, medians; {seconds:.0f} s in all.",
        "",
        "| way of saving | call (s) | held: call + optimizer's wait (s) | step lost (s) | "
        "step lost, paired (s) | window lost (s) | background done within the window |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in WAYS:
        m, rs = med[name], results[name]
        lines.append(f"| {name} | {m['call']:.3f} | {m['held']:.3f} | {m['step_lost']:.3f} | {m['first_lost']:.3f} | "
                     f"{m['window_lost']:.3f} | "
                     f"{sum(r['done_in_window'] for r in rs)}/{len(rs)} |")
    ours, plain, dcp = med["spottrain"], med["torch.save+fsync"]["call"], med["DCP, reused stager"]["call"]
    rs = results["spottrain"]
    lines += ["", f"spottrain's write began at the lowest priority in {sum(r['yielded'] for r in rs)}/{len(rs)} "
              "windows (trainer.checkpoint.yielding: not where the time since its previous save was under four "
              "times that save's write)."]
    for name in WAYS:
        if results[name][-1]["restaged"]:  # counted over the run
            lines += ["", f"{name}: this PyTorch's DefaultStager closed its StateDictStager after each stage "
                      "(fixed in 2.13); the bench gave it back its copy table before each save, so each save "
                      "pinned its host buffers anew, as DCP on this release does."]
    lines += ["", f"A step without a save varies by {iqr:.3f} s (interquartile range of every baseline step): "
              f"a median of {rounds} differences of two steps resolves about +-{resolution:.3f} s."]
    lines.append("")
    for what in ("held", "step_lost", "first_lost", "window_lost"):
        a, b = ours[what] / plain, ours[what] / dcp
        label = {"step_lost": "step lost (the goal's measure)",
                 "first_lost": "step lost, paired with the baseline window's first step"}.get(what, what.replace("_", " "))
        lines.append(f"spottrain {label} / torch.save+fsync = {a:.3f} (goal <= 0.03: "
                     f"{'met' if a <= 0.03 else 'NOT met'}); / DCP reused-stager call = {b:.3f} (goal <= 0.5: "
                     f"{'met' if b <= 0.5 else 'NOT met'})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=5, help="steps per window (default 5)")
    p.add_argument("--rounds", type=int, default=4, help="rounds (default 4)")
    p.add_argument("--batch", type=int, default=32, help="batch size (default 32)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of the training loop (default 1, as the trainer's threads)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the model trains (default cpu; cuda: the first GPU)")
    a = p.parse_args(argv or [])  # `python -m bench` calls main() with its own argv in sys.argv
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: this torch sees no CUDA device")
    device = "cuda:0" if a.device == "cuda" else "cpu"
    logging.getLogger("trainer").setLevel(logging.WARNING)
    logging.getLogger("spottrain").setLevel(logging.WARNING)
    threads = torch.get_num_threads()
    torch.set_num_threads(a.threads)
    gb = float(os.environ.get("SPOTTRAIN_BENCH_GB", "0.75"))
    base = Path(os.environ.get("SPOTTRAIN_BENCH_DIR", tempfile.gettempdir()))
    d = Path(tempfile.mkdtemp(prefix="spottrain-save-cost-", dir=base))
    t0 = time.monotonic()
    loads = [os.getloadavg()[0]]
    try:
        results, width = measure(gb, a.steps, a.rounds, a.batch, d, device)
        loads.append(os.getloadavg()[0])
        machine = _machine(d)
    finally:
        shutil.rmtree(d, ignore_errors=True)
        torch.set_num_threads(threads)
    state_gb = LAYERS * 3 * (width * width + 3 * width) * 4 / GiB
    print("### What a save costs the loop\n")
    print(table(results, gb_state=state_gb, width=width, steps=a.steps, batch=a.batch, loads=loads, machine=machine,
                seconds=time.monotonic() - t0, device=_device_name(device)))
    print()


def _device_name(device: str) -> str:
    if device == "cpu":
        return "the CPU"
    return f"{torch.cuda.get_device_name(device)} (torch {torch.__version__})"


if __name__ == "__main__":
    main(sys.argv[1:])
