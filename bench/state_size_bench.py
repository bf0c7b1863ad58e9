"""The checkpoint path at the sizes one rank of a real job holds, and what fits the shutdown window.

One rank of an FSDP job on an 8-GPU VM holds its shard of the weights and the optimizer's state:
for a 7B model trained with AdamW in mixed precision (about 16 bytes a parameter: bf16 weights and
gradients, fp32 master weights and two moments), 7e9 x 16 / 8 = 14 GB a rank; with fp32 weights and
no master copy (12 bytes a parameter) 10.5 GB. This bench puts ``SPOTTRAIN_BENCH_SIZES_GB`` (default
"4") through the three moments that matter on a Spot VM, with the real ``Checkpointer``, on the
directory ``SPOTTRAIN_BENCH_DIR`` (default the temp dir) and, beside it, on a RAM disk (/dev/shm),
where the disk costs nothing, so the trainer's own share (the copy into host memory, hashing,
the manifest and its fsyncs) is measured apart from the disk's:

1. a periodic save: the seconds the loop is blocked, and the seconds until it is durable;
2. the emergency save (the call a notice makes, to durable on the persistent tier);
3. the restore (every file verified, then loaded), with the page cache warm and cold.

Then the fit: the emergency save takes about ``size x (trainer's seconds per GiB) + size / (the
disk's write rate)`` (hashing overlaps the write, so this overstates a little), and the table gives
the largest state that is durable within the trainer's Spot budget (``trainer.shutdown_window``) on
the disks a VM can have, at the write rates ``stacks.gcp_rules`` holds (PD-SSD: about 0.48 MB/s per
GB provisioned, capped by the VM's vCPUs; local NVMe SSD per device), and this machine's disk as
measured. It is the emergency save alone; ``stacks.budget`` adds the step in flight and a periodic
save still writing (docs/budget.md). To fill in a VM's own local SSD, run it there: ``SPOTTRAIN_BENCH_DIR=/mnt/disks/ssd
python -m bench state_size_bench``.

Memory: about three times the largest size (the state, the reusable host buffer, the restored copy).
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from bench.checkpoint_bench import KEY, _drop_cache, _every_step, _floor_write, _machine, _nbytes, _state
from stacks import gcp_rules
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.checkpoint.tiers import tier_table
from trainer.shutdown_window import trainer_budget_s

GiB = 1 << 30
MB = 1_000_000
PD_SIZES_GB = (300, 1000, 2500)
VCPUS = (8, 32)
LOCAL_SSDS = (1, 2, 4)


def _measure(d: Path, size_gb: float) -> dict[str, float]:
    state = _state(int(size_gb * GiB))
    nbytes = _nbytes(state)
    out: dict[str, float] = {"gib": nbytes / GiB}
    c = Checkpointer(_every_step(d / "p", keep=1), key=KEY)
    c.save(1, state)  # allocates and touches the reusable host buffer, as a trainer's first save does
    c.wait()
    t0 = time.perf_counter()
    out["blocked_s"] = c.save(2, state)
    c.wait()
    out["durable_s"] = time.perf_counter() - t0
    t0 = time.monotonic()
    report = c.emergency_save(3, state, deadline=t0 + 600.0)
    out["emergency_s"] = time.monotonic() - t0
    assert report.persistent_ok, report.detail
    c.close()
    del c
    out["floor_write_s"] = _floor_write(d, nbytes)
    folder = d / "p" / "step-00000003"
    for cache in ("warm", "cold"):
        if cache == "cold":
            _drop_cache(folder)
        t0 = time.perf_counter()
        rc = Checkpointer(tier_table(d / "p"), key=KEY)
        r = rc.restore()
        out[f"restore_{cache}_s"] = time.perf_counter() - t0
        assert r is not None and r.step == 3
        rc.close()
        del r, rc
    shutil.rmtree(d / "p", ignore_errors=True)
    return out


def fits(budget_s: float, trainer_s_per_gib: float, disk_mb_s: float) -> float:
    """The largest state (GiB) whose emergency save is durable within ``budget_s``."""
    disk_s_per_gib = GiB / (disk_mb_s * MB)
    return budget_s / (trainer_s_per_gib + disk_s_per_gib)


def main() -> None:
    logging.getLogger("trainer").setLevel(logging.WARNING)
    sizes = [float(s) for s in os.environ.get("SPOTTRAIN_BENCH_SIZES_GB", "4").split(",") if s.strip()]
    base = Path(os.environ.get("SPOTTRAIN_BENCH_DIR", tempfile.gettempdir()))
    load0 = os.getloadavg()
    rows, ram, disk = [], {}, {}
    d = Path(tempfile.mkdtemp(prefix="spottrain-size-bench-", dir=base))
    shm = Path(tempfile.mkdtemp(prefix="spottrain-size-bench-", dir="/dev/shm"))
    try:
        machine = _machine(d)
        for size in sizes:
            ram = _measure(shm, size)  # the trainer's own share: the disk costs nothing
            disk = _measure(d, size)
            for where, m in (("RAM disk", ram), ("this disk", disk)):
                rows.append(f"| {m['gib']:.2f} GiB | {where} | {m['blocked_s']:.2f} s | {m['durable_s']:.2f} s | "
                            f"{m['emergency_s']:.2f} s | {m['floor_write_s']:.2f} s | "
                            f"{m['emergency_s'] / m['floor_write_s']:.2f} | {m['restore_warm_s']:.2f} s | "
                            f"{m['restore_cold_s']:.2f} s |")
    finally:
        shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    load1 = os.getloadavg()
    budget = float(trainer_budget_s("spot"))
    trainer_s_per_gib = ram["emergency_s"] / ram["gib"]
    here_mb_s = disk["gib"] * GiB / MB / disk["floor_write_s"]

    print("### The checkpoint path at a rank's size\n")
    print(f"Machine: {machine}. Load average {load0[0]:.1f} before, {load1[0]:.1f} after (1 min). State: fp32 "
          "tensors of 16 MiB. One run per size; each moment once (a 4 GiB save is long enough not to need "
          "medians for this purpose).\n")
    print("| state | where | save: loop blocked | save: durable | emergency save | write floor | "
          "emergency / floor | restore warm | restore cold |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(r)
    print(f"\nThe trainer's share of an emergency save (on the RAM disk): {trainer_s_per_gib:.2f} s/GiB. "
          f"The Spot budget: {budget:.0f} s.\n")
    print("| disk (write rate) | largest state durable within the budget |")
    print("|---|---|")
    print(f"| this machine's disk ({here_mb_s:.0f} MB/s measured) | {fits(budget, trainer_s_per_gib, here_mb_s):.1f} GiB |")
    for gb in PD_SIZES_GB:
        for vcpus in VCPUS:
            rate = min(gb * gcp_rules.PD_SSD_WRITE_MB_S_PER_GB, gcp_rules.pd_ssd_vm_write_cap_mb_s(vcpus))
            print(f"| PD-SSD {gb} GB on a {vcpus}-vCPU VM ({rate:.0f} MB/s) | "
                  f"{fits(budget, trainer_s_per_gib, rate):.1f} GiB |")
    for n in LOCAL_SSDS:
        rate = n * gcp_rules.LOCAL_SSD_WRITE_MB_S_PER_DEVICE
        print(f"| local SSD x{n} ({rate:.0f} MB/s; the fast tier, lost with the VM) | "
              f"{fits(budget, trainer_s_per_gib, rate):.1f} GiB |")
    print()


if __name__ == "__main__":
    main()
