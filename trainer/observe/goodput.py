"""The goodput report: what the ledger's events say about the job.

Report (all sessions together), after ml-goodput-measurement:
- ``wall_s``: first session start to the last event seen (within a session, every duration comes
  from the ledger's monotonic ``e``; the wall clock only places each session);
- ``productive_s``: time spent in training steps whose result survived;
- ``lost_s``: time spent on steps beyond the step a later session restored from;
- ``startup_s``, ``restore_s``, ``checkpoint_blocked_s``: badput of start-up, restore, and the time
  the loop was blocked by checkpoint snapshots and emergency saves;
- ``downtime_s``: wall time outside any session (VM recreation) and after a session's last event;
- ``capacity_wait_s``: the part of the downtime spent without any VM: from the previous session's
  last event to the boot of the VM that ran the next session (its ``placement`` event: zone,
  provisioning model, boot time from the metadata server and the kernel). ``capacity_wait`` splits
  it by ``zone/PROVISIONING_MODEL`` of the VM that ended the wait; the rest of the gap is boot;
- ``staging_s``: time spent staging the dataset onto the VM before the trainer started
  (``python -m trainer stage``, one ``staging`` event per run of it, in a session of its own
  that has no ``session_start``): badput of its own, counted once when nodes stage side by side;
  ``staging_bytes``: the bytes those runs downloaded (0 when everything was on the disk already);
- ``goodput`` = productive_s / wall_s; ``preemptions``: preemption notices; ``crashes``: sessions
  that ended without a trace (SIGKILL, hard power-off, OOM kill); ``failures``: sessions that
  stopped on an error (bad input, an exception); ``sessions``; ``finished``;
- ``cost``: what the job has cost, from the hourly prices each session recorded (see ``Cost``);
- ``ledger_errors``: writes of the ledger that failed (``{"local": n, "mirror": n}``, summed over
  sessions); ``skipped_events``: malformed events the report left out.

A multi-node job has one ledger writer per node (its local rank 0; ``session_start`` names the
node and whether the session was the job's rank 0). The job's figures come from its rank-0
sessions, which follow one another as the world is re-formed; ``nodes`` holds the same report
per node, and the job's cost is the sum of the nodes' costs (each node runs at its own price:
an on-demand coordinator and Spot workers).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from trainer.observe.events import (LEDGER_ERROR, STAGING, CapacityWait, CheckpointSaved, Failed, Finished, Notice,
                                    Paused, Preempted, Progress, Restored, SessionStarted)
from trainer.observe.ledger import _integer, _key, _number, usable

#: Events that record where the session's step and productive time stood.
_PROGRESS = (Progress.kind, CheckpointSaved.kind, Finished.kind, Preempted.kind, Paused.kind)
#: Events whose ``blocked_s`` the loop spent blocked by a checkpoint.
_BLOCKED = (CheckpointSaved.kind, Preempted.kind, Finished.kind, Paused.kind)


@dataclass
class Cost:
    """What the job has cost so far, from the prices each session recorded at its start.

    - ``cost_so_far``: sum over sessions of the session's wall time (process start to its last
      event; a killed session counts up to its last event) / 3600 x its ``price_per_hour``. Only
      priced sessions count: with ``unpriced_sessions`` > 0 it is a lower bound; None when no
      session recorded a price. Time between sessions (VM recreation) is not billed here.
    - ``cost_per_1000_steps``: ``cost_so_far`` / steps completed x 1000, where steps completed is
      the latest step the job has reached (the newest session's last recorded step).
    - ``on_demand_equivalent``: the same work on an on-demand VM that is never interrupted, i.e.
      with goodput 1: the productive seconds (training steps whose result survived) of each session
      x that session's ``on_demand_price_per_hour``. Start-up, restores, checkpoint stalls, lost
      work and downtime are what preemption costs, so they are left out: this is the lower bound
      that the Spot price is compared with. None when no session recorded an on-demand price.
    - ``savings``: ``on_demand_equivalent`` - ``cost_so_far`` (negative: Spot cost more), only when
      every session recorded both prices, else None (a partial sum would mislead).
    - ``priced_sessions`` / ``unpriced_sessions``: sessions with / without a ``price_per_hour``.
    """

    cost_so_far: float | None
    cost_per_1000_steps: float | None
    on_demand_equivalent: float | None
    savings: float | None
    priced_sessions: int
    unpriced_sessions: int


@dataclass
class Report:
    goodput: float
    wall_s: float
    productive_s: float
    startup_s: float
    restore_s: float
    checkpoint_blocked_s: float
    lost_s: float
    downtime_s: float
    preemptions: int
    crashes: int
    failures: int
    sessions: int
    finished: bool
    cost: Cost = field(default_factory=lambda: Cost(None, None, None, None, 0, 0))
    #: Seconds without any VM before a session (waiting for capacity), and by zone/model.
    capacity_wait_s: float = 0.0
    capacity_wait: dict[str, float] = field(default_factory=dict)
    #: The latest step the job has reached (the newest session's last recorded step).
    steps: int = 0
    #: Seconds spent staging the dataset before training (``python -m trainer stage``), and the
    #: bytes it downloaded.
    staging_s: float = 0.0
    staging_bytes: int = 0
    #: Per node (multi-node jobs only): the same report over that node's sessions.
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Failed ledger writes recorded by the sessions, by where (``local``, ``mirror``).
    ledger_errors: dict[str, int] = field(default_factory=dict)
    #: Malformed events left out of this report.
    skipped_events: int = 0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["nodes"] = dict(self.nodes)
        d["capacity_wait"] = {k: round(v, 3) for k, v in self.capacity_wait.items()}
        # Money stays unrounded: a short run costs fractions of a cent, and the fields must agree.
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in d.items()}


def _price(ev: dict[str, Any] | None, key: str) -> float | None:
    v = ev.get(key) if ev else None
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _productive_at(points: list[tuple[int, float]], step: int) -> float:
    """Productive seconds a session had spent when it completed ``step`` (linear in between)."""
    if step <= points[0][0]:
        return 0.0
    for (s0, p0), (s1, p1) in zip(points, points[1:]):
        if step <= s1:
            return p0 + (p1 - p0) * (step - s0) / max(1, s1 - s0)
    return points[-1][1]


def report(events: list[dict[str, Any]]) -> Report:
    """The job's report; for a multi-node job also one per node (see the module docstring).
    Malformed events are skipped with a warning and counted in ``skipped_events``."""
    given = len(events)
    events = _placed(usable(events, "report"))
    job = _job_report(events)
    job.skipped_events = given - len(events)
    job.ledger_errors = _ledger_errors(events)
    return job


def _placed(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each session's events on one clock: the wall clock places the session once (its first
    event stamped with ``e``: the ledger opened at ``t - e``), the monotonic ``e`` places every
    event in it from there, so a wall-clock step inside a session changes no duration. Events
    without ``e`` (older ledgers) keep their ``t``."""
    anchor: dict[str, float] = {}
    for ev in sorted(events, key=_key):
        if _number(ev.get("e")):
            anchor.setdefault(str(ev["session"]), float(ev["t"]) - float(ev["e"]))
    out = []
    for ev in events:
        a = anchor.get(str(ev["session"]))
        if a is not None and _number(ev.get("e")):
            ev = dict(ev, t=a + float(ev["e"]))
        out.append(ev)
    return out


def _ledger_errors(events: list[dict[str, Any]]) -> dict[str, int]:
    """The largest ``count`` of each session's ``ledger_error`` events, by ``where``, summed."""
    most: dict[tuple[str, str], int] = {}
    for e in events:
        if e["event"] == LEDGER_ERROR and _integer(e.get("count")):
            k = (str(e["session"]), str(e.get("where", "?")))
            most[k] = max(most.get(k, 0), int(e["count"]))
    out: dict[str, int] = {}
    for (_, where), n in most.items():
        out[where] = out.get(where, 0) + n
    return out


def _job_report(events: list[dict[str, Any]]) -> Report:
    by_session: dict[str, list[dict[str, Any]]] = {}
    for ev in events:
        by_session.setdefault(str(ev["session"]), []).append(ev)
    node_of: dict[str, str] = {}
    main_sessions: set[str] = set()
    for sid, evs in by_session.items():
        start = next((e for e in evs if e["event"] in (SessionStarted.kind, STAGING)), None) or {}
        node_of[sid] = str(start.get("node") or start.get("host") or "?")
        if start.get("main", True) is not False:
            main_sessions.add(sid)
    job = _report([e for e in events if str(e["session"]) in main_sessions])
    nodes = sorted(set(node_of.values()))
    if len(nodes) > 1 or len(main_sessions) < len(by_session):
        # A node's work counts as lost when the job later restored from an earlier step, whichever
        # node that restore ran on: judge every node against the job's restores.
        restores = [(float(e["t"]), int(e["step"])) for e in events
                    if e["event"] == Restored.kind and str(e["session"]) in main_sessions]
        per_node = {n: _report([e for e in events if node_of[str(e["session"])] == n], restores)
                    for n in nodes}
        job.nodes = {n: r.as_dict() for n, r in per_node.items()}
        job.cost = _sum_costs([r.cost for r in per_node.values()], steps=job.steps)
    return job


def _sum_costs(costs: list[Cost], *, steps: int | None) -> Cost:
    def total(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return sum(known) if known else None

    so_far = total([c.cost_so_far for c in costs])
    equivalent = total([c.on_demand_equivalent for c in costs])
    savings = (sum(c.savings for c in costs)  # type: ignore[misc]
               if costs and all(c.savings is not None for c in costs) else None)
    return Cost(
        cost_so_far=so_far,
        cost_per_1000_steps=so_far / steps * 1000 if so_far is not None and steps else None,
        on_demand_equivalent=equivalent,
        savings=savings,
        priced_sessions=sum(c.priced_sessions for c in costs),
        unpriced_sessions=sum(c.unpriced_sessions for c in costs),
    )


@dataclass
class _Session:
    """One session as the report sees it: its span, prices, restore, and where its steps stood."""

    placement: dict[str, Any] | None  # its ``placement`` event (zone, provisioning, boot time)
    price: float | None
    on_demand_price: float | None
    t0: float
    t1: float
    restored_step: int | None
    restore_s: float
    startup_s: float
    #: (step, productive seconds) where it stood, from its restore on.
    points: list[tuple[int, float]]
    blocked: float
    preempted: bool
    paused: bool
    finished: bool
    failed: bool
    #: Productive seconds whose steps survived (no later restore went back before them).
    kept: float = 0.0

    @classmethod
    def of(cls, evs: list[dict[str, Any]]) -> _Session:
        """The session of ``evs`` (its events, in order)."""
        start = next((e for e in evs if e["event"] == SessionStarted.kind), None)
        first = min(float(e["t"]) for e in evs)
        t0 = min(float(start["started"]), first) if start else first
        t1 = max(float(e["t"]) for e in evs)
        restore = next((e for e in evs if e["event"] == Restored.kind), None)
        start_step = int(restore["step"]) if restore else 0
        points = [(start_step, 0.0)]
        for e in evs:
            if e["event"] in _PROGRESS and "productive_s" in e:
                points.append((int(e["step"]), float(e["productive_s"])))
        kinds = {e["event"] for e in evs}
        return cls(
            placement=next((e for e in evs if e["event"] == CapacityWait.kind), None),
            price=_price(start, "price_per_hour"),
            on_demand_price=_price(start, "on_demand_price_per_hour"),
            t0=t0,
            t1=t1,
            restored_step=start_step if restore else None,
            restore_s=float(restore["seconds"]) if restore else 0.0,
            startup_s=float(restore["startup_s"]) if restore else t1 - t0,
            points=points,
            blocked=sum(float(e.get("blocked_s", 0.0)) for e in evs if e["event"] in _BLOCKED),
            preempted=Notice.kind in kinds,
            paused=Paused.kind in kinds,
            finished=Finished.kind in kinds,
            failed=Failed.kind in kinds,
        )


def _report(events: list[dict[str, Any]], restores: list[tuple[float, int]] | None = None) -> Report:
    """The report over ``events``; ``restores`` ((time, step) of the job's restores) judge which
    work was lost, by default these sessions' own restores."""
    staging = [(float(e.get("started", e["t"])), float(e["t"]), int(e.get("downloaded_bytes") or 0))
               for e in events if e["event"] == STAGING]
    by_session: dict[str, list[dict[str, Any]]] = {}
    for ev in sorted(events, key=_key):
        if ev["event"] != STAGING:
            by_session.setdefault(str(ev["session"]), []).append(ev)
    sessions = sorted((_Session.of(evs) for evs in by_session.values()), key=lambda s: s.t0)
    staged_s, staged_bytes = _union([(a, b) for a, b, _ in staging]), sum(n for _, _, n in staging)
    if not sessions:
        wall = max((b for _, b, _ in staging), default=0.0) - min((a for a, _, _ in staging), default=0.0)
        return Report(0.0, wall, 0.0, 0.0, 0.0, 0.0, 0.0, max(0.0, wall - staged_s), 0, 0, 0, 0, False,
                      staging_s=staged_s, staging_bytes=staged_bytes)
    productive = lost = 0.0
    for i, s in enumerate(sessions):
        if restores is None:
            later = [x.restored_step for x in sessions[i + 1:] if x.restored_step is not None]
        else:
            later = [step for t, step in restores if t > s.t1]
        done = s.points[-1][1]
        s.kept = _productive_at(s.points, min(later)) if later else done
        lost += done - s.kept
        productive += s.kept
    # Staging runs before a session starts: the job's wall time begins with the first of either.
    wall = max([s.t1 for s in sessions] + [b for _, b, _ in staging]) - \
        min([sessions[0].t0] + [a for a, _, _ in staging])
    spans = sum(s.t1 - s.t0 for s in sessions) + staged_s
    waited = _capacity_wait(sessions)
    return Report(
        goodput=productive / wall if wall > 0 else 0.0,
        wall_s=wall,
        productive_s=productive,
        startup_s=sum(s.startup_s for s in sessions),
        restore_s=sum(s.restore_s for s in sessions),
        checkpoint_blocked_s=sum(s.blocked for s in sessions),
        lost_s=lost,
        downtime_s=max(0.0, wall - spans),
        preemptions=sum(1 for s in sessions if s.preempted),
        crashes=sum(1 for s in sessions[:-1] if not (s.preempted or s.paused or s.finished or s.failed)),
        failures=sum(1 for s in sessions if s.failed),
        sessions=len(sessions),
        finished=sessions[-1].finished,
        cost=_cost(sessions, _reached(sessions)),
        steps=_reached(sessions),
        capacity_wait_s=sum(waited.values()),
        capacity_wait=waited,
        staging_s=staged_s,
        staging_bytes=staged_bytes,
    )


def _union(spans: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end] spans (nodes staging side by side count once)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _capacity_wait(sessions: list[_Session]) -> dict[str, float]:
    """Seconds between a session's end and the boot of the VM that ran the next one, by the
    zone/provisioning model of that VM. A session restarted on the same VM (booted before the
    previous session ended) waited for nothing; a session without a placement is not counted."""
    out: dict[str, float] = {}
    for prev, s in zip(sessions, sessions[1:]):
        where = s.placement
        boot = where.get("boot_time") if where else None
        if where is None or not isinstance(boot, (int, float)) or isinstance(boot, bool):
            continue
        waited = min(max(0.0, float(boot) - prev.t1), max(0.0, s.t0 - prev.t1))
        if waited > 0:
            key = f"{where.get('zone') or '?'}/{where.get('provisioning') or '?'}"
            out[key] = out.get(key, 0.0) + waited
    return out


def _reached(sessions: list[_Session]) -> int:
    # Steps completed: where the newest session that got as far as a restore stands (a session
    # that failed during start-up reached no step at all).
    reached = [s for s in sessions if s.restored_step is not None or len(s.points) > 1]
    return reached[-1].points[-1][0] if reached else 0


def _cost(sessions: list[_Session], steps: int) -> Cost:
    priced = [(s, s.price) for s in sessions if s.price is not None]
    on_demand = [(s, s.on_demand_price) for s in sessions if s.on_demand_price is not None]
    so_far = sum((s.t1 - s.t0) / 3600 * price for s, price in priced) if priced else None
    equivalent = sum(s.kept / 3600 * price for s, price in on_demand) if on_demand else None
    complete = len(priced) == len(on_demand) == len(sessions)
    return Cost(
        cost_so_far=so_far,
        cost_per_1000_steps=so_far / steps * 1000 if so_far is not None and steps > 0 else None,
        on_demand_equivalent=equivalent,
        savings=equivalent - so_far if complete and so_far is not None and equivalent is not None else None,
        priced_sessions=len(priced),
        unpriced_sessions=len(sessions) - len(priced),
    )

