"""What only a GPU can show, in one command: `bash bench/gpu_check.sh` (on any machine; without
CUDA it runs the same checks on CPU with gloo, which is how it is tested here).

Each check runs the real trainer (`python -m trainer run`, subprocesses) and compares final model
digests (`python -m trainer status --json`), so a check passes only if the weights are the same
bit for bit:

- ``resume-<precision>``: an uninterrupted run against one stopped by SIGTERM mid-run and resumed,
  for fp32, bf16 and fp16 (with the grad scaler) on CUDA; dropout on, so the CUDA RNG state is
  part of what must resume;
- ``data-workers``: the same run with two data workers (pinned memory on CUDA) against inline
  loading;
- ``torchrun-ddp`` / ``torchrun-fsdp``: one process per GPU (at most 8; NCCL on CUDA, gloo on CPU
  with two processes), uninterrupted against SIGTERM-to-torchrun and resumed;
- ``snapshot``: the time the loop is blocked copying a CUDA state into the pinned host buffer
  (``SnapshotBuffer.take``, the whole copy waited for) against a synchronous ``torch.save`` of the
  same state with fsync, side by side: a figure for BENCHMARKS.md, not a pass/fail;
- ``restore-ddp``: a whole-model state of ``--restore-gib`` (a 24-layer GPT and its AdamW state,
  over a thousand tensors) restored by one process per GPU as a DDP job restores it (rank 0 loads
  and verifies, every rank receives it over NCCL: ``bench/restore_memory_bench.py``); passes when
  every rank holds the saved state bit for bit and no rank's memory grew by more than 1.3x a
  one-process restore's;
- ``snapshot-overlap``: the weights copied beside the next step (``take(later=...)``: on CUDA a
  side stream): the current stream then runs matrix products, changes a buffer copied at the call,
  waits (``before_update``) and changes the weights in place; the snapshot must hold every byte
  as it was at the call. With the call's seconds against the whole copy's.
- ``own-loop``: the own-loop bench on the device (``bench/own_loop_bench.py --device cuda``):
  examples/own_loop/train.py under ``python -m trainer run --script`` against the same loop in
  plain torch, steps/s side by side, interleaved, each run its own process: a figure for
  BENCHMARKS.md (goal: ratio >= 0.98), not a pass/fail; a run that fails is a FAIL.

Prints a markdown report (also written to ``--out``/gpu_check.md) and exits 1 if a check failed.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
STEPS = 40
STOP_AT = 15  # SIGTERM once this step is logged
TASK_ARGS = {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64, "stride": 32,
             "dropout": 0.1, "warmup_steps": 5}


@dataclass
class Check:
    name: str
    ok: bool | None  # None: a measurement, not a pass/fail
    detail: str


def _config(path: Path, **settings: object) -> Path:
    lines = ["log_every_steps = 1", "batch_size = 8", "health_port = 0", "watch_metadata = false",
             "checkpoint_every_steps = 10", "tensorboard = false"]
    for k, v in settings.items():
        lines.append(f"{k} = {json.dumps(v)}")
    lines.append("[task_args]")
    lines += [f"{k} = {json.dumps(v)}" for k, v in TASK_ARGS.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def _trainer(nproc: int) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "trainer"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "trainer"]


def _run(cmd: list[str], log: Path, stop_at: int | None = None) -> int:
    """Run a trainer; with ``stop_at``, SIGTERM it (its process group's leader) once that step is
    logged, as systemd does on a preemption."""
    with log.open("w") as out:
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
        assert p.stderr is not None
        sent = False
        for line in p.stderr:
            out.write(line)
            if stop_at is not None and not sent and re.search(rf"event=step step={stop_at}/", line):
                p.send_signal(signal.SIGTERM)
                sent = True
        return p.wait()


def _digest(run_dir: Path, key: Path) -> str:
    r = subprocess.run([sys.executable, "-m", "trainer", "status", "--run-dir", str(run_dir), "--json",
                        "--checkpoint-key-file", str(key)], cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        return f"status failed ({r.returncode}): {r.stderr.strip()[-300:]}"
    return json.loads(r.stdout).get("model_digest") or "none"


def _pair(name: str, work: Path, key: Path, nproc: int, settings: dict, resumed_settings: dict | None = None,
          reference: str | None = None) -> tuple[Check, str]:
    """An uninterrupted run (unless ``reference`` gives its digest) against a run stopped at
    STOP_AT and resumed."""
    d = work / name
    d.mkdir(parents=True)
    base = ["run", "--steps", str(STEPS), "--checkpoint-key-file", str(key)]
    codes = []
    if reference is None:
        cfg = _config(d / "straight.toml", **settings)
        codes.append(_run(_trainer(nproc) + base + ["--run-dir", str(d / "straight"), "--config", str(cfg)],
                          d / "straight.log"))
        reference = _digest(d / "straight", key)
    cfg = _config(d / "resumed.toml", **(resumed_settings or settings))
    cmd = _trainer(nproc) + base + ["--run-dir", str(d / "resumed"), "--config", str(cfg)]
    codes.append(_run(cmd, d / "stopped.log", stop_at=STOP_AT))
    codes.append(_run(cmd, d / "resumed.log"))
    got = _digest(d / "resumed", key)
    ok = got == reference and codes[-1] == 0
    return Check(name, ok, f"exits {codes}; digest {got[:16]} vs {reference[:16]}"), reference


def _snapshot(work: Path, gib: float) -> Check:
    from trainer.checkpoint.whole_model import SnapshotBuffer

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    n = int(gib * (1 << 30)) // 4 // 8
    state = {f"w{i}": torch.randn(n, device=dev) for i in range(8)}
    buf = SnapshotBuffer()
    buf.take(0, state).copied()  # allocate (and pin) once, as a running trainer has
    t0 = time.perf_counter()
    for step in range(1, 4):
        buf.take(step, state).copied()
    take_s = (time.perf_counter() - t0) / 3
    path = work / "sync.pt"
    t0 = time.perf_counter()
    for _ in range(3):
        with path.open("wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
    save_s = (time.perf_counter() - t0) / 3
    path.unlink()
    return Check("snapshot", None, f"{gib:g} GiB on {dev}: blocked {take_s:.3f} s (pinned={buf.pinned}) "
                                   f"vs torch.save+fsync {save_s:.3f} s: ratio {take_s / save_s:.3f}")


def _snapshot_overlap(gib: float) -> Check:
    from trainer.checkpoint.whole_model import SnapshotBuffer

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    n = int(gib * (1 << 30)) // 4 // 8
    weights = [torch.randn(n, device=dev) for _ in range(8)]
    stats = torch.randn(4096, device=dev)  # a buffer: copied at the call, changed by the next forward
    state = {"w": weights, "running_mean": stats}
    later = {w.data_ptr() for w in weights}
    buf = SnapshotBuffer()
    buf.take(0, state).copied()  # allocate (and pin) once
    whole = []
    for _ in range(2):
        t0 = time.perf_counter()
        buf.take(0, state).copied()
        whole.append(time.perf_counter() - t0)
    before = [t.to("cpu", copy=True) for t in weights + [stats]]
    a = torch.randn(2048, 2048, device=dev)
    t0 = time.perf_counter()
    snap = buf.take(1, state, later=lambda t: t.data_ptr() in later)
    call_s = time.perf_counter() - t0
    for _ in range(20):  # the next forward and backward: reads the weights, changes the buffer
        a = torch.tanh(a @ a)
    stats.add_(1.0)
    snap.copy.before_update()  # what the optimizer step waits for
    for w in weights:
        w.mul_(-1.0).add_(3.0)  # the optimizer step
    snap.copied()
    table = json.loads(snap.structure)["tensors"]
    ok = all(torch.equal(snap.arena[o: o + nb].view(torch.float32), b.reshape(-1))
             for (o, nb, *_), b in zip(table, before))
    return Check("snapshot-overlap", ok, f"{gib:g} GiB on {dev}: call {call_s:.4f} s (the whole copy "
                 f"{min(whole):.3f} s); saved bytes {'are' if ok else 'are NOT'} those at the call")


def _restore_ddp(work: Path, gib: float, nproc: int, backend: str) -> Check:
    from bench import restore_memory_bench as rmb

    d = work / "restore-ddp"
    d.mkdir()
    got = rmb.measure(int(gib * (1 << 30)), nproc, d, backend=backend, digests=True)
    one, ranks = got["one"], got["ranks"]
    same = all(r["digest"] == got["saved"] for r in ranks)
    worst = max(r["growth"] for r in ranks) / one["growth"]
    return Check("restore-ddp", same and worst <= 1.3,
                 f"{nproc} ranks ({backend}), {one['bytes'] / (1 << 30):.2f} GiB in {one['tensors']} tensors; every rank "
                 f"{'holds the saved state' if same else 'does NOT hold the saved state'}; worst rank's memory "
                 f"{worst:.2f}x a one-process restore's; restore {one['seconds']:.1f} s alone, "
                 f"{max(r['seconds'] for r in ranks):.1f} s across ranks; {max(r['pickled'] for r in ranks)} bytes pickled")


#: The own-loop bench's size: on a GPU a step of the example's net at batch 64 is about a
#: millisecond, so more steps; on CPU (the suite's run) a few, to show the check works.
OWN_LOOP_CUDA = {"steps": 600, "rounds": 3, "batch": 64, "samples": 6000}
OWN_LOOP_CPU = {"steps": 10, "rounds": 1, "batch": 8, "samples": 200}


def _own_loop(cuda: bool) -> Check:
    """``bench/own_loop_bench.py`` on the device: spottrain's own loop against plain torch."""
    import statistics

    from bench import own_loop_bench

    size = OWN_LOOP_CUDA if cuda else OWN_LOOP_CPU
    device = "cuda" if cuda else "cpu"
    try:
        results = own_loop_bench.measure(size["steps"], size["rounds"], size["batch"], size["samples"], device)
    except RuntimeError as e:
        return Check("own-loop", False, str(e).strip().splitlines()[0][:300])
    plain, spot = (statistics.median(r["steps_per_s"] for r in results[k]) for k in ("plain", "spottrain"))
    return Check("own-loop", None,
                 f"steps/s spottrain {spot:.2f} / plain torch {plain:.2f} = ratio {spot / plain:.3f} on {device} "
                 f"(examples/own_loop/train.py, batch {size['batch']}, {size['steps']} steps x {size['rounds']} "
                 "rounds, interleaved; goal >= 0.98)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or tempfile.gettempdir()) / "gpu_check")
    p.add_argument("--only", default="", help="comma-separated check names (default: all)")
    p.add_argument("--snapshot-gib", type=float, default=float(os.environ.get("SPOTTRAIN_GPU_CHECK_GIB", 2.0)))
    p.add_argument("--restore-gib", type=float, default=float(os.environ.get("SPOTTRAIN_GPU_CHECK_RESTORE_GIB", 4.0)))
    p.add_argument("--keep", action="store_true", help="keep the runs' folders and logs under --out")
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    ngpu = torch.cuda.device_count() if cuda else 0
    nproc = min(max(ngpu, 1), 8) if cuda else 2
    a.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-", dir=a.out if a.keep else None))
    key = work / "checkpoint.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    only = {s for s in a.only.split(",") if s}

    def want(name: str) -> bool:
        return not only or name in only

    device = (f"{ngpu} x {torch.cuda.get_device_name(0)} (capability {torch.cuda.get_device_capability(0)}), "
              f"arch list {torch.cuda.get_arch_list()}" if cuda else "no CUDA device: CPU and gloo")
    header = [f"# GPU check ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", "",
              f"- machine: {platform.node()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
              f"torch {torch.__version__}", f"- device: {device}",
              f"- command: `bash bench/gpu_check.sh{' --only ' + a.only if a.only else ''}`", ""]
    print("\n".join(header), flush=True)
    checks: list[Check] = []

    def record(c: Check) -> None:
        checks.append(c)
        print(f"{c.name}: {'PASS' if c.ok else 'measured' if c.ok is None else 'FAIL'}: {c.detail}", flush=True)

    precisions = ["fp32", "bf16", "fp16"] if cuda else ["fp32"]
    reference = None
    for prec in precisions:
        if want(f"resume-{prec}"):
            c, ref = _pair(f"resume-{prec}", work, key, 1, {"precision": prec, "device": "auto"})
            record(c)
            reference = ref if prec == "fp32" else reference
    if want("data-workers"):
        settings = {"precision": "fp32", "device": "auto"}
        c, _ = _pair("data-workers", work, key, 1, settings, {**settings, "data_workers": 2}, reference=reference)
        record(c)
    for par in ("ddp", "fsdp"):
        if want(f"torchrun-{par}"):
            c, _ = _pair(f"torchrun-{par}", work, key, nproc,
                         {"parallelism": par, "global_batch_size": 8 * nproc, "precision": "bf16" if cuda else "fp32"})
            c.detail = f"{nproc} processes ({'nccl' if cuda else 'gloo'}); {c.detail}"
            record(c)
    if want("restore-ddp"):
        record(_restore_ddp(work, a.restore_gib, nproc, "nccl" if cuda else "gloo"))
    if want("snapshot"):
        record(_snapshot(work, a.snapshot_gib))
    if want("snapshot-overlap"):
        record(_snapshot_overlap(a.snapshot_gib))
    if want("own-loop"):
        record(_own_loop(cuda))

    table = ["| check | result | detail |", "|---|---|---|"]
    table += [f"| {c.name} | {'PASS' if c.ok else 'measured' if c.ok is None else '**FAIL**'} | {c.detail} |"
              for c in checks]
    report = "\n".join(header + table) + "\n"
    (a.out / "gpu_check.md").write_text(report)
    print("\n" + "\n".join(table))
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if any(c.ok is False for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
