"""Staging throughput (`python -m trainer stage`'s `Stager`) against a plain download of the same
objects, side by side in one run, from gcp-storage-emulator on loopback.

  plain     - what a user writes: list the prefix, `blob.download_to_filename` each object from a
              thread pool as wide as the stager's (the client's own checksum check on);
  plain-seq - the same, one object at a time;
  staging   - `Stager.run()` into an empty directory: generation-pinned downloads, CRC32C on the
              fly, 32 MiB slices for large objects, temp file + fsync + rename, manifest lines;
  resumed   - `Stager.run()` again over the staged directory (nothing to download).

The dataset: $BENCH_STAGING_OBJECTS (16) objects of 4 MiB and one of 64 MiB. Rounds alternate the
order; medians over $BENCH_REPEATS (3). Goal: staging >= 0.9 x plain (MB/s).
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


def main() -> None:
    from drill.gcs_emulator import StorageEmulator
    from trainer.staging import Stager

    n = int(os.environ.get("BENCH_STAGING_OBJECTS", "16"))
    repeats = int(os.environ.get("BENCH_REPEATS", "3"))
    root = Path(tempfile.mkdtemp(prefix="staging-bench-"))
    rows: dict[str, list[float]] = {"plain": [], "plain-seq": [], "staging": [], "resumed": []}
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

            def run_plain(seq: bool) -> float:
                d = root / f"plain-{time.monotonic_ns()}"
                d.mkdir()
                t0 = time.perf_counter()
                assert plain(client, "bench-data", "ds", d, 1 if seq else PARALLEL) == total
                dt = time.perf_counter() - t0
                shutil.rmtree(d)
                return total / 1e6 / dt

            def run_staging() -> tuple[float, float]:
                d = root / f"staged-{time.monotonic_ns()}"
                t0 = time.perf_counter()
                r = Stager("gs://bench-data/ds", d, client=client, parallel=PARALLEL).run()
                dt = time.perf_counter() - t0
                assert r.downloaded_bytes == total
                t1 = time.perf_counter()
                assert Stager("gs://bench-data/ds", d, client=client, parallel=PARALLEL).run().downloaded_files == 0
                resumed = time.perf_counter() - t1
                shutil.rmtree(d)
                return total / 1e6 / dt, resumed

            for i in range(repeats):
                order = ["plain", "staging", "plain-seq"] if i % 2 == 0 else ["plain-seq", "staging", "plain"]
                for what in order:
                    if what == "staging":
                        mb_s, resumed = run_staging()
                        rows["staging"].append(mb_s)
                        rows["resumed"].append(resumed)
                    else:
                        rows[what].append(run_plain(what == "plain-seq"))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in rows.items()}
    ratio = med["staging"] / med["plain"]
    print(f"machine: {platform.node()}, {os.cpu_count()} CPUs, {platform.machine()}, Python "
          f"{platform.python_version()}; dataset {n} x 4 MiB + 1 x 64 MiB = {total / 1e6:.0f} MB; "
          f"{PARALLEL} downloads at once; medians of {repeats} alternating rounds\n")
    print("| download | MB/s (median) | runs |\n|---|---|---|")
    for k in ("plain", "plain-seq", "staging"):
        print(f"| {k} | {med[k]:.1f} | {', '.join(f'{v:.1f}' for v in rows[k])} |")
    print(f"| resumed (nothing to fetch) | {med['resumed']:.2f} s | "
          f"{', '.join(f'{v:.2f}' for v in rows['resumed'])} |")
    print(f"\nstaging / plain = {ratio:.2f} (goal >= {GOAL}: {'met' if ratio >= GOAL else 'NOT met'}); "
          f"staging / plain-seq = {med['staging'] / med['plain-seq']:.2f}")


if __name__ == "__main__":
    main()
