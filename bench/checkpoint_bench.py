"""Checkpoint benchmarks, measured side by side in one run on one directory.

1. Training time blocked per checkpoint (``Checkpointer.save``) against a plain synchronous
   ``torch.save`` of the same state to the same directory with fsync. Goal <= 0.10.
2. Background write throughput (snapshot buffer -> durable ``step-N/`` folder, file digests
   included) against the sequential write bandwidth of the same directory (``os.write`` + fsync),
   with the hash checkpoints are written with (BLAKE3) and, alternating, with SHA-256 (what
   earlier versions wrote, and the fallback without the ``blake3`` package). Goal: durable in at
   most 1.1x the floor's time.
3. Emergency save latency (the call a signal handler makes -> durable on the persistent tier)
   against state size, after one periodic save (the host buffer exists, as in a running trainer).
4. Restore time (verify every file + load) against the read floor (``os.read`` of the same
   bytes), with the page cache warm and after dropping the files' pages (posix_fadvise DONTNEED).
5. A trainer's restore against ``torch.load``: a model and an AdamW optimizer are built, then the
   checkpoint is restored (every file verified, the manifest authenticated) and loaded into them
   (``load_state_dict``), against ``torch.load`` of a ``torch.save`` file of the same state and
   the same ``load_state_dict``. Each in a fresh process, as a trainer restores when it starts (in
   one long process the allocator would hand ``torch.load`` the memory of the previous round),
   taking turns, warm and cold, for a BLAKE3 and a SHA-256 checkpoint; the seconds, and the
   process's CPU seconds (the hashing is CPU work ``torch.load`` does not do: on a machine whose
   cores are busy it costs its CPU time, on an idle one it hides beside the read). Goal <= 1.15x
   cold and <= 1.3x warm.

Run: ``python -m bench`` (all benches) or ``python -m bench.checkpoint_bench``.
Environment: ``SPOTTRAIN_BENCH_GB`` (state size, default 1.0), ``SPOTTRAIN_BENCH_DIR`` (directory
on the disk to measure, default the system temp dir), ``SPOTTRAIN_BENCH_REPEATS`` (rounds of the
repeated measures, default 3), ``SPOTTRAIN_BENCH_BEFORE`` (another tree of this repository, e.g. from ``git worktree add``:
measure 5 also restores the SHA-256 checkpoint with that tree's trainer, taking turns with the
others), ``SPOTTRAIN_BENCH_MEASURES`` (which measures, e.g. ``2,5``; default all: more rounds of
the noisy ones in the same time). Everything written is removed at the end.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from trainer.checkpoint import file_hash
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.checkpoint.key import CheckpointKey
from trainer.checkpoint.manifest import step_name
from trainer.checkpoint.tiers import Cadence, tier_table
from trainer.checkpoint.whole_model import SnapshotBuffer, write_dir

#: Checkpoints are signed as in a real run (an HMAC over the manifest: negligible next to hashing).
KEY = CheckpointKey(os.urandom(32), "bench")
REPO = Path(__file__).resolve().parent.parent


def _every_step(run_dir: Path, keep: int = 3) -> Any:
    """The persistent tier alone, saved every step."""
    return tier_table(run_dir, cadence={"persistent": Cadence(every_steps=1)}, keep=keep)


MiB = 1 << 20
GiB = 1 << 30
REPEATS = int(os.environ.get("SPOTTRAIN_BENCH_REPEATS", "3"))


def _measures() -> set[int]:
    raw = os.environ.get("SPOTTRAIN_BENCH_MEASURES", "1,2,3,4,5")
    try:
        got = {int(x) for x in raw.split(",") if x.strip()}
    except ValueError:
        got = set()
    if not got or not got <= {1, 2, 3, 4, 5}:
        print(f"checkpoint_bench: SPOTTRAIN_BENCH_MEASURES={raw!r}: give measure numbers 1-5, comma-separated",
              file=sys.stderr)
        raise SystemExit(2)
    return got


def _sha256_writes() -> Any:
    """Checkpoints written meanwhile use SHA-256, as earlier versions (and a trainer without the
    ``blake3`` package) write them."""
    return mock.patch.object(file_hash, "for_writing", lambda: file_hash.SHA256)


def _machine(d: Path) -> str:
    mem = "?"
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem = f"{int(line.split()[1]) / (1 << 20):.1f} GiB"
    dev = "?"
    try:
        best = ""
        with open("/proc/mounts") as f:
            for line in f:
                src, mnt, fstype = line.split()[:3]
                if str(d.resolve()).startswith(mnt) and len(mnt) > len(best):
                    best, dev = mnt, f"{src} ({fstype}, mounted on {mnt})"
    except OSError:
        pass
    du = shutil.disk_usage(d)
    return (f"nproc={os.cpu_count()}, RAM={mem}, disk={dev}, {du.free / GiB:.0f} GiB free, "
            f"torch {torch.__version__}, torch threads={torch.get_num_threads()}")


def _state(nbytes: int, *, seed: int = 0) -> dict:
    """A model-like state: fp32 tensors of 16 MiB and a few small ones, plus Python objects."""
    g = torch.Generator().manual_seed(seed)
    n_big = max(1, nbytes // (16 * MiB))
    model = {f"layer{i}.weight": torch.empty(2048, 2048).uniform_(generator=g) for i in range(n_big)}
    model.update({f"layer{i}.bias": torch.zeros(2048) for i in range(n_big)})
    return {"model": model, "step": 1, "data": {"epoch": 0, "index": 123}, "rng": torch.get_rng_state()}


def _nbytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in state["model"].values())


def _drop_cache(path: Path) -> None:
    for p in ([path] if path.is_file() else [q for q in path.rglob("*") if q.is_file()]):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _floor_write(d: Path, nbytes: int) -> float:
    """Sequential write bandwidth floor: os.write in 32 MiB chunks + fsync, seconds."""
    buf = memoryview(bytearray(os.urandom(MiB)) * 32)
    p = d / "floor.bin"
    t0 = time.perf_counter()
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    left = nbytes
    while left > 0:
        left -= os.write(fd, buf[: min(left, len(buf))])
    os.fsync(fd)
    os.close(fd)
    dt = time.perf_counter() - t0
    p.unlink()
    return dt


def _floor_read(files: list[Path]) -> float:
    t0 = time.perf_counter()
    buf = bytearray(32 * MiB)
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return time.perf_counter() - t0


def _torch_save(state: dict, d: Path) -> float:
    p = d / "plain.pt"
    t0 = time.perf_counter()
    with open(p, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    p.unlink()
    return dt


#: Measure 5's process: build the model and the optimizer, then time the restore (or torch.load)
#: and the load_state_dict into them. Prints the seconds and the process's CPU seconds meanwhile
#: (every thread's: the read and the hashing), which other work on the machine changes far less
#: than the seconds.
_RESTORE_CHILD = r"""
import json, logging, resource, sys, time
from pathlib import Path
import torch
logging.getLogger("spottrain").setLevel(logging.WARNING)
mode, src, key_file, layers = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(layers)])
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
ckpt = None
if mode != "torch.load":  # imported before the clock starts, as a trainer has by its restore
    from trainer.checkpoint.checkpointer import Checkpointer
    from trainer.checkpoint.key import CheckpointKey
    from trainer.checkpoint.tiers import tier_table
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
c0, t0 = cpu(), time.perf_counter()
if mode == "torch.load":
    state = torch.load(src, weights_only=True)
else:
    ckpt = Checkpointer(tier_table(src), key=CheckpointKey(key_file.read_bytes(), "bench"))
    # Once the state is back the checkpointer reserves the first save's host buffer in the
    # background, beside the loop's first steps: work for that save, not the restore, which would
    # add its page faults to this process's CPU time. Left out here.
    ckpt._survey._reserve_in_background = lambda state: None
    restored = ckpt.restore()
    assert restored is not None, "nothing restored"
    state = restored.state
model.load_state_dict(state["model"])
opt.load_state_dict(state["optimizer"])
seconds, cpu_seconds = time.perf_counter() - t0, cpu() - c0
if ckpt is not None:
    ckpt.close()
print(json.dumps([seconds, cpu_seconds]))
"""


def _live(layers: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model of ``layers`` 2048x2048 linear layers and an AdamW optimizer with its state (one step)."""
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 2048)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _restore_in_fresh_process(mode: str, src: Path, key_file: Path, layers: int,
                              tree: Path) -> tuple[float, float]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run([sys.executable, "-c", _RESTORE_CHILD, mode, str(src), str(key_file), str(layers)],
                         cwd=tree, env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"measure 5, {mode} in {tree}: exit {out.returncode}: {out.stderr[-2000:]}")
    wall, cpu = json.loads(out.stdout.strip().splitlines()[-1])
    return float(wall), float(cpu)


def _measure_restore(d: Path, gb: float, rows: list) -> None:
    """Measure 5 (see the module docstring)."""
    layers = max(1, round(gb * GiB / (3 * 16 * MiB)))  # weights, exp_avg and exp_avg_sq
    model, opt = _live(layers)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 9}
    key_file = d / "checkpoint.key"
    key_file.write_bytes(KEY.secret)
    plain = d / "plain.pt"
    with open(plain, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    for run, sha256 in (("blake3", False), ("sha256", True)):
        c = Checkpointer(_every_step(d / run), key=KEY)
        with _sha256_writes() if sha256 else contextlib.nullcontext():
            c.save(9, state)
            c.wait()
        c.close()
    del model, opt, state
    variants = [("torch.load", "torch.load", plain, REPO), ("blake3", "restore", d / "blake3", REPO),
                ("sha256", "restore", d / "sha256", REPO)]
    before = os.environ.get("SPOTTRAIN_BENCH_BEFORE")
    if before:
        variants.append(("sha256, before", "restore", d / "sha256", Path(before).resolve()))
    size = f"{plain.stat().st_size / GiB:.2f} GiB"
    for cache in ("warm", "cold"):
        times: dict[str, list[float]] = {v[0]: [] for v in variants}
        cpus: dict[str, list[float]] = {v[0]: [] for v in variants}
        for i in range(REPEATS):
            for name, mode, src, tree in (variants if i % 2 == 0 else variants[::-1]):
                if cache == "cold":
                    _drop_cache(d)
                wall, cpu = _restore_in_fresh_process(mode, src, key_file, layers, tree)
                times[name].append(wall)
                cpus[name].append(cpu)
        base, base_cpu = statistics.median(times["torch.load"]), statistics.median(cpus["torch.load"])
        rows.append((f"5. torch.load + load_state_dict (baseline), {cache} cache, fresh process", size,
                     f"{_spread(times['torch.load'])}; CPU {base_cpu:.2f} s", "—", "1.00"))
        goal = "1.3" if cache == "warm" else "1.15"
        for name, *_ in variants[1:]:
            med, cpu = statistics.median(times[name]), statistics.median(cpus[name])
            rows.append((f"5. restore ({name}: verify + HMAC + load_state_dict into model + AdamW) / torch.load, "
                         f"{cache} cache", size, f"{_spread(times[name])}; CPU {cpu:.2f} s",
                         f"{base:.2f} s; CPU {base_cpu:.2f} s",
                         f"**{med / base:.2f}**" + (f" (goal <= {goal})" if name == "blake3" else "")
                         + f"; CPU {cpu / base_cpu:.2f}"))


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} s ({min(xs):.2f}-{max(xs):.2f})"


def main() -> None:
    want = _measures()  # before anything is written
    logging.getLogger("trainer").setLevel(logging.WARNING)
    gb = float(os.environ.get("SPOTTRAIN_BENCH_GB", "1.0"))
    base = Path(os.environ.get("SPOTTRAIN_BENCH_DIR", tempfile.gettempdir()))
    d = Path(tempfile.mkdtemp(prefix="spottrain-ckpt-bench-", dir=base))
    rows: list[tuple[str, str, str, str, str]] = []
    loads = [os.getloadavg()[0]]
    try:
        state = _state(int(gb * GiB)) if want & {1, 2, 3, 4} else {}
        nbytes = _nbytes(state)
        size = f"{nbytes / GiB:.2f} GiB"

        if 1 in want:
            # (1) blocked time vs a plain synchronous torch.save + fsync, interleaved.
            plain, blocked, first_blocked = [], [], None
            c = Checkpointer(_every_step(d / "run", keep=1), key=KEY)
            for i in range(REPEATS + 1):
                b = c.save(i + 1, state)
                c.wait()
                if i == 0:
                    first_blocked = b  # includes allocating and touching the reusable buffer
                else:
                    blocked.append(b)
                    plain.append(_torch_save(state, d))
            c.close()
            shutil.rmtree(d / "run")
            b_med, p_med = statistics.median(blocked), statistics.median(plain)
            rows.append(("1. blocked per checkpoint / sync torch.save+fsync", size,
                         f"{b_med:.3f} s (first save {first_blocked:.3f} s)", f"{p_med:.3f} s",
                         f"**{b_med / p_med:.3f}** (goal <= 0.10)"))

        if 2 in want:
            # (2) background write vs sequential write floor, interleaved: BLAKE3, SHA-256, the floor.
            buf = SnapshotBuffer()
            ours: dict[str, list[float]] = {"blake3": [], "sha256": []}
            floor = []
            for i in range(REPEATS):
                for name in (["blake3", "sha256"] if i % 2 == 0 else ["sha256", "blake3"]):
                    snap = buf.take(i, state)
                    with _sha256_writes() if name == "sha256" else contextlib.nullcontext():
                        t0 = time.perf_counter()
                        folder, _ = write_dir(snap, d / "w", key=KEY)
                        ours[name].append(time.perf_counter() - t0)
                    total = sum(p.stat().st_size for p in folder.iterdir())
                    shutil.rmtree(folder)
                floor.append(_floor_write(d, total))
            f_med = statistics.median(floor)
            for name, xs in ours.items():
                o_med = statistics.median(xs)
                rows.append((f"2. write ({name} + fsync + rename) / os.write+fsync: durable in", size,
                             f"{_spread(xs)}, {total / o_med / MiB:.0f} MiB/s",
                             f"{_spread(floor)}, {total / f_med / MiB:.0f} MiB/s",
                             f"**{o_med / f_med:.2f}x**" + (" (goal <= 1.1x)" if name == "blake3" else "")))
            del buf, snap
            loads.append(os.getloadavg()[0])

        if 3 in want:
            # (3) emergency save latency against size (persistent tier, synchronous, durable on return).
            for frac in (0.25, 0.5, 1.0):
                sub = dict(state)
                keys = [k for k in state["model"] if k.endswith(".weight")]
                sub["model"] = {k: state["model"][k] for k in keys[: max(1, int(len(keys) * frac))]}
                sz = _nbytes(sub)
                c = Checkpointer(_every_step(d / f"em{frac}"), key=KEY)
                # As in a running trainer: one periodic save happened before the notice, so the
                # reusable host buffer exists.
                c.save(6, sub)
                c.wait()
                t0 = time.monotonic()
                rep = c.emergency_save(7, sub, deadline=t0 + 25.0)
                dt = time.monotonic() - t0
                c.close()
                fl = _floor_write(d, sz)
                shutil.rmtree(d / f"em{frac}")
                rows.append(("3. emergency save (call -> durable) / write floor", f"{sz / GiB:.2f} GiB",
                             f"{dt:.2f} s ({'ok' if rep.persistent_ok else 'FAILED'})", f"{fl:.2f} s",
                             f"{dt / fl:.2f}"))

        if 4 in want:
            # (4) restore (verify + load) vs the read floor, warm and cold page cache.
            c = Checkpointer(_every_step(d / "r"), key=KEY)
            c.save(9, state)
            c.close()
            folder = d / "r" / step_name(9)
            files = sorted(p for p in folder.iterdir())
            total = sum(p.stat().st_size for p in files)
            for cache in ("warm", "cold"):
                rs, fs = [], []
                for _ in range(2):
                    if cache == "cold":
                        _drop_cache(folder)
                    t0 = time.perf_counter()
                    rc = Checkpointer(tier_table(d / "r"), key=KEY)  # the default tiers, as a restarted run
                    r = rc.restore()
                    rs.append(time.perf_counter() - t0)
                    assert r is not None and r.step == 9
                    rc.close()  # joins the background buffer reservation before the floor runs
                    del r, rc
                    if cache == "cold":
                        _drop_cache(folder)
                    fs.append(_floor_read(files))
                r_med, fl_med = statistics.median(rs), statistics.median(fs)
                rows.append((f"4. restore (verify + load) / os.read, {cache} cache", f"{total / GiB:.2f} GiB",
                             f"{r_med:.2f} s ({total / r_med / MiB:.0f} MiB/s)",
                             f"{fl_med:.2f} s ({total / fl_med / MiB:.0f} MiB/s)", f"{r_med / fl_med:.2f}"))
            loads.append(os.getloadavg()[0])

        if 5 in want:
            # (5) a trainer's restore into a live model + AdamW vs torch.load, fresh processes.
            del state
            _measure_restore(d, gb, rows)
            loads.append(os.getloadavg()[0])
        machine = _machine(d)
    finally:
        shutil.rmtree(d, ignore_errors=True)

    print("### Checkpoint benchmarks\n")
    print(f"Machine: {machine}. Median of {REPEATS} interleaved runs where repeated (the range in "
          "parentheses); state = fp32 tensors of 16 MiB plus Python objects (measure 5: a model of "
          f"2048x2048 linear layers and its AdamW state). Load average (1 min) during the run: "
          f"{min(loads):.1f}-{max(loads):.1f}.\n")
    print("| measure | size | spottrain | baseline | ratio |")
    print("|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    print()


if __name__ == "__main__":
    main()
