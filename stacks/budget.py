"""The emergency-save budget: does a checkpoint fit in the Spot shutdown window?

State size: the declared `state_bytes`, or `param_count` x 16 bytes (fp32 weights 4 + Adam's
two fp32 moments 8 = 12, plus 4 for a bf16/fp16 copy, scaler, RNG and pickle overhead: an
honest upper estimate for the usual mixed-precision Adam run). Write speed: PD-SSD gives about
0.48 MB/s per provisioned GB, capped per VM by its vCPU count. The save must finish inside the
window (30 s Spot, 120 s standard) minus a margin for the shutdown script, fsync and teardown.
The estimate is a warning, never an error: it is a model of the disk, not a measurement.

A pool writes per node, and the disk's speed is per VM, so the bytes that count are what one node
writes: with parallelism "ddp" global rank 0 writes the whole state (its node carries it all);
with "fsdp" every rank writes its shard, state / world size, the largest at the smallest world
(min_nodes x GPUs per node), and a node's GPUs write theirs onto one disk at once: shard x GPUs.
The window is the workers' (Spot: 30 s); any node may hold rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from stacks import gcp_rules as R
from stacks.experiment import Experiment

BYTES_PER_PARAM = 16


def size_text(nbytes: float) -> str:
    """A checkpoint size for people: "1.98 GB", or "1.8 MB" below a gigabyte."""
    return f"{nbytes / 1e9:,.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:,.1f} MB"


@dataclass(frozen=True)
class Budget:
    state_bytes: int | None
    source: str  # where state_bytes came from
    write_mb_s: float
    window_s: int
    available_s: int
    seconds: float | None

    @property
    def fits(self) -> bool | None:
        return None if self.seconds is None else self.seconds <= self.available_s

    def describe(self) -> str:
        if self.seconds is None:
            return (
                f"emergency save: unknown state size (declare trainer.param_count or "
                f"trainer.state_bytes); the disk writes ~{self.write_mb_s:.0f} MB/s, "
                f"{self.available_s} s available"
            )
        verdict = "fits" if self.fits else "DOES NOT FIT"
        return (
            f"emergency save: {size_text(self.state_bytes or 0)} ({self.source}) at ~{self.write_mb_s:.0f} MB/s = "
            f"{self.seconds:.1f} s of {self.available_s} s available "
            f"({self.window_s} s window - {R.SHUTDOWN_MARGIN_S} s margin): {verdict}"
        )

    def warning(self) -> str | None:
        if self.fits is not False:
            return None
        need_gb = (self.state_bytes or 0) / 1e6 / self.available_s / R.PD_SSD_WRITE_MB_S_PER_GB
        return (
            f"WARNING: {self.describe()}. The trainer would be killed mid-save and resume from "
            f"its previous checkpoint. Raise disk.checkpoint_disk_gb to at least "
            f"{int(need_gb) + 1} (if the VM's cap allows), shrink the state, or use local SSDs."
        )


def estimate(exp: Experiment) -> Budget:
    shape = exp.machine.shape
    write = min(
        exp.disk.checkpoint_disk_gb * R.PD_SSD_WRITE_MB_S_PER_GB,
        R.pd_ssd_vm_write_cap_mb_s(shape.vcpus),
    )
    window = R.SHUTDOWN_WINDOW_S[exp.machine.provisioning]
    available = window - R.SHUTDOWN_MARGIN_S
    if exp.trainer.state_bytes is not None:
        size, source = exp.trainer.state_bytes, "declared state_bytes"
    elif exp.trainer.param_count is not None:
        size = exp.trainer.param_count * BYTES_PER_PARAM
        source = f"{exp.trainer.param_count:,} params x {BYTES_PER_PARAM} B"
    else:
        return Budget(None, "undeclared", write, window, available, None)
    if exp.pool is not None and exp.trainer.parallelism == "fsdp":
        gpus = exp.machine.gpu_count
        world = exp.pool.min_nodes * gpus
        shard = -(-size // world)  # ceil: the largest shard
        size = shard * gpus
        source += (f", fsdp: {shard / 1e9:.2f} GB per rank at the smallest world "
                   f"({exp.pool.min_nodes} nodes x {gpus} GPUs) x {gpus} on a node's disk")
    elif exp.pool is not None:
        source += ", ddp: rank 0's node writes it all"
    return Budget(size, source, write, window, available, size / 1e6 / write)
