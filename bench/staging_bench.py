"""Staging throughput (`python -m trainer stage`'s `Stager`) against a plain download of the same
objects, side by side in one run, from gcp-storage-emulator on loopback.

  plain     - what a user writes: list the prefix, `blob.download_to_filename` each object from a
              thread pool (the client's own checksum check on);
  staging   - `Stager.run()` into an empty directory: generation-pinned downloads, CRC32C on the
              fly, 32 MiB slices for large objects, temp file + fsync + rename, manifest lines;
  resumed   - `Stager.run()` again over the staged directory (nothing to download).
Each at two widths, 16 downloads at once (the stager's default) and 1, compared like for like.

The dataset: $BENCH_STAGING_OBJECTS (16) objects of 4 MiB and one of 64 MiB. Rounds alternate the
order; medians over $BENCH_REPEATS (3). Goal: staging >= 0.9 x plain (MB/s) at each width.
The files go under $BENCH_STAGING_DIR (default: the temporary directory); on a tmpfs
(/dev/shm) fsync costs nothing, which separates the disk's share from the download's.
"""

from __future__ import annotations

import os
import platform
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

GOAL = 0.9
PARALLEL = 16


def _client(host: str):
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage
    import requests

    client = storage.Client(project="bench", credentials=AnonymousCredentials(),
                            client_options={"api_endpoint": host})
    adapter = requests.adapters.HTTPAdapter(pool_maxsize=PARALLEL + 2)
    client._http.mount("http://", adapter)  # the same connection pool the stager gets
    return client


def plain(client, bucket: str, prefix: str, dest: Path, parallel: int) -> int:
    blobs = list(client.list_blobs(bucket, prefix=prefix + "/"))

    def one(blob) -> int:
        path = dest / blob.name[len(prefix) + 1:]
        path.parent.mkdir(parents=True, exist_ok=True)
        blob.download_to_filename(str(path))
        return blob.size

    with ThreadPoolExecutor(max_workers=parallel) as pool:
        return sum(pool.map(one, blobs))


def _fs(path: Path) -> str:
    """The filesystem type of `path` (the mount it is on)."""
    best, kind = "", "?"
    with open("/proc/mounts") as f:
        for line in f:
            _, mnt, fstype, *_ = line.split()
            if str(path.resolve()).startswith(mnt) and len(mnt) > len(best):
                best, kind = mnt, fstype
    return kind


def main() -> None:
    from drill.gcs_emulator import StorageEmulator
    from trainer.data.staging import Stager

    n = int(os.environ.get("BENCH_STAGING_OBJECTS", "16"))
    repeats = int(os.environ.get("BENCH_REPEATS", "3"))
    root = Path(tempfile.mkdtemp(prefix="staging-bench-", dir=os.environ.get("BENCH_STAGING_DIR")))
    rows: dict[str, list[float]] = {"plain x16": [], "staging x16": [], "plain x1": [], "staging x1": [],
                                    "resumed": []}
    try:
        with StorageEmulator("bench-data") as emu:
            client = _client(emu.host)
            b = client.bucket("bench-data")
            total = 0
            for i in range(n):
                data = os.urandom(4 << 20)
                b.blob(f"ds/shard-{i:03d}.bin").upload_from_string(data)
                total += len(data)
            big = os.urandom(64 << 20)
            b.blob("ds/big.bin").upload_from_string(big)
            total += len(big)

            def run(what: str) -> float:
                kind, width = what.split(" x")
                d = root / f"{kind}-{time.monotonic_ns()}"
                t0 = time.perf_counter()
                if kind == "plain":
                    d.mkdir()
                    assert plain(client, "bench-data", "ds", d, int(width)) == total
                else:
                    r = Stager("gs://bench-data/ds", d, client=client, parallel=int(width)).run()
                    assert r.downloaded_bytes == total
                dt = time.perf_counter() - t0
                if kind == "staging" and width == "16":
                    t1 = time.perf_counter()
                    assert Stager("gs://bench-data/ds", d, client=client).run().downloaded_files == 0
                    rows["resumed"].append(time.perf_counter() - t1)
                shutil.rmtree(d)
                return total / 1e6 / dt

            kinds = ["plain x16", "staging x16", "plain x1", "staging x1"]
            for i in range(repeats):
                for what in (kinds if i % 2 == 0 else kinds[::-1]):
                    rows[what].append(run(what))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"machine: {platform.node()}, {os.cpu_count()} CPUs, {platform.machine()}, Python "
          f"{platform.python_version()}; into {root.parent} ({_fs(root.parent)}); dataset {n} x 4 MiB + 1 x 64 MiB = {total / 1e6:.0f} MB; "
          f"medians of {repeats} alternating rounds\n")
    print("| download | MB/s (median) | runs |\n|---|---|---|")
    for k in ("plain x16", "staging x16", "plain x1", "staging x1"):
        print(f"| {k} | {med[k]:.1f} | {', '.join(f'{v:.1f}' for v in rows[k])} |")
    print(f"| staging again (nothing to fetch) | {med['resumed']:.2f} s | "
          f"{', '.join(f'{v:.2f}' for v in rows['resumed'])} |\n")
    for w in ("16", "1"):
        ratio = med[f"staging x{w}"] / med[f"plain x{w}"]
        print(f"staging / plain, {w} at once = {ratio:.2f} (goal >= {GOAL}: {'met' if ratio >= GOAL else 'NOT met'})")


if __name__ == "__main__":
    main()
