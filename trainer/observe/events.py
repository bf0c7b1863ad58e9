"""The run's events: what the loop tells whoever watches it, each emitted once.

An event is a frozen record of something that happened to the run. The loop emits it on the
``Bus`` (``trainer.observe.bus``), and every sink consumes it in its own way: the log line
(``trainer.observe.sinks.log``), the goodput ledger (``.sinks.ledger``), TensorBoard
(``.sinks.tensorboard``), or a sink of your own (``trainer.observe.sinks``).

Each name is said here once, and everything that reads or writes it imports it from here: the
log line, the ledger, ``status``, the glance, the goodput report and the stack's log-based metrics
(``stacks.run_metrics``).

``kind`` is the event's name in the goodput ledger (``trainer.observe.ledger``) and ``fields()``
its fields there, the same ones the ledger has always recorded, so that the ledger sink writes
exactly ``{"event": kind, **fields()}``. Events the ledger does not record (``Step``, ``Eval``,
``Goodput``) have no ``kind``. ``line`` is the event's name in its log line (``event=NAME``,
``trainer.observe.sinks.log``), which the log-based metrics count: the ledger's name, except for
the events the ledger does not record (``Step``, ``Eval``).

``RENAMED``: names the ledger once wrote for an event that has another name now, so that ledgers
written before the rename still read (``trainer.observe.ledger`` renames them as it reads).

Ranks: an event is emitted where the job knows it. Rank 0 speaks for the job (steps, evaluations,
checkpoints, the emergency save's verdict); each node leader records its own node's session
(start, placement, restore, notices, how the session ended).
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar


@dataclasses.dataclass(frozen=True)
class Event:
    """Base of every event; ``kind`` None: not recorded in the ledger."""

    kind: ClassVar[str | None] = None
    #: The name of its log line (``event=NAME``); the ledger's name unless a subclass says otherwise.
    line: ClassVar[str] = ""
    #: Fields that are not the ledger's (a log line's extras).
    not_recorded: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "line" not in vars(cls):
            cls.line = cls.kind or ""

    def fields(self) -> dict[str, Any]:
        """The ledger's fields of this event (those that are None and optional are left out)."""
        out = {}
        for f in dataclasses.fields(self):
            if f.name in self.not_recorded:
                continue
            v = getattr(self, f.name)
            if v is None and f.metadata.get("optional"):
                continue
            out[f.metadata.get("name", f.name)] = v
        return out


def _optional(default: Any = None, *, name: str | None = None) -> Any:
    """A field left out of the ledger record while it is None."""
    return dataclasses.field(default=default, metadata={"optional": True, **({"name": name} if name else {})})


# ------------------------------------------------------------------------------ the session


@dataclasses.dataclass(frozen=True)
class SessionStarted(Event):
    """A trainer process started (``goodput.session_start_fields``)."""

    kind: ClassVar[str] = "session_start"
    started: float
    pid: int
    host: str
    node: str
    main: bool
    world_size: int
    price_per_hour: float | None
    on_demand_price_per_hour: float | None


@dataclasses.dataclass(frozen=True)
class CapacityWait(Event):
    """Where this session runs and when its VM booted: with the previous session's end, the time
    the job waited without any VM for capacity (``waited_s``, when the run dir's ledger tells it;
    the report computes it over every session: ``goodput.Report.capacity_wait``)."""

    kind: ClassVar[str] = "capacity_wait"
    not_recorded: ClassVar[tuple[str, ...]] = ("waited_s",)
    zone: str
    provisioning: str
    boot_time: float | None
    waited_s: float | None = None


@dataclasses.dataclass(frozen=True)
class Restored(Event):
    """Start-up is over: the session continues from ``step`` (0: a fresh start)."""

    kind: ClassVar[str] = "restore"
    not_recorded: ClassVar[tuple[str, ...]] = ("tier", "path", "fresh_from")
    step: int
    seconds: float
    world_size: int
    startup_s: float
    tier: str = ""          # where it came from ("" when nothing was restored)
    path: str = ""
    fresh_from: str = ""    # without a checkpoint: "fresh" or "init_from's weights"


@dataclasses.dataclass(frozen=True)
class StepsChanged(Event):
    """The run's total steps changed at a resume (``extend_steps``)."""

    kind: ClassVar[str] = "steps_changed"
    step: int
    before: int = dataclasses.field(metadata={"name": "from"})
    after: int = dataclasses.field(metadata={"name": "to"})


@dataclasses.dataclass(frozen=True)
class InitFrom(Event):
    """A new run started from another run's checkpoint (``trainer.loop.init_from``'s provenance)."""

    kind: ClassVar[str] = "init_from"
    source: str
    step: int
    location: str
    layout: str
    optimizer: bool
    digest: str
    file_sha256: str | None = _optional()


# ------------------------------------------------------------------------------ training


@dataclasses.dataclass(frozen=True)
class Step(Event):
    """An optimizer step completed (rank 0): its loss, learning rate and the task's own metrics
    (a ``loss_fn`` that returns ``(loss, {name: value})``). ``window``: every
    ``log_every_steps`` (and at the last step) the figures of the interval that ends here
    (``trainer.observe.progress.StepWindow``), else None."""

    line: ClassVar[str] = "step"
    step: int
    total: int
    loss: float
    lr: float
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    window: dict[str, float] | None = None


@dataclasses.dataclass(frozen=True)
class Eval(Event):
    """An evaluation (rank 0: averaged over the ranks)."""

    line: ClassVar[str] = "eval"
    step: int
    values: dict[str, float]
    batches: int
    seconds: float


@dataclasses.dataclass(frozen=True)
class Progress(Event):
    """Where the session stands, every ``progress_every_s`` (the goodput report's productive time)."""

    kind: ClassVar[str] = "progress"
    step: int
    productive_s: float


@dataclasses.dataclass(frozen=True)
class Goodput(Event):
    """The job's goodput and cost so far (rank 0, from the ledger), charted beside the loss;
    ``on_demand_cost_usd``: the same work on demand (``goodput.Cost.on_demand_equivalent``)."""

    step: int
    goodput: float
    cost_usd: float | None
    on_demand_cost_usd: float | None = None


@dataclasses.dataclass(frozen=True)
class Stalled(Event):
    """No step completed for ``seconds`` (a hung collective or data loader): the health check
    answers ``stalled`` from now on, so the group recreates the VM."""

    kind: ClassVar[str] = "stalled"
    step: int
    seconds: float


@dataclasses.dataclass(frozen=True)
class DataWorkersDied(Event):
    """Data workers of this rank died under the loop after ``step`` (the OOM killer, a crash):
    ``died`` their pids and how (``1234:SIGKILL``), ``consumed`` the data position their batches
    come from again, ``deaths`` within the window (``trainer.data.batches.RESTART_WINDOW_S``).
    ``restarted``: new workers took over at the position, nothing lost; False: they kept dying,
    the step finishes with batches made in the training process, then the session saves and
    stops (``Failed`` ``data_workers``, exit 1: the unit restarts it)."""

    kind: ClassVar[str] = "data_workers_died"
    step: int
    consumed: int
    died: str
    deaths: int
    restarted: bool


# ------------------------------------------------------------------------------ checkpoints


@dataclasses.dataclass(frozen=True)
class CheckpointSaved(Event):
    """A periodic save was handed to the checkpointer (rank 0): the loop was blocked ``blocked_s``."""

    kind: ClassVar[str] = "checkpoint_save"
    step: int
    blocked_s: float
    productive_s: float


@dataclasses.dataclass(frozen=True)
class CheckpointDurable(Event):
    """A periodic save is durable on ``tier`` (rank 0; the timeline's checkpoints per tier)."""

    kind: ClassVar[str] = "durable"
    tier: str
    step: int


@dataclasses.dataclass(frozen=True)
class TierFailing(Event):
    """A checkpoint tier's writes keep failing (``since``: unix time of the first failure)."""

    kind: ClassVar[str] = "tier_failing"
    tier: str
    since: float
    failures: int
    error: str


@dataclasses.dataclass(frozen=True)
class TierOk(Event):
    """A checkpoint tier that was failing works again."""

    kind: ClassVar[str] = "tier_ok"
    tier: str


@dataclasses.dataclass(frozen=True)
class CheckpointsSetAside(Event):
    """The restore found nothing authentic to resume, only checkpoints in the bucket that are
    unauthenticated or signed for another run, and set them aside to start from scratch
    (``trainer.checkpoint.checkpointer.SetAside``): a person should look at them. ``saved_before``:
    the run's own signed record says it saved before, so its checkpoints were deleted (soft delete
    may hold them); False: it never saved (a first boot with planted objects). Rank 0."""

    kind: ClassVar[str] = "checkpoints_set_aside"
    saved_before: bool
    steps: list[int]
    found: str     # each set-aside checkpoint and why
    record: str    # what the run records on the remote tiers say


# ------------------------------------------------------------------------------ how a session ends


@dataclasses.dataclass(frozen=True)
class Notice(Event):
    """A preemption notice reached the loop (``reason``: SIGTERM, the metadata server, another
    node). ``step`` None: during start-up, before any step."""

    kind: ClassVar[str] = "preemption_notice"
    reason: str | None
    step: int | None = _optional()


@dataclasses.dataclass(frozen=True)
class Preempted(Event):
    """The session stopped for a notice. ``ok``: on rank 0, where the emergency save got to (each
    tier's ``{tier}_ok`` field; None elsewhere); ``detail``: what was saved and what was not.
    ``step`` None: stopped during start-up, before a step was restored."""

    kind: ClassVar[str] = "preempted"
    not_recorded: ClassVar[tuple[str, ...]] = ("ok", "seconds", "detail")
    step: int | None = _optional()
    productive_s: float | None = _optional()
    blocked_s: float = 0.0
    ok: dict[str, bool | None] | None = None
    seconds: float = 0.0
    detail: str = ""

    def fields(self) -> dict[str, Any]:
        out = super().fields()
        if self.ok is not None:
            out.update({f"{tier}_ok": v for tier, v in self.ok.items()})
        return out


@dataclasses.dataclass(frozen=True)
class Paused(Event):
    """``stop_at_step`` reached, or the spend cap (``reason`` "max_usd", with what the job has
    cost so far and the cap): the pause's checkpoint is durable."""

    kind: ClassVar[str] = "paused"
    step: int
    blocked_s: float
    productive_s: float
    reason: str | None = _optional()
    cost_usd: float | None = _optional()
    max_usd: float | None = _optional()


@dataclasses.dataclass(frozen=True)
class Finished(Event):
    """The run is finished: its final checkpoint is durable on every durable tier."""

    kind: ClassVar[str] = "finished"
    not_recorded: ClassVar[tuple[str, ...]] = ("again",)
    #: What the line of a re-run of a finished job adds (the ``finished`` metric leaves it out).
    AGAIN: ClassVar[str] = "already complete"
    step: int
    blocked_s: float
    productive_s: float
    again: bool = False   # a re-run of a finished job


@dataclasses.dataclass(frozen=True)
class Failed(Event):
    """The session stopped on an error: ``reason`` ``bad_input``, ``tier_unknown``, ``exception``,
    ``not_durable``, ``lease_lost`` or ``data_workers`` (they kept dying; the step reached is
    saved); ``detail`` says what (the ledger keeps 500 characters)."""

    kind: ClassVar[str] = "failed"
    not_recorded: ClassVar[tuple[str, ...]] = ("trace", "step")
    reason: str
    detail: str
    trace: str = ""       # the traceback of an exception, for the log
    step: int | None = None

    def fields(self) -> dict[str, Any]:
        return {"reason": self.reason, "detail": self.detail[:500]}


#: A ``Failed`` of reason ``not_durable`` is logged as a line of its own name (what it says: the
#: final checkpoint is not durable yet; run the same command again).
NOT_DURABLE = "not_durable"

# Ledger records that are not events of the loop.
#: One run of ``python -m trainer stage`` (``trainer.data.staging``), in a session of its own.
STAGING = "staging"
#: The ledger's own failed writes, counted (``trainer.observe.ledger``).
LEDGER_ERROR = "ledger_error"

#: Names the ledger once wrote -> the name of the same event now.
RENAMED = {"finish": Finished.kind, "checkpoint": CheckpointSaved.kind, "placement": CapacityWait.kind}


__all__ = ["Event", "SessionStarted", "CapacityWait", "Restored", "StepsChanged", "InitFrom", "Step", "Eval",
           "Progress", "Goodput", "Stalled", "DataWorkersDied", "CheckpointSaved", "CheckpointDurable", "TierFailing",
           "TierOk", "Notice", "Preempted", "Paused", "Finished", "Failed", "NOT_DURABLE", "STAGING",
           "LEDGER_ERROR", "RENAMED"]
