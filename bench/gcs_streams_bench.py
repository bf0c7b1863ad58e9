"""A checkpoint file to and from Cloud Storage in parallel streams against one, through a proxy
that limits each connection as Cloud Storage limits a stream.

`GcsStore` moves a file of 64 MiB or more over `streams` connections (a composite upload, a
sliced download: trainer/checkpoint/gcs_streams.py). Measured side by side in one run, the real
client and store against gcp-storage-emulator behind `drill.fault_proxy` with `limit()` set:

  upload         - `GcsStore.put_file` of one file of $BENCH_GCS_GIB GiB (a state's tensors.bin);
  download       - `GcsStore.get_file` of it into a new file (fsync, rename);
  emergency      - the upload again under the Spot VM's emergency budget (`preemption_budget_s`'s
                   default): done in time, or stopped by the deadline;
  no limit       - upload and download with the proxy unlimited: what the emulator (one thread,
                   which also re-copies a resumable upload's bytes at every chunk), the proxy and
                   the client cost on this machine, which the limited figures include.
Each with 1 stream and with $BENCH_GCS_STREAMS (8), alternating which goes first in each of
$BENCH_REPEATS (1) rounds; the limit is $BENCH_GCS_STREAM_MIB_S (8) MiB/s per connection. The
files go under $BENCH_GCS_DIR (default: the temporary directory). The defaults (2 GiB, 8 MiB/s)
take about 20 minutes and several GiB of memory (the emulator holds every object, the proxy a
whole answer) on the 2-CPU VM; with BENCH_GCS_GIB=0.1875 BENCH_GCS_STREAM_MIB_S=2 (5 minutes)
eight streams stay under what the machine itself moves, so the ratios are the streams' alone
(BENCHMARKS.md).
"""
from __future__ import annotations

import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

MIB = 1 << 20


def _client(host: str, streams: int):
    import requests
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    client = storage.Client(project="bench", credentials=AnonymousCredentials(),
                            client_options={"api_endpoint": host})
    adapter = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=streams + 4)
    client._http.mount("http://", adapter)  # what GcsStore mounts on the client it makes itself
    return client


def _source(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, 64 * MIB)
            f.write(os.urandom(n))
            left -= n


def main() -> None:
    from drill.fault_proxy import FaultProxy
    from drill.gcs_emulator import StorageEmulator
    from trainer.checkpoint.stores import GcsStore
    from trainer.shutdown_window import trainer_budget_s

    size = int(float(os.environ.get("BENCH_GCS_GIB", "2")) * 1024 * MIB)
    streams = int(os.environ.get("BENCH_GCS_STREAMS", str(GcsStore.STREAMS)))
    rate = float(os.environ.get("BENCH_GCS_STREAM_MIB_S", "8")) * MIB
    repeats = int(os.environ.get("BENCH_REPEATS", "1"))
    budget = float(trainer_budget_s("spot"))
    root = Path(tempfile.mkdtemp(prefix="gcs-streams-bench-", dir=os.environ.get("BENCH_GCS_DIR")))
    load = [os.getloadavg()[0]]
    rows: dict[str, list[float]] = {}
    emergency: dict[int, list[str]] = {1: [], streams: []}
    try:
        src = root / "tensors.bin"
        _source(src, size)
        with StorageEmulator("bench-streams") as emu, FaultProxy(emu.host) as proxy:
            client = _client(proxy.host, streams)

            def store(n: int) -> GcsStore:
                return GcsStore("gs://bench-streams/run", client=client, streams=n)

            def transfer(n: int, limit: float | None, tag: str) -> None:
                s = store(n)
                proxy.limit(limit)
                t0 = time.perf_counter()
                s.put_file(src, "step-1/tensors.bin")
                t1 = time.perf_counter()
                dst = root / "restored" / "tensors.bin"
                s.get_file("step-1/tensors.bin", dst)
                t2 = time.perf_counter()
                assert dst.stat().st_size == size
                rows.setdefault(f"upload{tag} x{n}", []).append(t1 - t0)
                rows.setdefault(f"download{tag} x{n}", []).append(t2 - t1)
                shutil.rmtree(dst.parent)
                s.delete("step-1/tensors.bin")

            def emergency_upload(n: int) -> None:
                s = store(n)
                proxy.limit(rate)
                t0 = time.perf_counter()
                try:
                    with s.deadline(time.monotonic() + budget):
                        s.put_file(src, "step-2/tensors.bin")
                    emergency[n].append(f"done in {time.perf_counter() - t0:.1f} s")
                except Exception as e:  # noqa: BLE001 - the deadline stopping it is the figure
                    emergency[n].append(f"not done: stopped after {time.perf_counter() - t0:.1f} s "
                                        f"({type(e).__name__})")
                proxy.limit(None)
                s.clean_temporaries()
                s.delete("step-2/tensors.bin")

            for i in range(repeats):
                order = [1, streams] if i % 2 == 0 else [streams, 1]
                for n in order:
                    transfer(n, None, " no limit")
                for n in order:
                    transfer(n, rate, "")
                    load.append(os.getloadavg()[0])
                for n in order:
                    emergency_upload(n)
                load.append(os.getloadavg()[0])
    finally:
        shutil.rmtree(root, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in rows.items()}
    gib = size / (1024 * MIB)
    print(f"machine: {platform.node()}, {os.cpu_count()} CPUs, {platform.machine()}, Python "
          f"{platform.python_version()}; {gib:.2f} GiB file; limit {rate / MIB:g} MiB/s per connection; "
          f"{repeats} round(s), alternating; load average {min(load):.1f}-{max(load):.1f} (1 min)\n")
    print(f"| transfer of {gib:.2f} GiB | 1 stream | {streams} streams | 1 stream / {streams} streams |")
    print("|---|---|---|---|")
    for what in ("upload", "download", "upload no limit", "download no limit"):
        one, many = med[f"{what} x1"], med[f"{what} x{streams}"]
        label = what.replace(" no limit", ", no limit (local costs)") if "no limit" in what else \
            f"{what}, {rate / MIB:g} MiB/s per connection"
        print(f"| {label} | {one:.1f} s ({size / MIB / one:.0f} MiB/s) | {many:.1f} s "
              f"({size / MIB / many:.0f} MiB/s) | **{one / many:.2f}x** |")
    print(f"| emergency upload, {budget:g} s budget | {'; '.join(emergency[1])} | {'; '.join(emergency[streams])} | |")
    cover = {n: size / med[f"upload x{n}"] * budget / (1024 * MIB) for n in (1, streams)}
    print(f"| what the {budget:g} s budget uploads at these rates | {cover[1]:.2f} GiB | {cover[streams]:.2f} GiB | "
          f"{cover[streams] / cover[1]:.2f}x more |")


if __name__ == "__main__":
    main()
