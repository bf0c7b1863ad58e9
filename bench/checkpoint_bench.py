"""Checkpoint benchmarks, measured side by side in one run on one directory.

1. Training time blocked per checkpoint (``Checkpointer.save``) against a plain synchronous
   ``torch.save`` of the same state to the same directory with fsync. Goal <= 0.10.
2. Background write throughput (snapshot buffer -> durable ``step-N/`` folder, sha256 included)
   against the sequential write bandwidth of the same directory (``os.write`` + fsync). Goal >= 0.8.
3. Emergency save latency (the call a signal handler makes -> durable on the persistent tier)
   against state size, after one periodic save (the host buffer exists, as in a running trainer).
4. Restore time (verify every sha256 + load) against the read floor (``os.read`` of the same
   bytes), with the page cache warm and after dropping the files' pages (posix_fadvise DONTNEED).

Run: ``python -m bench`` (all benches) or ``python -m bench.checkpoint_bench``.
Environment: ``SPOTTRAIN_BENCH_GB`` (state size, default 1.0), ``SPOTTRAIN_BENCH_DIR`` (directory
on the disk to measure, default the system temp dir). Everything written is removed at the end.
"""

from __future__ import annotations

import logging
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint.checkpointer import Checkpointer
from trainer.checkpoint.key import CheckpointKey
from trainer.checkpoint.manifest import step_name
from trainer.checkpoint.tiers import Cadence, tier_table
from trainer.checkpoint.whole_model import SnapshotBuffer, write_dir

#: Checkpoints are signed as in a real run (an HMAC over the manifest: negligible next to sha256).
KEY = CheckpointKey(os.urandom(32), "bench")


def _every_step(run_dir: Path, keep: int = 3) -> Any:
    """The persistent tier alone, saved every step."""
    return tier_table(run_dir, cadence={"persistent": Cadence(every_steps=1)}, keep=keep)


MiB = 1 << 20
GiB = 1 << 30
REPEATS = 3


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


def main() -> None:
    logging.getLogger("trainer").setLevel(logging.WARNING)
    gb = float(os.environ.get("SPOTTRAIN_BENCH_GB", "1.0"))
    base = Path(os.environ.get("SPOTTRAIN_BENCH_DIR", tempfile.gettempdir()))
    d = Path(tempfile.mkdtemp(prefix="spottrain-ckpt-bench-", dir=base))
    rows: list[tuple[str, str, str, str, str]] = []
    try:
        state = _state(int(gb * GiB))
        nbytes = _nbytes(state)
        size = f"{nbytes / GiB:.2f} GiB"

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

        # (2) background write throughput vs sequential write floor, interleaved.
        buf = SnapshotBuffer()
        ours, floor = [], []
        for i in range(REPEATS):
            snap = buf.take(i, state)
            t0 = time.perf_counter()
            folder, _ = write_dir(snap, d / "w", key=KEY)
            ours.append(time.perf_counter() - t0)
            total = sum(p.stat().st_size for p in folder.iterdir())
            shutil.rmtree(folder)
            floor.append(_floor_write(d, total))
        o_med, f_med = statistics.median(ours), statistics.median(floor)
        rows.append(("2. write throughput (sha256 + fsync + rename) / os.write+fsync", size,
                     f"{total / o_med / MiB:.0f} MiB/s", f"{total / f_med / MiB:.0f} MiB/s",
                     f"**{f_med / o_med:.2f}** (goal >= 0.8)"))
        del buf, snap

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
            rows.append((f"4. restore (sha256 verify + load) / os.read, {cache} cache", f"{total / GiB:.2f} GiB",
                         f"{r_med:.2f} s ({total / r_med / MiB:.0f} MiB/s)",
                         f"{fl_med:.2f} s ({total / fl_med / MiB:.0f} MiB/s)", f"{r_med / fl_med:.2f}"))
        machine = _machine(d)
    finally:
        shutil.rmtree(d, ignore_errors=True)

    print("### Checkpoint benchmarks\n")
    print(f"Machine: {machine}. Median of {REPEATS} interleaved runs where repeated; state = fp32 "
          "tensors of 16 MiB plus Python objects.\n")
    print("| measure | size | spottrain | baseline | ratio |")
    print("|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    print()


if __name__ == "__main__":
    main()
