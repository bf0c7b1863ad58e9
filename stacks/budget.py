"""The emergency-save budget: does a checkpoint fit in the Spot shutdown window, in the worst
moment the notice can find the trainer in?

State size: the declared `state_bytes`, or `param_count` x 16 bytes (fp32 weights 4 + Adam's
two fp32 moments 8 = 12, plus 4 for a bf16/fp16 copy, scaler, RNG and pickle overhead: an
honest upper estimate for the usual mixed-precision Adam run). The save must finish inside the
trainer's budget, the one the stack passes it: the window (30 s Spot, 120 s standard) less the
margin and the unit's slack (`trainer.shutdown_window`).

What the trainer does from the notice until the checkpoint is durable on the persistent disk,
in order, each part at its worst (`trainer.train._emergency_save`, `Checkpointer._emergency`):

1. **the step in flight**: the loop finishes it first (one step: 1 / `cost.steps_per_second`,
   the stated throughput);
2. **a periodic save still writing**: the emergency save reuses its host buffer, so it waits for
   that save's disk writes (the local SSD tier if any, then the persistent disk: the whole state,
   when the notice came just as it began) and for its upload chunks in flight to stop (one
   per stream: `trainer.config.gcs_streams` of them for a state of 64 MiB or more);
3. **the copy to host**: the state from device memory into the host buffer, over one GPU's PCIe
   link (DDP: rank 0 copies it all; FSDP: each GPU its shard, in parallel);
4. **the disk write**: the state onto the persistent disk. PD-SSD writes about 0.48 MB/s per
   provisioned GB, capped per VM by its vCPU count, and its writes count against the VM's network
   egress cap, which the upload chunks still in flight share.

The estimate is a warning, never an error: it is a model of the machine, not a measurement. The
warning names the part that dominates and what shrinks it.

A pool writes per node, and the disk's speed is per VM, so the bytes that count are what one node
writes: with parallelism "ddp" global rank 0 writes the whole state (its node carries it all);
with "fsdp" every rank writes its shard, state / world size, the largest at the smallest world
(min_nodes x GPUs per node), and a node's GPUs write theirs onto one disk at once: shard x GPUs.
The window is the workers' (Spot: 30 s); any node may hold rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from stacks import gcp_rules as R
from stacks.experiment import Experiment
from trainer import shutdown_window

BYTES_PER_PARAM = 16
#: The trainer's resumable-upload chunk (`trainer.checkpoint.stores.GcsStore.CHUNK_SIZE`): an
#: upload stops between chunks, so at most one per stream is still in flight when the emergency
#: save begins.
UPLOAD_CHUNK_BYTES = 32 << 20
#: Files from this size up are uploaded in parallel streams (`GcsStore.PARALLEL_MIN_BYTES`).
PARALLEL_MIN_BYTES = 64 << 20


def upload_streams(exp: Experiment, size: int) -> int:
    """The streams the trainer uploads a state of ``size`` bytes in (``gcs_streams``, or 1)."""
    from trainer.config import RunConfig

    value = exp.trainer.config.get("gcs_streams")
    streams = value if isinstance(value, int) and not isinstance(value, bool) else \
        int(RunConfig.model_fields["gcs_streams"].default)
    return streams if size >= PARALLEL_MIN_BYTES else 1

STEP, PERIODIC, COPY, WRITE = "the step in flight", "a periodic save still writing", "the copy to host", \
    "the disk write"


def size_text(nbytes: float) -> str:
    """A checkpoint size for people: "1.98 GB", or "1.8 MB" below a gigabyte."""
    return f"{nbytes / 1e9:,.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:,.1f} MB"


@dataclass(frozen=True)
class Budget:
    state_bytes: int | None
    source: str  # where state_bytes came from
    write_mb_s: float  # the persistent disk's write rate
    window_s: int
    available_s: int
    seconds: float | None  # the worst case: the sum of ``parts``
    #: (part, seconds) in the order they happen (see the module docstring).
    parts: tuple[tuple[str, float], ...] = field(default=())
    #: Notes on how each part was reckoned, by part.
    how: dict[str, str] = field(default_factory=dict)
    disk_cap_mb_s: float = 0.0  # the VM's PD write cap (a bigger disk goes no faster)
    in_flight_s: float = 0.0  # of the periodic part: the upload chunks in flight, which no disk speeds up

    @property
    def fits(self) -> bool | None:
        return None if self.seconds is None else self.seconds <= self.available_s

    @property
    def dominant(self) -> tuple[str, float] | None:
        """The part that takes longest."""
        return max(self.parts, key=lambda p: p[1]) if self.parts else None

    def describe(self) -> str:
        if self.seconds is None:
            return (
                f"emergency save: unknown state size (declare trainer.param_count or "
                f"trainer.state_bytes); the disk writes ~{self.write_mb_s:.0f} MB/s, "
                f"{self.available_s} s available"
            )
        verdict = "fits" if self.fits else "DOES NOT FIT"
        parts = " + ".join(f"{name} {s:.1f} s" + (f" ({self.how[name]})" if name in self.how else "")
                           for name, s in self.parts)
        return (
            f"emergency save: {size_text(self.state_bytes or 0)} ({self.source}) at ~{self.write_mb_s:.0f} MB/s, "
            f"worst case {parts} = {self.seconds:.1f} s of {self.available_s} s available "
            f"({self.window_s} s window - {self.window_s - self.available_s} s margin): {verdict}"
        )

    def warning(self) -> str | None:
        if self.fits is not False:
            return None
        name, secs = self.dominant  # type: ignore[misc]
        return (
            f"WARNING: {self.describe()}. Most of it is {name} ({secs:.1f} s): {self._remedy(name)}. "
            f"The trainer would be killed mid-save and resume from its previous checkpoint."
        )

    def _remedy(self, part: str) -> str:
        if part == STEP:
            return ("one optimizer step takes that long (cost.steps_per_second); shorten it (fewer "
                    "micro-batches per step, or more GPUs) or correct the stated throughput")
        if part == COPY:
            return "shard the state (parallelism = \"fsdp\" over several GPUs) or shrink it"
        # Disk-bound: both the periodic save's write and the emergency write scale with disk speed.
        disk_s = sum(s for n, s in self.parts if n in (PERIODIC, WRITE)) - self.in_flight_s
        rest = (self.seconds or 0.0) - disk_s
        if rest >= self.available_s:
            return "no disk is fast enough alone: shrink the state or shorten the step"
        need = self.write_mb_s * disk_s / (self.available_s - rest)
        if need > self.disk_cap_mb_s:
            return (f"it needs ~{need:.0f} MB/s but this VM caps PD-SSD writes at {self.disk_cap_mb_s:.0f} MB/s: "
                    "use a machine type with more vCPUs, shrink the state, or use local SSDs")
        return (f"raise disk.checkpoint_disk_gb to at least {int(need / R.PD_SSD_WRITE_MB_S_PER_GB) + 1}, "
                "or shrink the state")


def estimate(exp: Experiment) -> Budget:
    shape = exp.machine.shape
    cap = R.pd_ssd_vm_write_cap_mb_s(shape.vcpus)
    write = min(exp.disk.checkpoint_disk_gb * R.PD_SSD_WRITE_MB_S_PER_GB, cap)
    window = shutdown_window.window_s(exp.machine.provisioning)
    available = shutdown_window.trainer_budget_s(exp.machine.provisioning)
    if exp.trainer.state_bytes is not None:
        size, source = exp.trainer.state_bytes, "declared state_bytes"
    elif exp.trainer.param_count is not None:
        size = exp.trainer.param_count * BYTES_PER_PARAM
        source = f"{exp.trainer.param_count:,} params x {BYTES_PER_PARAM} B"
    else:
        return Budget(None, "undeclared", write, window, available, None, disk_cap_mb_s=cap)
    gpus = exp.machine.gpu_count
    per_gpu = size  # what one GPU copies to the host
    if exp.trainer.parallelism == "fsdp" and (exp.pool is not None or gpus > 1):
        nodes = exp.pool.min_nodes if exp.pool is not None else 1
        shard = -(-size // (nodes * gpus))  # ceil: the largest shard
        size, per_gpu = shard * gpus, shard
        source += (f", fsdp: {shard / 1e9:.2f} GB per rank at the smallest world "
                   f"({nodes} nodes x {gpus} GPUs) x {gpus} on a node's disk")
    elif exp.pool is not None:
        source += ", ddp: rank 0's node writes it all"

    mb = size / 1e6
    egress = R.vm_egress_mb_s(shape.vcpus)
    chunk = UPLOAD_CHUNK_BYTES * upload_streams(exp, size) / 1e6  # what is in flight, every stream's
    local = exp.disk.local_ssd_count * R.LOCAL_SSD_WRITE_MB_S_PER_DEVICE
    step_s = 1.0 / exp.cost.steps_per_second
    in_flight_s = chunk / egress
    periodic_s = (mb / local if local else 0.0) + mb / write + in_flight_s
    copy_s = per_gpu / 1e9 / R.GPU_HOST_COPY_GB_S.get(exp.machine.gpu_type, 12.0)
    write_s = max(mb / write, (mb + chunk) / egress)  # the PD and the last chunks share the egress
    parts = ((STEP, step_s), (PERIODIC, periodic_s), (COPY, copy_s), (WRITE, write_s))
    how = {STEP: f"1 / cost.steps_per_second {exp.cost.steps_per_second:g}",
           PERIODIC: ("local SSD, then " if local else "") + "its whole disk write"}
    return Budget(size, source, write, window, available, sum(s for _, s in parts), parts, how, cap, in_flight_s)
