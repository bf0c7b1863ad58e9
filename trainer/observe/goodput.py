"""The goodput ledger and its report.

Every session (process start) appends events to ``RUN_DIR/goodput/ledger.jsonl`` (one JSON object
per line, fsynced; a line torn by SIGKILL is skipped on read) and mirrors each event to the durable
tier as its own immutable object ``goodput/<session>/<seq>.json``. A session that finds events in
GCS its run dir lacks (the disk was lost) copies them back, so the report covers the whole job;
that recovery runs on the mirror's thread, bounded, never in the way of start-up.

The ledger is best-effort: it measures the run and must never stop it. A write that fails (a
full or read-only run dir, GCS unreachable) is logged and counted, and the event still goes to
the other copy; the counts are recorded as ``ledger_error`` events (``where``: ``local`` or
``mirror``, ``count`` so far), at counts 1, 2, 4, 8..., so that ``status`` shows them. An event
that is malformed (not an object; ``session``, ``seq``, ``event`` or ``t`` missing or of the
wrong type; a field the report reads that is not a number) is skipped with a warning, wherever it
is read: the local file, the mirror, ``report()``.

Report (all sessions together), after ml-goodput-measurement:
- ``wall_s``: first session start to the last event seen;
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

import json
import logging
import math
import os
import queue
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

LEDGER_DIR = "goodput"
LEDGER_FILE = "ledger.jsonl"
#: The recovery from the durable tier gives up after this long (it runs in the background).
RECOVER_TIMEOUT_S = 120.0

_log = logging.getLogger("trainer.goodput")


def new_session_id() -> str:
    # Sortable by start time; unique across hosts.
    return f"{int(time.time() * 1000):013d}-{uuid.uuid4().hex[:8]}"


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _integer(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


#: Fields the report reads as numbers; ``step`` must be an integer. Where present (and not null,
#: which a few optional ones may be) they must be numbers; these events must have them.
_NUMERIC = ("t", "started", "seconds", "startup_s", "productive_s", "blocked_s", "boot_time", "step",
            "downloaded_bytes")
_REQUIRED = {"session_start": ("started",), "restore": ("step", "seconds", "startup_s")}
_NULLABLE = {"boot_time", "downloaded_bytes"}


def problem(ev: Any) -> str | None:
    """Why ``ev`` is not a usable ledger event, or None when it is."""
    if not isinstance(ev, dict):
        return f"not an object ({type(ev).__name__})"
    for k in ("session", "seq", "event", "t"):
        if k not in ev:
            return f"no {k!r}"
    if not isinstance(ev["session"], str) or not ev["session"]:
        return "'session' is not a string"
    if not _integer(ev["seq"]) or ev["seq"] < 0:
        return f"'seq' is not a whole number ({ev['seq']!r})"
    if not isinstance(ev["event"], str):
        return "'event' is not a string"
    for k in _REQUIRED.get(ev["event"], ()):
        if k not in ev:
            return f"{ev['event']} without {k!r}"
    if "productive_s" in ev and "step" not in ev:
        return "'productive_s' without 'step'"
    for k in _NUMERIC:
        if k not in ev or (ev[k] is None and k in _NULLABLE):
            continue
        if not (_integer(ev[k]) if k == "step" else _number(ev[k])):
            return f"{k!r} is not {'a whole number' if k == 'step' else 'a number'} ({ev[k]!r:.40})"
    return None


def usable(events: list[Any], where: str, skipped: list[str] | None = None,
           log: logging.Logger | None = None) -> list[dict[str, Any]]:
    """The events of ``events`` that ``problem`` accepts; each other one is logged (``where``
    says from where) and, with ``skipped``, noted there."""
    out = []
    for i, ev in enumerate(events):
        why = problem(ev)
        if why is None:
            out.append(ev)
            continue
        note = f"{where} #{i}: {why}"
        (log or _log).warning("event=ledger_skip %s (malformed goodput event skipped)", note)
        if skipped is not None:
            skipped.append(note)
    return out


def read_events(path: Path, *, skipped: list[str] | None = None) -> list[dict[str, Any]]:
    """Events of a ledger file; a torn or garbled line (SIGKILL mid-write) is skipped silently, a
    malformed event with a warning (and noted in ``skipped``)."""
    try:
        raw = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as e:
        _log.warning("event=ledger_read ok=0 path=%s error=%r", path, e)
        return []
    parsed = []
    for line in raw.split(b"\n"):
        if not line.strip():
            continue
        try:
            parsed.append(json.loads(line))
        except ValueError:
            continue
    return usable(parsed, str(path), skipped)


def _parse_object_key(key: str) -> tuple[str, int] | None:
    parts = key.rsplit("/", 2)
    if len(parts) < 3 or not parts[2].endswith(".json"):
        return None
    try:
        return parts[1], int(parts[2][: -len(".json")])
    except ValueError:
        return None


def read_store_events(store: Any, *, skip: set[tuple[str, int]] | frozenset = frozenset(),
                      skipped: list[str] | None = None, deadline: float | None = None) -> list[dict[str, Any]]:
    """Events mirrored on the durable tier, except those whose (session, seq) is in ``skip``:
    one listing, then only the missing objects are fetched (in parallel), each giving up at
    ``deadline`` (time.monotonic). A malformed object is skipped with a warning."""
    bounded = getattr(store, "deadline", None) if deadline is not None else None
    with bounded(deadline) if bounded else _nothing():
        keys = store.list(LEDGER_DIR + "/")
    wanted = []
    for key in keys:
        k = _parse_object_key(key)
        if k is not None and k not in skip:
            wanted.append(key)

    def fetch(key: str) -> tuple[str, Any]:
        try:
            with bounded(deadline) if bounded else _nothing():
                return key, json.loads(store.get_bytes(key))
        except (KeyError, ValueError):
            return key, None

    with ThreadPoolExecutor(max_workers=16) as pool:
        got = list(pool.map(fetch, wanted))
    out = []
    for key, ev in got:
        if ev is None:
            continue
        why = problem(ev)
        if why is None and _parse_object_key(key) != (ev["session"], ev["seq"]):
            why = "its session/seq differ from its name"
        if why is None:
            out.append(ev)
            continue
        note = f"{_location(store, key)}: {why}"
        _log.warning("event=ledger_skip %s (malformed goodput event skipped)", note)
        if skipped is not None:
            skipped.append(note)
    return out


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None


def _location(store: Any, key: str) -> str:
    loc = getattr(store, "location", None)
    return loc(key) if callable(loc) else key


def _key(ev: dict[str, Any]) -> tuple[str, int]:
    return (str(ev["session"]), int(ev["seq"]))


def _object_key(ev: dict[str, Any]) -> str:
    return f"{LEDGER_DIR}/{ev['session']}/{int(ev['seq']):06d}.json"


def merge(*sources: list[dict[str, Any]]) -> list[dict[str, Any]]:
    seen: dict[tuple[str, int], dict[str, Any]] = {}
    for events in sources:
        for ev in events:
            if problem(ev) is None:
                seen.setdefault(_key(ev), ev)
    return [seen[k] for k in sorted(seen)]


def _report_counts(n: int) -> bool:
    """Record the n-th error of a kind as an event: 1, 2, 4, 8, ... (bounded noise)."""
    return n > 0 and n & (n - 1) == 0


class Ledger:
    """This session's writer: one per node (its local rank 0). Never raises from a write."""

    def __init__(self, run_dir: Path, *, store: Any | None = None, session: str | None = None,
                 log: logging.Logger | None = None):
        self.path = run_dir / LEDGER_DIR / LEDGER_FILE
        self.store: Any | None = None
        self.session = session or new_session_id()
        self.log = log or _log
        self._seq = 0
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._torn = False  # a write failed midway: start the next one on a fresh line
        self._closed = False
        #: Failed writes so far, by where they failed (the local file, the mirror).
        self.errors: dict[str, int] = {"local": 0, "mirror": 0}
        self.last_error: str | None = None
        self._mine: list[dict[str, Any]] = []  # this session's events until the mirror starts
        self._mirror: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._recovered = threading.Event()
        self._open()
        if store is not None:
            self.mirror_to(store)

    # -- the local file ---------------------------------------------------------------------
    def _open(self) -> bool:
        """Open the local file (again, after a failure); False when it cannot be."""
        if self._fd is not None:
            return True
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        except OSError as e:
            self._failed("local", e)
            return False
        self._fd = fd
        # A line torn by SIGKILL must not swallow the next event: start on a fresh line.
        try:
            if os.fstat(fd).st_size:
                with open(self.path, "rb") as f:
                    f.seek(-1, os.SEEK_END)
                    self._torn = f.read(1) != b"\n"
        except OSError:
            self._torn = True
        return True

    def _write_line(self, ev: dict[str, Any]) -> bool:
        """Append one event to the local file (caller holds the lock); False when it failed."""
        if self._closed or not self._open():
            return False
        line = (json.dumps(ev, sort_keys=True) + "\n").encode()
        try:
            os.write(self._fd, (b"\n" + line) if self._torn else line)  # type: ignore[arg-type]
            os.fsync(self._fd)  # type: ignore[arg-type]
        except OSError as e:
            self._torn = True
            self._failed("local", e)
            return False
        self._torn = False
        return True

    def _failed(self, where: str, e: BaseException) -> None:
        """Count a failed write; log and record it at counts 1, 2, 4, ... (never raises)."""
        self.errors[where] += 1
        n = self.errors[where]
        self.last_error = f"{where}: {type(e).__name__}: {e}"
        if not _report_counts(n):
            return
        other = "the mirror" if where == "local" else "the run dir"
        self.log.warning("event=ledger_error where=%s count=%d error=%r (training goes on; the event is kept "
                         "in %s where it can be)", where, n, e, other)
        ev = {"session": self.session, "seq": self._seq, "t": time.time(), "event": "ledger_error",
              "where": where, "count": n, "error": f"{type(e).__name__}: {e}"[:300]}
        self._seq += 1
        if where == "mirror":  # the run dir keeps it (if it can), without recursing
            if self._fd is not None and not self._closed:
                try:
                    os.write(self._fd, (json.dumps(ev, sort_keys=True) + "\n").encode())
                except OSError:
                    pass
        else:
            self._send(ev)

    # -- appending --------------------------------------------------------------------------
    def append(self, event: str, **fields: Any) -> None:
        """Record one event; never raises (see the module docstring)."""
        try:
            with self._lock:
                ev = {"session": self.session, "seq": self._seq, "t": time.time(), "event": event, **fields}
                self._seq += 1
                self._write_line(ev)
                self._send(ev)
        except Exception as e:  # noqa: BLE001 - the ledger measures the run, it never stops it
            self.log.warning("event=ledger_error where=append error=%r", e)

    def _send(self, ev: dict[str, Any]) -> None:
        if self._thread is not None:
            self._mirror.put(ev)
        else:
            self._mine.append(ev)

    # -- the mirror -------------------------------------------------------------------------
    def mirror_to(self, store: Any) -> None:
        """Start mirroring to ``store`` (once this trainer may write it): in the background,
        first recover what only the store has, then send what it lacks, then follow appends."""
        with self._lock:
            if self._thread is not None:
                return
            self.store = store
            for ev in self._mine:
                self._mirror.put(ev)
            self._mine = []
            self._thread = threading.Thread(target=self._mirror_loop, name="ledger-mirror", daemon=True)
            self._thread.start()

    def _recover_from_store(self) -> None:
        """Copy events only the durable tier has (lost run dir) into the local file; queue the
        local events the durable tier lacks (a mirror cut short by a kill). Bounded; best effort."""
        local = read_events(self.path)
        local_keys = {_key(e) for e in local}
        deadline = time.monotonic() + RECOVER_TIMEOUT_S
        try:
            with self.store.deadline(deadline) if hasattr(self.store, "deadline") else _nothing():
                remote_keys = {k for k in map(_parse_object_key, self.store.list(LEDGER_DIR + "/")) if k}
            missing_here = read_store_events(self.store, skip=local_keys, deadline=deadline)
        except Exception as e:  # noqa: BLE001 - the durable tier being down must not stop training
            self.log.warning("event=ledger_recover ok=0 error=%r", e)
            return
        with self._lock:
            for ev in sorted(missing_here, key=_key):
                self._write_line(ev)
        for ev in local:
            if _key(ev) not in remote_keys and ev["session"] != self.session:
                self._mirror.put(ev)
        if missing_here:
            self.log.info("event=ledger_recover events=%d from=gcs", len(missing_here))

    def _mirror_loop(self) -> None:
        try:
            self._recover_from_store()
        finally:
            self._recovered.set()
        while True:
            ev = self._mirror.get()
            try:
                if ev is None:
                    return
                try:
                    self.store.put_bytes(_object_key(ev), json.dumps(ev, sort_keys=True).encode())
                except Exception as e:  # noqa: BLE001 - best effort: the local ledger is the record
                    with self._lock:
                        self._failed("mirror", e)
            finally:
                self._mirror.task_done()

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the mirror to catch up; True if it did."""
        if self._thread is None:
            return True
        deadline = time.monotonic() + max(0.0, timeout)
        self._recovered.wait(max(0.0, timeout))
        while self._mirror.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return self._recovered.is_set() and not self._mirror.unfinished_tasks

    def close(self, timeout: float = 10.0) -> bool:
        """Close the file; wait up to ``timeout`` s for the mirror. True if nothing is pending."""
        done = self.flush(timeout)
        if self._thread is not None:
            self._mirror.put(None)
        with self._lock:
            self._closed = True
            if self._fd is not None:
                try:
                    os.close(self._fd)
                except OSError:
                    pass
                self._fd = None
        return done


def node_name() -> str:
    """This VM's name in the ledger: ``SPOTTRAIN_NODE`` if set, else the host name."""
    return os.environ.get("SPOTTRAIN_NODE") or socket.gethostname()


def session_start_fields(process_start_wall: float, *, price_per_hour: float | None = None,
                         on_demand_price_per_hour: float | None = None, main: bool = True,
                         world_size: int = 1) -> dict[str, Any]:
    """The ``session_start`` event: when the process started, where, and the hourly prices this
    session runs at (None: unknown). Prices are per session because they may change between restarts.
    ``main``: this session is the job's rank 0 (the one that speaks for the job)."""
    return {"started": process_start_wall, "pid": os.getpid(), "host": socket.gethostname(),
            "node": node_name(), "main": main, "world_size": world_size,
            "price_per_hour": price_per_hour, "on_demand_price_per_hour": on_demand_price_per_hour}


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
    events = usable(events, "report")
    job = _job_report(events)
    job.skipped_events = given - len(events)
    job.ledger_errors = _ledger_errors(events)
    return job


def _ledger_errors(events: list[dict[str, Any]]) -> dict[str, int]:
    """The largest ``count`` of each session's ``ledger_error`` events, by ``where``, summed."""
    most: dict[tuple[str, str], int] = {}
    for e in events:
        if e["event"] == "ledger_error" and _integer(e.get("count")):
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
        start = next((e for e in evs if e["event"] in ("session_start", "staging")), None) or {}
        node_of[sid] = str(start.get("node") or start.get("host") or "?")
        if start.get("main", True) is not False:
            main_sessions.add(sid)
    job = _report([e for e in events if str(e["session"]) in main_sessions])
    nodes = sorted(set(node_of.values()))
    if len(nodes) > 1 or len(main_sessions) < len(by_session):
        # A node's work counts as lost when the job later restored from an earlier step, whichever
        # node that restore ran on: judge every node against the job's restores.
        restores = [(float(e["t"]), int(e["step"])) for e in events
                    if e["event"] == "restore" and str(e["session"]) in main_sessions]
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


def _report(events: list[dict[str, Any]], restores: list[tuple[float, int]] | None = None) -> Report:
    """The report over ``events``; ``restores`` ((time, step) of the job's restores) judge which
    work was lost, by default these sessions' own restores."""
    staging = [(float(e.get("started", e["t"])), float(e["t"]), int(e.get("downloaded_bytes") or 0))
               for e in events if e["event"] == "staging"]
    by_session: dict[str, list[dict[str, Any]]] = {}
    for ev in sorted(events, key=_key):
        if ev["event"] != "staging":
            by_session.setdefault(str(ev["session"]), []).append(ev)
    sessions = []
    for sid, evs in by_session.items():
        start = next((e for e in evs if e["event"] == "session_start"), None)
        t0 = float(start["started"]) if start else float(evs[0]["t"])
        restore = next((e for e in evs if e["event"] == "restore"), None)
        where = next((e for e in evs if e["event"] == "placement"), None)
        start_step = int(restore["step"]) if restore else 0
        points = [(start_step, 0.0)]
        for e in evs:
            if e["event"] in ("progress", "checkpoint", "finish", "preempted", "paused") and "productive_s" in e:
                points.append((int(e["step"]), float(e["productive_s"])))
        sessions.append({
            "placement": where,
            "price": _price(start, "price_per_hour"),
            "on_demand_price": _price(start, "on_demand_price_per_hour"),
            "t0": t0,
            "t1": max(float(e["t"]) for e in evs),
            "restored_step": start_step if restore else None,
            "restore_s": float(restore["seconds"]) if restore else 0.0,
            "startup_s": float(restore["startup_s"]) if restore else max(float(e["t"]) for e in evs) - t0,
            "points": points,
            "blocked": sum(float(e.get("blocked_s", 0.0)) for e in evs
                           if e["event"] in ("checkpoint", "preempted", "finish", "paused")),
            "preempted": any(e["event"] == "preemption_notice" for e in evs),
            "paused": any(e["event"] == "paused" for e in evs),
            "finished": any(e["event"] == "finish" for e in evs),
            "failed": any(e["event"] == "failed" for e in evs),
        })
    sessions.sort(key=lambda s: s["t0"])
    staged_s, staged_bytes = _union([(a, b) for a, b, _ in staging]), sum(n for _, _, n in staging)
    if not sessions:
        wall = max((b for _, b, _ in staging), default=0.0) - min((a for a, _, _ in staging), default=0.0)
        return Report(0.0, wall, 0.0, 0.0, 0.0, 0.0, 0.0, max(0.0, wall - staged_s), 0, 0, 0, 0, False,
                      staging_s=staged_s, staging_bytes=staged_bytes)
    productive = lost = 0.0
    for i, s in enumerate(sessions):
        if restores is None:
            later = [x["restored_step"] for x in sessions[i + 1:] if x["restored_step"] is not None]
        else:
            later = [step for t, step in restores if t > s["t1"]]
        done = s["points"][-1][1]
        s["kept"] = _productive_at(s["points"], min(later)) if later else done
        lost += done - s["kept"]
        productive += s["kept"]
    # Staging runs before a session starts: the job's wall time begins with the first of either.
    wall = max([s["t1"] for s in sessions] + [b for _, b, _ in staging]) - \
        min([sessions[0]["t0"]] + [a for a, _, _ in staging])
    spans = sum(s["t1"] - s["t0"] for s in sessions) + staged_s
    waited = _capacity_wait(sessions)
    return Report(
        goodput=productive / wall if wall > 0 else 0.0,
        wall_s=wall,
        productive_s=productive,
        startup_s=sum(s["startup_s"] for s in sessions),
        restore_s=sum(s["restore_s"] for s in sessions),
        checkpoint_blocked_s=sum(s["blocked"] for s in sessions),
        lost_s=lost,
        downtime_s=max(0.0, wall - spans),
        preemptions=sum(1 for s in sessions if s["preempted"]),
        crashes=sum(1 for s in sessions[:-1] if not (s["preempted"] or s["paused"] or s["finished"] or s["failed"])),
        failures=sum(1 for s in sessions if s["failed"]),
        sessions=len(sessions),
        finished=sessions[-1]["finished"],
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


def _capacity_wait(sessions: list[dict[str, Any]]) -> dict[str, float]:
    """Seconds between a session's end and the boot of the VM that ran the next one, by the
    zone/provisioning model of that VM. A session restarted on the same VM (booted before the
    previous session ended) waited for nothing; a session without a placement is not counted."""
    out: dict[str, float] = {}
    for prev, s in zip(sessions, sessions[1:]):
        where = s["placement"]
        boot = where.get("boot_time") if where else None
        if not isinstance(boot, (int, float)) or isinstance(boot, bool):
            continue
        waited = min(max(0.0, float(boot) - prev["t1"]), max(0.0, s["t0"] - prev["t1"]))
        if waited > 0:
            key = f"{where.get('zone') or '?'}/{where.get('provisioning') or '?'}"
            out[key] = out.get(key, 0.0) + waited
    return out


def _reached(sessions: list[dict[str, Any]]) -> int:
    # Steps completed: where the newest session that got as far as a restore stands (a session
    # that failed during start-up reached no step at all).
    reached = [s for s in sessions if s["restored_step"] is not None or len(s["points"]) > 1]
    return reached[-1]["points"][-1][0] if reached else 0


def _cost(sessions: list[dict[str, Any]], steps: int) -> Cost:
    priced = [s for s in sessions if s["price"] is not None]
    on_demand = [s for s in sessions if s["on_demand_price"] is not None]
    so_far = sum((s["t1"] - s["t0"]) / 3600 * s["price"] for s in priced) if priced else None
    equivalent = sum(s["kept"] / 3600 * s["on_demand_price"] for s in on_demand) if on_demand else None
    complete = len(priced) == len(on_demand) == len(sessions)
    return Cost(
        cost_so_far=so_far,
        cost_per_1000_steps=so_far / steps * 1000 if so_far is not None and steps > 0 else None,
        on_demand_equivalent=equivalent,
        savings=equivalent - so_far if complete and so_far is not None and equivalent is not None else None,
        priced_sessions=len(priced),
        unpriced_sessions=len(sessions) - len(priced),
    )
