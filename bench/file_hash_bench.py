"""The checkpoint files' digests: BLAKE3 (what checkpoints are written with) against SHA-256 (what
earlier versions wrote), as the checkpointer computes them (``trainer.checkpoint.file_hash``: the
hash over the chunks' digests), over the same bytes in memory, taking turns.

CPU seconds per GiB on one thread are the figure that matters on a busy machine (a restore's
verification is CPU work ``torch.load`` does not do) and the one other work on the machine
changes least; the wall seconds with the checkpointer's hashing threads are printed beside them.

Run: ``python -m bench file_hash_bench``. ``SPOTTRAIN_BENCH_HASH_MB`` (default 512) and
``SPOTTRAIN_BENCH_REPEATS`` (default 3).
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import platform
import resource
import statistics
import time

from trainer.checkpoint import file_hash

GiB = 1 << 30


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measure(nbytes: int, repeats: int) -> dict[str, dict[str, list[float]]]:
    """{hash name: {"cpu": [CPU s/GiB, one thread], "wall": [wall s/GiB, the hashing threads]}}."""
    if file_hash.BLAKE3 is None:
        raise SystemExit("file_hash_bench: the blake3 package is not installed (pip install blake3)")
    data = memoryview(os.urandom(nbytes))
    hashes = [file_hash.BLAKE3, file_hash.SHA256]
    out: dict[str, dict[str, list[float]]] = {h.name: {"cpu": [], "wall": []} for h in hashes}
    with cf.ThreadPoolExecutor(file_hash.hash_workers(beside_io=False)) as pool:
        for i in range(repeats):
            for h in hashes if i % 2 == 0 else hashes[::-1]:
                c0 = _cpu()
                h.of(data)
                out[h.name]["cpu"].append((_cpu() - c0) * GiB / nbytes)
                t0 = time.perf_counter()
                h.of(data, pool)
                out[h.name]["wall"].append((time.perf_counter() - t0) * GiB / nbytes)
    return out


def main() -> None:
    nbytes = int(os.environ.get("SPOTTRAIN_BENCH_HASH_MB", "512")) << 20
    repeats = int(os.environ.get("SPOTTRAIN_BENCH_REPEATS", "3"))
    load0 = os.getloadavg()[0]
    got = measure(nbytes, repeats)
    b, s = (statistics.median(got[h.name]["cpu"]) for h in (file_hash.BLAKE3, file_hash.SHA256))
    bw, sw = (statistics.median(got[h.name]["wall"]) for h in (file_hash.BLAKE3, file_hash.SHA256))
    print(f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}, "
          f"{nbytes >> 20} MiB in memory, {repeats} rounds taking turns, "
          f"load {load0:.2f} -> {os.getloadavg()[0]:.2f}\n")
    print("| hash | CPU s per GiB (one thread) | wall s per GiB (hashing threads) |")
    print("|---|---|---|")
    for h in (file_hash.BLAKE3, file_hash.SHA256):
        print(f"| {h.name} | {statistics.median(got[h.name]['cpu']):.3f} | "
              f"{statistics.median(got[h.name]['wall']):.3f} |")
    print(f"| **BLAKE3 / SHA-256** | **{b / s:.2f}** | **{bw / sw:.2f}** |")


if __name__ == "__main__":
    main()
