"""A rank's peak memory during a multi-process restore, against a one-process restore of the same state.

Several ranks of a whole-model (DDP) job restore together: the node leader holding the newest step
loads and verifies it, and every other rank receives it from there (``trainer.loop.restore.newest``,
``trainer.checkpoint.broadcast``). Goal: no rank's memory grows by more than 1.3x what one process's
restore of the same state grows by. The state is a GPT's model and AdamW state of about
``SPOTTRAIN_BENCH_RESTORE_GB`` (default 1) with hundreds of tensors, saved once by the real
``Checkpointer``; then, each in fresh processes:

1. one process restores it (``Checkpointer.restore``: verify, load);
2. ``SPOTTRAIN_BENCH_RANKS`` (default 2) gloo ranks restore it through ``restore.newest``, rank 0
   holding the run dir (what a DDP VM does).

Each process measures its peak resident memory over the restore (``VmHWM`` reset through
``/proc/self/clear_refs`` just before it) minus its resident memory before. A checkpointer's
restore also reserves the host buffer of its next save (another copy of the state, on a process
that saves): the one process and rank 0 both include it, the receiving ranks have none. The table also gives
what the pickled broadcast that this replaced would have sent to each rank: a restored tensor is a
view into one buffer and pickling a view carries that whole buffer, so (tensors) x (state bytes);
it is computed, not run (at 1 GiB it would not fit in this machine's memory).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
GiB = 1 << 30


def _size_gb() -> float:
    return float(os.environ.get("SPOTTRAIN_BENCH_RESTORE_GB", "1"))


def _ranks() -> int:
    return int(os.environ.get("SPOTTRAIN_BENCH_RANKS", "2"))


def _state(size_bytes: int) -> dict:
    """A 24-layer GPT whose weights and AdamW moments (fp32) come to about ``size_bytes``, after one
    optimizer step (so the moments exist)."""
    import torch

    from trainer.tasks.gpt import GPT

    # 24 layers of 12 E^2 parameters each, three fp32 copies (weights, two moments): 3456 E^2 bytes.
    embd = max(8, int((size_bytes / 3456) ** 0.5) // 8 * 8)
    torch.manual_seed(0)
    model = GPT(65, 64, 24, 4, embd, 0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return {"step": 1, "model": model.state_dict(), "optimizer": opt.state_dict()}


def _rss() -> tuple[int, int]:
    """(resident now, peak resident since the last reset), bytes."""
    got = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            got[line.split(":")[0]] = int(line.split()[1]) * 1024
    return got["VmRSS"], got["VmHWM"]


def _reset_peak() -> bool:
    """Reset ``VmHWM`` to the current resident size (Linux >= 4.0); False where it cannot be."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _measured(fn: Any) -> tuple[Any, dict]:
    reset = _reset_peak()
    before, _ = _rss()
    t0 = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t0
    _, peak = _rss()
    return out, {"growth": peak - before, "seconds": seconds, "peak_reset": reset}


def _checkpointer(run_dir: Path) -> Any:
    from trainer.checkpoint.checkpointer import Checkpointer
    from trainer.checkpoint.key import resolve
    from trainer.checkpoint.tiers import Cadence, tier_table

    table = tier_table(run_dir, cadence={"persistent": Cadence(1, None)}, keep={"persistent": 1})
    return Checkpointer(table, key=resolve(None, create_default=False))


def _count_tensors(state: Any) -> tuple[int, int]:
    """(how many tensors ``state`` holds, their bytes)."""
    from trainer.checkpoint.state_codec import tensors_in

    found = tensors_in(state)
    return len(found), sum(t.numel() * t.element_size() for t in found)


# ----------------------------------------------------------------------------- the processes


def _restored(c: Any, restore: Any) -> Any:
    """``restore()``, then ``c.close()``: a checkpointer's restore also reserves, in the background,
    the host buffer of its next save (one copy of the state, on the process that saves: a node
    leader), and close waits for it, so both sides of the comparison hold it."""
    out = restore()
    if c is not None:
        c.close()
    return out


def _one(run_dir: Path, out: Path) -> None:
    c = _checkpointer(run_dir)
    restored, m = _measured(lambda: _restored(c, c.restore))
    m["tensors"], m["bytes"] = _count_tensors(restored.state)
    out.write_text(json.dumps(m))


def _rank(run_dir: Path, out: Path) -> None:
    import torch.distributed as dist

    from trainer.distributed import World
    from trainer.loop import restore

    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = os.environ.get("BENCH_BACKEND", "gloo")
    if backend == "nccl":  # one GPU a rank, as torchrun gives a DDP job on a GPU VM
        import torch

        torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", int(os.environ["BENCH_STORE_PORT"]), is_master=False)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size)
    world = World(rank=rank, local_rank=rank, size=size, local_size=size)
    c = _checkpointer(run_dir) if rank == 0 else None
    world.barrier()
    pickled = world.object_bytes
    (saved, _), m = _measured(lambda: _restored(c, lambda: restore.newest(c, world)))
    m["pickled"] = world.object_bytes - pickled
    m["tensors"], m["bytes"] = _count_tensors(saved)
    if os.environ.get("BENCH_DIGEST"):
        from trainer.checkpoint.format import state_digest

        m["digest"] = state_digest(saved)
    (out / f"rank-{rank}.json").write_text(json.dumps(m))
    world.barrier()
    dist.destroy_process_group()


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))


def _run_ranks(n: int, run_dir: Path, out: Path, backend: str, digests: bool) -> list[dict]:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world_size=n + 1, is_master=True, wait_for_workers=False)
    argv = [sys.executable, "-m", "bench.restore_memory_bench", "--rank", str(run_dir), str(out)]
    env = dict(_env(), WORLD_SIZE=str(n), BENCH_STORE_PORT=str(store.port), BENCH_BACKEND=backend,
               BENCH_DIGEST="1" if digests else "")
    procs = [subprocess.Popen(argv, cwd=REPO, env=dict(env, RANK=str(r))) for r in range(n)]
    codes = [p.wait() for p in procs]
    if codes != [0] * n:
        raise RuntimeError(f"restore_memory_bench: ranks exited {codes}")
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(n)]


def measure(size_bytes: int, ranks: int, work: Path, *, backend: str = "gloo", digests: bool = False) -> dict:
    """Save a state of about ``size_bytes`` into ``work`` and restore it both ways (the ranks over
    ``backend``); with ``digests``, the saved state's digest and each rank's restored one."""
    c = _checkpointer(work / "run")
    state = _state(size_bytes)
    c.save(1, state, meta={"world_size": ranks})
    c.wait()
    c.close()
    from trainer.checkpoint.format import state_digest

    saved = state_digest(state) if digests else None
    del state
    one = work / "one.json"
    subprocess.run([sys.executable, "-m", "bench.restore_memory_bench", "--one", str(work / "run"), str(one)],
                   cwd=REPO, env=_env(), check=True)
    out = work / "ranks"
    out.mkdir()
    return {"one": json.loads(one.read_text()), "ranks": _run_ranks(ranks, work / "run", out, backend, digests),
            "saved": saved}


def main() -> None:
    from bench.checkpoint_bench import _machine

    size, n = int(_size_gb() * GiB), _ranks()
    with tempfile.TemporaryDirectory(prefix="spottrain-restore-memory-") as d:
        got = measure(size, n, Path(d))
        machine = _machine(Path(d))
    one, ranks = got["one"], got["ranks"]
    state_b = one["bytes"]
    print(f"machine: {machine}; state: {state_b / GiB:.2f} GiB in {one['tensors']} tensors; {n} gloo ranks; "
          f"peak reset through /proc/self/clear_refs: {'yes' if one['peak_reset'] else 'no (peak since start)'}\n")
    print("| restore | memory growth (GiB) | x one process | seconds | pickled between ranks (bytes) |")
    print("|---|---|---|---|---|")
    print(f"| one process (`Checkpointer.restore`, its save buffer) | {one['growth'] / GiB:.3f} | 1.00 | {one['seconds']:.2f} | - |")
    for r, m in enumerate(ranks):
        role = "loads, verifies, sends; its save buffer" if r == 0 else "receives"
        print(f"| rank {r} of {n} ({role}) | {m['growth'] / GiB:.3f} | {m['growth'] / one['growth']:.2f} | "
              f"{m['seconds']:.2f} | {m['pickled']} |")
    worst = max(m["growth"] for m in ranks) / one["growth"]
    print(f"\nworst rank: {worst:.2f}x one process (goal <= 1.3x: {'met' if worst <= 1.3 else 'NOT met'}); "
          f"the pickled broadcast this replaced would have sent each rank {one['tensors']} x {state_b / GiB:.2f} GiB "
          f"= {one['tensors'] * state_b / GiB:.0f} GiB (computed)")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        _one(Path(sys.argv[2]), Path(sys.argv[3]))
    elif sys.argv[1:2] == ["--rank"]:
        _rank(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        main()
