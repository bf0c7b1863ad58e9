"""Typed, documented configuration of the trainer, validated once at the edge.

Values come from three places, later ones winning: the field defaults, a TOML file given with
``--config FILE`` (top-level keys are the field names below, ``[task_args]`` is a table), and the
command-line flags. Any problem is reported as ``SOURCE: field: problem`` lines (SOURCE is the file
or ``command line``) and the process exits 2 without a traceback.
"""
from __future__ import annotations

import json
import sys

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser from PyPI (a dependency there)
    import tomli as tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, ValidationError,
                      ValidationInfo, field_validator)

from trainer.data.sampler import ORDER_VERSION
from trainer.observe.progress import HEARTBEAT_S
from trainer.shutdown_window import trainer_budget_s

DEFAULT_TASK = "trainer.tasks.gpt:build"
DEFAULT_HEALTH_PORT = 8471


class ConfigError(Exception):
    """Bad user input; ``lines`` are ``SOURCE: field: problem`` strings, printed as they are."""

    def __init__(self, lines: list[str]):
        super().__init__("\n".join(lines))
        self.lines = lines


def _check_gcs_uri(v: str) -> str:
    rest = v.removeprefix("gs://")
    if not v.startswith("gs://") or not rest or rest.startswith("/"):
        raise ValueError("must look like gs://BUCKET/PREFIX")
    return v


GcsUri = Annotated[str, AfterValidator(_check_gcs_uri)]


def _check_data_url(v: str) -> str:
    from trainer.checkpoint.stores import parse_gcs_uri

    try:
        _, name = parse_gcs_uri(v)
    except ValueError:
        name = ""
    if not name:
        raise ValueError("must look like gs://BUCKET/PREFIX[/NAME] (braces for ranges: shard-{000000..000099}.tar)")
    if any(ord(c) < 32 or c == "\x7f" for c in v):
        raise ValueError("must not hold control characters")
    return v


DataUrl = Annotated[str, AfterValidator(_check_data_url)]


class TierCadence(BaseModel):
    """One tier's own cadence and retention (``[tiers.gcs]`` in the config file); a setting left
    out falls back to the run-wide one."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    every_steps: int | None = Field(default=None, gt=0)
    """Save to this tier every K optimizer steps."""
    every_seconds: float | None = Field(default=None, gt=0)
    """Save to this tier every T seconds of wall time. With neither interval set here, the tier
    follows ``checkpoint_every_steps``/``checkpoint_every_seconds``, or the automatic interval."""
    keep: int | None = Field(default=None, ge=1)
    """Checkpoints kept on this tier (default: the run's ``keep``)."""


class RunConfig(BaseModel):
    """Settings of `python -m trainer run`."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)
    # Where each setting came from (the config file or "command line"), for a refusal that only
    # the run itself can make (a precision the device cannot do).
    _sources: dict[str, str] = PrivateAttr(default_factory=dict)

    def source_of(self, key: str) -> str:
        """The file (or "command line") that set ``key``; "default" when nothing did."""
        return self._sources.get(key, "default")

    run_dir: Path
    """Persistent checkpoint tier and home of the goodput ledger (the PD-SSD on a VM)."""
    steps: int = Field(gt=0)
    """Total optimizer steps of the whole job (across all restarts). Part of the fingerprint: a
    resume with another total is refused unless ``extend_steps`` is set."""
    extend_steps: bool = False
    """Let ``steps`` differ from the total the checkpoint was written with: the run resumes from
    its step and trains on to the new ``steps`` (no lower than the step it reached), recorded as
    ``steps_changed`` in the ledger; the task is built with the new total (``ctx.steps``). See
    docs/runs.md for what an LR schedule does then. Without it, another ``steps`` is exit 2."""
    allow_rollback: bool = False
    """Resume even though this run's ledger records a newer checkpoint durable in the bucket than
    any tier holds now (they were deleted: set it when you did that yourself, to go back). Without
    it such a restore is exit 2, naming the step (``trainer.loop.rollback``)."""
    init_from: str | None = None
    """Start this NEW run from another run's checkpoint: its run dir (a path) or its ``gs://``
    prefix; or from a weights file, ``FILE.safetensors`` (a path or ``gs://`` object; what
    ``export`` writes: another experiment's run, pretrained weights). Used only while this run has no checkpoint of its own (afterwards it resumes its
    own). Weights only unless ``init_from_optimizer``; the model must have the same parameter
    names and shapes. Recorded in the ledger and in this run's checkpoints (provenance)."""
    init_from_step: int | None = Field(default=None, ge=0)
    """The step of ``init_from`` to start from (default: its newest valid checkpoint)."""
    init_from_optimizer: bool = False
    """Also take the optimizer state from ``init_from`` (same parallelism as the source)."""
    seed: int = Field(default=0, ge=0, lt=2**63)
    """Seeds the model init, dropout and the data order. Part of the resume fingerprint."""
    gcs_uri: GcsUri | None = None
    """Durable tier, ``gs://BUCKET/PREFIX``; also receives a mirror of the goodput ledger."""
    local_dir: Path | None = None
    """Optional fast tier (local SSD); lost with the VM, so never the only copy."""
    data_dir: Path | None = None
    """Where the dataset was staged (``python -m trainer stage``; on a VM the stack stages the
    experiment's ``[data]`` there), handed to the task as ``ctx.data_dir``. Not part of the
    fingerprint: the same data may be staged to another disk after a restart."""
    data_url: DataUrl | None = None
    """The dataset in the bucket, read as it streams instead of staged (on a VM: the experiment's
    ``[data] source`` with ``stream = true``), handed to the task as ``ctx.data_url``, e.g. webdataset
    shards ``gs://BUCKET/PREFIX/shard-{000000..000999}.tar`` (``trainer.data.bucket_shards``). Part
    of the fingerprint when set: other data would not continue the run."""
    task: str = DEFAULT_TASK
    """``module:callable`` returning a :class:`trainer.task.Task`. Part of the fingerprint."""
    task_args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the task callable (e.g. model size). Part of the fingerprint."""
    script: str | None = None
    """Your own training script (a path, relative to the working directory: on a VM the code
    directory) run in place of a task: it keeps its own loop and iterates ``trainer.run``'s
    steps (docs/bring-your-own-model.md). Part of the fingerprint; ``task`` must then be unset."""
    script_args: list[str] = Field(default_factory=list)
    """The script's command line (``sys.argv[1:]``). Part of the fingerprint."""
    checkpoint_every_steps: int | None = Field(default=None, gt=0)
    """Save every K optimizer steps. With neither interval set, the checkpointer picks the
    interval itself from the measured save cost and ``mtbf_s`` (Young/Daly)."""
    checkpoint_every_seconds: float | None = Field(default=None, gt=0)
    """Save every T seconds of wall time (checked at step boundaries)."""
    keep: int = Field(default=3, ge=1)
    """Checkpoints kept on each tier (older valid ones are deleted after a newer one verifies)."""
    tiers: dict[Literal["local", "persistent", "gcs"], TierCadence] = Field(default_factory=dict)
    """Per-tier overrides, config file only: e.g. ``[tiers.local] every_steps = 50`` and
    ``[tiers.gcs] every_seconds = 900`` save to the local SSD often and to GCS rarely."""
    gcs_streams: int = Field(default=8, ge=1, le=32)
    """Connections one checkpoint file of 64 MiB or more uses at once to and from the bucket
    (Cloud Storage limits what one stream carries): an upload goes up as that many parts at once,
    composed into the file's object, a download comes down as that many ranged reads, each with
    the single stream's preconditions, retries and deadline (docs/durability.md). Smaller files
    use one. At most 32 (one compose's limit). 1: one stream per file, and no temporary parts
    (which a bucket with soft delete keeps, billed, for its retention). Not part of the
    fingerprint."""
    mtbf_s: float = Field(default=6 * 3600, gt=0)
    """Expected seconds between preemptions, for the automatic checkpoint interval."""
    health_port: int | None = Field(default=DEFAULT_HEALTH_PORT, ge=0, le=65535)
    """TCP port of the health server (0: any free port, logged at start-up; none in TOML: off)."""
    health_host: str = "0.0.0.0"
    """Address the health server binds to."""
    health_request: str = "spottrain-health"
    """The request bytes the health check sends; other requests get ``unknown\\n``."""
    stall_timeout_s: float = Field(default=600.0, gt=0)
    """Health answers ``stalled`` once no step has completed for this long (hung collective or
    data loader), so that the managed instance group autoheals the VM."""
    startup_grace_s: float = Field(default=900.0, ge=0)
    """Health answers ``ok starting`` (passing the group's check) for this long after the trainer
    starts, then ``starting`` (failing it) until the first step: a restart in place (a crash,
    systemd, torchrun) restoring a big model is not taken for a dead VM, which the group's
    ``initial_delay_sec`` covers for new VMs only, and a start-up that hangs still gets repaired.
    On a VM the stack sets it to ``group.initial_delay_sec``. Not part of the fingerprint."""
    durable_timeout_s: float = Field(default=600.0, gt=0)
    """How long the final save (and a ``stop_at_step`` pause) keeps trying to make its checkpoint
    durable on every durable tier (the run dir and GCS: written, then read back), saving again
    where a copy is missing. Past it the trainer exits 74; running it again writes the missing
    copies (the run only counts as finished, exit 0, once they are all there)."""
    preemption_budget_s: float = Field(default=float(trainer_budget_s("spot")), gt=0)
    """Seconds from a preemption notice by which the emergency save must be durable; what is
    still uploading then is abandoned. The default is a Spot VM's (its 30 s window less the unit's
    margin and slack, `trainer.shutdown_window`); on a VM the stack sets it for the VM's
    provisioning (a standard VM's window is 120 s)."""
    watch_metadata: bool = True
    """Follow the GCE metadata server's ``instance/preempted`` (fails quietly off GCE)."""
    batch_size: int = Field(default=16, gt=0)
    """Samples per micro-batch on each rank. Part of the fingerprint."""
    grad_accum_steps: int = Field(default=1, gt=0)
    """Micro-batches per optimizer step. Part of the fingerprint. Ignored when
    ``global_batch_size`` is set."""
    global_batch_size: int | None = Field(default=None, gt=0)
    """Samples per optimizer step over all ranks, kept constant when the world size changes
    (an elastic job losing or gaining a node): each rank accumulates
    ``global_batch_size / (batch_size * world_size)`` micro-batches, which must be a whole
    number at every world size the job runs at (checked at start, exit 2 otherwise). Part of
    the fingerprint. None: ``grad_accum_steps`` micro-batches per rank, so the global batch
    follows the world size."""
    parallelism: Literal["ddp", "fsdp"] = "ddp"
    """``ddp``: every rank holds the whole model; rank 0 saves it once. ``fsdp``: parameters and
    optimizer state are sharded over the ranks (FSDP2); every rank saves its shard through
    ``torch.distributed.checkpoint``, and a checkpoint loads at any world size. Part of the
    fingerprint."""
    collective_timeout_s: float = Field(default=300.0, gt=0)
    """A collective that waits longer than this fails, so that survivors of a node that vanished
    restart (torchrun re-forms the world) instead of hanging until the health check gives up."""
    stop_at_step: int | None = Field(default=None, gt=0)
    """Pause after this many steps: save (every tier), wait until durable and exit 75, as if
    preempted. For staged runs (change the pool or the machine, then resume). Not part of the
    fingerprint. Under torchrun, the agent would restart the paused workers: pass it to a single
    process or stop the job instead."""
    grad_clip: float | None = Field(default=1.0, gt=0)
    """Clip the global gradient norm to this value (none: no clipping). Part of the fingerprint."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Autocast dtype of the forward pass, on CUDA and on the CPU alike; fp16 adds a grad scaler.
    A precision the installed PyTorch cannot autocast on the run's device is refused (exit 2),
    never trained in fp32 instead. Part of the fingerprint."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """``auto`` takes CUDA when available (one device per local rank). The device it resolves to
    (cpu or cuda) is part of the fingerprint: other kernels give other numbers."""
    threads: int = Field(default=1, gt=0)
    """torch intra-op CPU threads; fixed so that CPU results are reproducible. Part of the
    fingerprint (another count sums in another order, so the weights differ)."""
    deterministic: bool = True
    """``torch.use_deterministic_algorithms`` (warn-only for ops without a deterministic kernel).
    Part of the fingerprint."""
    wait_for_tiers_s: float = Field(default=900.0, gt=0)
    """Seconds start-up waits for a configured tier it cannot list or read (GCS answering 403
    while a new VM's IAM grant propagates, up to ~7 minutes; GCS down; a verified checkpoint whose
    load failed on I/O, memory or a peer) before it exits 69 without training: it never chooses
    where to resume without every tier. Meanwhile the health check answers ``ok waiting``, so the
    group does not recreate the VM."""
    lease_ttl_s: float = Field(default=120.0, gt=0)
    """Seconds the job's writer lease on ``gcs_uri`` lasts without renewal (renewed every quarter
    of it), by Cloud Storage's clock. A trainer that died without releasing it delays a trainer
    on another VM by at most this long; its restart on the same VM, run dir and boot takes it
    over at once."""
    log_every_steps: int = Field(default=10, gt=0)
    """One structured log line every this many steps."""
    heartbeat_every_s: float = Field(default=HEARTBEAT_S, gt=0, allow_inf_nan=False)
    """Seconds between the ``event=heartbeat`` lines of a node that trains without logging the step
    lines (a pool's other nodes: only global rank 0 logs them). Its log shipper's stall clock
    counts them, so the stack refuses a value that is not well under ``[alerts] stall_minutes``."""
    progress_every_s: float = Field(default=60.0, gt=0)
    """Seconds between goodput progress events in the ledger."""
    price_per_hour: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    """USD per hour of this VM as provisioned (Spot or standard), recorded in the ledger so that
    ``status`` reports what the job has cost. Not part of the fingerprint: prices may change
    between restarts (the stack passes the current one at every boot). None: unknown."""
    on_demand_price_per_hour: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    """USD per hour of the same VM on demand, for ``status``'s on-demand comparison. Not part of
    the fingerprint. None: unknown."""
    max_usd: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    """A spend cap: once what the job has cost so far (the goodput ledger's cost, from each
    session's ``price_per_hour``; checked at start and every ``progress_every_s``) reaches this
    many USD, the run pauses as for ``stop_at_step``: its checkpoint durable on every tier, the
    line ``event=paused reason=max_usd``, exit 77. On a VM the group then goes to zero until the
    experiment changes (raise it and deploy to continue). Without a price the cost is unknown
    and nothing is capped (said at start). Not part of the fingerprint. None: no cap."""
    data_workers: int = Field(default=0, ge=0)
    """Worker processes that load and collate batches ahead of the loop (a torch DataLoader over
    the trainer's own order, two batches prefetched per worker, pinned memory on CUDA). 0 loads
    each batch in the training process when the step needs it. Not part of the fingerprint: the
    weights are bit-identical with any number of workers, so it may change across a resume.
    With workers, the dataset is indexed in other processes: ``ds[i]`` must not rely on the
    training process's RNG or state (it must be a pure function of ``i`` anyway). A worker that
    dies (the OOM killer) is replaced at the position, nothing lost; at the 4th death within 10
    minutes the step is saved and the trainer exits 1 to be restarted (``event=data_workers_died``)."""
    eval_every_steps: int | None = Field(default=None, gt=0)
    """Evaluate the task's eval set (or eval callable) every K optimizer steps and at the end;
    logged as ``event=eval`` and written to TensorBoard as ``eval/loss``. Its randomness is
    isolated, so the weights are bit-identical with and without it. Not part of the
    fingerprint. None: no evaluation."""
    eval_batches: int = Field(default=10, gt=0)
    """Micro-batches of ``batch_size`` per rank that one evaluation averages over (a fixed
    prefix of the eval set, the same at every evaluation). Not part of the fingerprint."""
    tensorboard: bool = True
    """Write TensorBoard scalars (``train/loss``, ``lr``, throughput, ``eval/loss``, goodput)
    under ``RUN_DIR/tensorboard/`` and mirror them to ``GCS_URI/tensorboard/``. Not part of
    the fingerprint."""
    sinks: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """More sinks of the run's events, one table each, config file only: e.g. ``[sinks.jsonl]
    path = "/var/log/run-events.jsonl"`` writes every event as a JSON line (``trainer.observe.sinks``
    lists them; a sink is one module there). The log line, the goodput ledger and TensorBoard are
    sinks too and need no table. Not part of the fingerprint."""
    metrics_upload_every_s: float = Field(default=60.0, gt=0)
    """Seconds between uploads of this session's TensorBoard event file to the durable tier
    (each upload replaces the object; the last one is made when the session ends)."""
    checkpoint_key_file: Path | None = None
    """The run's checkpoint key (``trainer.checkpoint.key``): every manifest is signed with it, and
    only checkpoints whose HMAC verifies under it are loaded. Must exist when set. None: the
    environment's ``SPOTTRAIN_CHECKPOINT_KEY_FILE``, else the per-user
    ``~/.config/spottrain/checkpoint.key``, created on first use. On a VM the stack passes the
    experiment's key. Not part of the fingerprint."""

    def checkpoint_key(self) -> Any:
        """The :class:`~trainer.checkpoint.key.CheckpointKey` of this run (``KeyProblem``: exit 2)."""
        from trainer.checkpoint.key import resolve

        return resolve(self.checkpoint_key_file, create_default=True)

    def run_identity(self) -> str | None:
        """What this run's manifests are signed for: its durable location (``gs://BUCKET/PREFIX``);
        None without a bucket (a disk a bucket writer cannot reach needs no binding)."""
        if self.gcs_uri is None:
            return None
        from trainer.checkpoint.stores import parse_gcs_uri
        from trainer.manifest_auth import run_uri

        return run_uri(*parse_gcs_uri(self.gcs_uri))

    def run_key(self) -> Any:
        """The checkpoint key bound to this run (``CheckpointKey.run``): the trainer's own
        checkpointer signs with it and refuses another run's checkpoints copied into its tiers."""
        key = self.checkpoint_key()
        return None if key is None else key.bound_to(self.run_identity())

    @field_validator("task")
    @classmethod
    def _task(cls, v: str) -> str:
        module, sep, attr = v.partition(":")
        if not sep or not module or not attr:
            raise ValueError("must be module:callable, e.g. trainer.tasks.gpt:build")
        return v

    @field_validator("init_from")
    @classmethod
    def _init_from(cls, v: str | None) -> str | None:
        if v is not None and v.startswith("gs://"):
            from trainer.checkpoint.stores import parse_gcs_uri

            try:
                parse_gcs_uri(v)
            except ValueError as e:
                raise ValueError(str(e)) from None
        elif v is not None and not v.strip():
            raise ValueError("must be a run dir or a gs://BUCKET/PREFIX")
        return v

    @field_validator("init_from_step", "init_from_optimizer")
    @classmethod
    def _needs_init_from(cls, v: Any, info: ValidationInfo) -> Any:
        if v not in (None, False) and info.data.get("init_from") is None:
            raise ValueError("is set but there is no init_from (the run to start from)")
        return v

    @field_validator("sinks")
    @classmethod
    def _sinks(cls, v: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        from trainer.observe.sinks import validate

        return validate(v)

    @field_validator("task_args")
    @classmethod
    def _task_args(cls, v: dict[str, Any]) -> dict[str, Any]:
        try:
            json.dumps(v, sort_keys=True)
        except (TypeError, ValueError) as e:
            raise ValueError(f"must hold plain values (numbers, strings, lists, tables): {e}") from None
        return v

    @field_validator("script")
    @classmethod
    def _script(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is None:
            return v
        if not v.endswith(".py") or "\n" in v or "\x00" in v:
            raise ValueError(f"must be the path of a Python file (NAME.py), got {v!r}")
        if info.data.get("task", DEFAULT_TASK) != DEFAULT_TASK:
            raise ValueError("give a task or a script, not both (a script keeps its own loop; a task is built by "
                             "the trainer's)")
        return v

    # Field validators, not a model validator: an error then names its field (and so its file).
    @field_validator("local_dir")
    @classmethod
    def _local_dir(cls, v: Path | None, info: ValidationInfo) -> Path | None:
        run_dir = info.data.get("run_dir")
        if v is not None and run_dir is not None and v.resolve() == run_dir.resolve():
            raise ValueError("must differ from run_dir")
        return v

    @field_validator("tiers")
    @classmethod
    def _tiers_exist(cls, v: dict[str, TierCadence], info: ValidationInfo) -> dict[str, TierCadence]:
        from trainer.checkpoint.tiers import GCS

        if "local" in v and info.data.get("local_dir") is None:
            raise ValueError("[tiers.local] is set but there is no local_dir (the local tier)")
        if GCS in v and info.data.get("gcs_uri") is None:
            raise ValueError(f"[tiers.{GCS}] is set but there is no gcs_uri (the GCS tier)")
        return v

    def tier_cadence(self) -> dict[str, Any]:
        """Each tier's :class:`~trainer.checkpoint.tiers.Cadence`: its own if it has one, else the
        run-wide flags (both unset: automatic)."""
        from trainer.checkpoint.tiers import TIER_NAMES, Cadence

        out = {}
        for tier in TIER_NAMES:
            own = self._own(tier)
            fixed = own.every_steps is not None or own.every_seconds is not None
            out[tier] = Cadence(every_steps=own.every_steps if fixed else self.checkpoint_every_steps,
                                every_seconds=own.every_seconds if fixed else self.checkpoint_every_seconds)
        return out

    def tier_keep(self) -> dict[str, int]:
        """How many checkpoints each tier keeps: its own ``keep``, else the run's."""
        from trainer.checkpoint.tiers import TIER_NAMES

        return {t: k if (k := self._own(t).keep) is not None else self.keep for t in TIER_NAMES}

    def _own(self, tier: str) -> TierCadence:
        """The ``[tiers.NAME]`` table of ``tier`` (an empty one when it has none)."""
        return next((own for name, own in self.tiers.items() if name == tier), TierCadence())

    def tier_table(self, *, gcs_client: Any = None) -> Any:
        """This run's :class:`~trainer.checkpoint.tiers.Tiers` (``trainer.checkpoint.tiers.tier_table``)."""
        from trainer.checkpoint.tiers import tier_table

        return tier_table(self.run_dir, local_dir=self.local_dir, gcs_uri=self.gcs_uri, cadence=self.tier_cadence(),
                          keep=self.tier_keep(), gcs_client=gcs_client, gcs_streams=self.gcs_streams)

    def accum_steps(self, world_size: int) -> int:
        """Micro-batches per rank per optimizer step at ``world_size``; ValueError if
        ``global_batch_size`` does not divide into whole micro-batches there."""
        if self.global_batch_size is None:
            return self.grad_accum_steps
        per_step = self.batch_size * world_size
        if self.global_batch_size % per_step:
            raise ValueError(
                f"global_batch_size {self.global_batch_size} is not a multiple of batch_size "
                f"{self.batch_size} x world size {world_size} = {per_step}: choose a global batch "
                f"that every world size of the pool divides (or a smaller batch_size)")
        return self.global_batch_size // per_step

    def fingerprint(self, *, dataset_len: int, device: str | None = None) -> dict[str, Any]:
        """Settings that must not change across a resume, or the result would not be the run's.

        ``device``: the device type the run resolved to ("cpu", "cuda"); None records the setting.
        The world size is not one of them: the data position counts global samples, so an
        elastic job continues at another world size (with ``global_batch_size``, on the same
        optimisation trajectory up to floating-point reduction order). Keys added after
        checkpoints existed are listed in ``state.LATER_KEYS``.
        """
        fp = {
            "threads": self.threads,
            "deterministic": self.deterministic,
            "device": device if device is not None else self.device,
            "seed": self.seed,
            "steps": self.steps,
            "task": self.task if self.script is None else f"script {self.script}",
            "task_args": self.task_args if self.script is None else self.script_args,
            "batch_size": self.batch_size,
            "grad_clip": self.grad_clip,
            "precision": self.precision,
            "parallelism": self.parallelism,
            "dataset_len": dataset_len,
            "data_order": ORDER_VERSION,
        }
        if self.data_url is not None:  # set: the data it names decide the run (unset: no key, as before)
            fp["data_url"] = self.data_url
        if self.global_batch_size is None:
            fp["grad_accum_steps"] = self.grad_accum_steps
        else:
            fp["global_batch_size"] = self.global_batch_size
        return fp


class StatusConfig(BaseModel):
    """Settings of `python -m trainer status`."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    run_dir: Path | None = None
    """Persistent tier to inspect; None: a run known only by its bucket (``gcs_uri``)."""
    gcs_uri: GcsUri | None = None
    """Durable tier to inspect (and the ledger mirror)."""
    local_dir: Path | None = None
    """Fast tier to inspect."""
    json_output: bool = False
    """Print one JSON object instead of the human report."""
    plot: Path | None = None
    """Also draw the job's timeline from the goodput ledger into this PNG file."""
    watch_s: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    """``--watch``: print the report again every this many seconds until interrupted. None: once."""
    count: int | None = Field(default=None, ge=1)
    """With ``--watch``: stop after this many reports. None: until interrupted."""
    checkpoint_key_file: Path | None = None
    """The run's checkpoint key, as for ``run`` (never created here). Without one, whole-model
    checkpoints are shown unauthenticated (nothing is unpickled either way) and sharded ones not
    at all."""


class ExportConfig(BaseModel):
    """Settings of `python -m trainer export`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run_dir: Path | None = None
    """The run's persistent tier (its run dir)."""
    gcs_uri: GcsUri | None = None
    """The run's durable tier, ``gs://BUCKET/PREFIX`` (with or without ``run_dir``)."""
    local_dir: Path | None = None
    """The run's fast tier, if it has one here."""
    step: int | None = Field(default=None, ge=0)
    """The checkpoint to export (default: the newest valid one)."""
    out: Path
    """The ``.safetensors`` file to write; the JSON sidecar goes next to it (``FILE.json``)."""
    checkpoint_key_file: Path | None = None
    """The run's checkpoint key, as for ``run`` (never created here): only checkpoints it
    authenticates are exported, and a sharded one only with it."""


def _errors(e: ValidationError, source_of: dict[str, str]) -> list[str]:
    lines = []
    for err in e.errors():
        loc = [str(p) for p in err["loc"]]
        field = ".".join(loc) if loc else "(config)"
        source = source_of.get(loc[0], "command line") if loc else "command line"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown setting"
        elif err["type"] == "missing":
            msg = "required (flag --" + field.replace("_", "-") + ")"
        lines.append(f"{source}: {field}: {msg}")
    return lines


def load_run_config(cli: dict[str, Any], config_file: Path | None) -> RunConfig:
    """Merge defaults < TOML file < flags (those not None) and validate; raise ConfigError."""
    values: dict[str, Any] = {}
    source_of: dict[str, str] = {}
    if config_file is not None:
        try:
            with open(config_file, "rb") as f:
                data = tomllib.load(f)
        except OSError as e:
            raise ConfigError([f"{config_file}: cannot read: {e.strerror}"]) from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError([f"{config_file}: not valid TOML: {e}"]) from None
        # A TOML file cannot write null; "none" turns off an optional setting such as health_port.
        for k, v in data.items():
            values[k] = None if v == "none" else v
            source_of[k] = str(config_file)
    for k, v in cli.items():
        if v is not None:
            values[k] = v
            source_of[k] = "command line"
    try:
        cfg = RunConfig.model_validate(values)
    except ValidationError as e:
        raise ConfigError(_errors(e, source_of)) from None
    cfg._sources.update(source_of)
    return cfg


_R = TypeVar("_R", StatusConfig, ExportConfig)


def load_export_config(cli: dict[str, Any]) -> ExportConfig:
    return _load_reader(ExportConfig, cli, "the run to export")


def load_status_config(cli: dict[str, Any]) -> StatusConfig:
    return _load_reader(StatusConfig, cli, "the run to inspect")


def _load_reader(model: type[_R], cli: dict[str, Any], what: str) -> _R:
    """The settings of a command that reads a run (status, export): command-line flags only, and
    a run dir or a bucket prefix to read."""
    try:
        cfg = model.model_validate({k: v for k, v in cli.items() if v is not None})
    except ValidationError as e:
        raise ConfigError(_errors(e, {})) from None
    if cfg.run_dir is None and cfg.gcs_uri is None:
        raise ConfigError([f"command line: run_dir: {what} is required "
                           "(flag --run-dir DIR or --gcs-uri gs://BUCKET/PREFIX)"])
    return cfg
