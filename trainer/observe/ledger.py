"""The goodput ledger: every session's events, in the run dir and mirrored to the remote tier.

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

Two clocks stamp each event: ``t``, the wall clock, places it (which day, which session came
first); ``e``, seconds since the ledger was opened on ``time.monotonic`` (which NTP steps and a
mis-set clock never move), measures it. The report takes every
duration within a session from ``e``, so a clock step mid-session moves the session, never
stretches it (ledgers written before ``e`` existed are read by ``t``).

The report over these events is ``trainer.observe.goodput``; the ledger sink
(``trainer.observe.sinks.ledger``) writes the run's events here.
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
from pathlib import Path
from typing import Any, Callable

from trainer import untrusted
from trainer.distributed import node_name
from trainer.observe.events import LEDGER_ERROR, RENAMED, Restored, SessionStarted

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
_NUMERIC = ("t", "e", "started", "seconds", "startup_s", "productive_s", "blocked_s", "boot_time", "step",
            "downloaded_bytes")
_REQUIRED = {SessionStarted.kind: ("started",), Restored.kind: ("step", "seconds", "startup_s")}
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


def current(ev: dict[str, Any]) -> dict[str, Any]:
    """``ev`` under the name its event has now (``events.RENAMED``: a ledger written before a
    rename says ``finish`` where a newer one says ``finished``)."""
    now = RENAMED.get(ev["event"])
    return ev if now is None else dict(ev, event=now)


def usable(events: list[Any], where: str, skipped: list[str] | None = None,
           log: logging.Logger | None = None) -> list[dict[str, Any]]:
    """The events of ``events`` that ``problem`` accepts, each under its current name; each other
    one is logged (``where`` says from where) and, with ``skipped``, noted there."""
    out = []
    for i, ev in enumerate(events):
        why = problem(ev)
        if why is None:
            out.append(current(ev))
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
            parsed.append(untrusted.loads(line, limit=untrusted.SMALL_MAX_BYTES, what="ledger line"))
        except untrusted.Garbage:
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
                return key, untrusted.loads(store.get_bytes(key), limit=untrusted.SMALL_MAX_BYTES, what="ledger event")
        except (KeyError, untrusted.Garbage):
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
            out.append(current(ev))
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
                 log: logging.Logger | None = None, wall: Callable[[], float] = time.time,
                 clock: Callable[[], float] = time.monotonic):
        self.path = run_dir / LEDGER_DIR / LEDGER_FILE
        #: ``t`` (places an event) and ``e`` (measures it): see the module docstring.
        self.wall, self.clock = wall, clock
        self._opened = clock()
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
        ev = {"session": self.session, "seq": self._seq, "t": self.wall(), "e": self._elapsed(), "event": LEDGER_ERROR,
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

    def _elapsed(self) -> float:
        return round(self.clock() - self._opened, 6)

    # -- appending --------------------------------------------------------------------------
    def append(self, event: str, **fields: Any) -> None:
        """Record one event; never raises (see the module docstring)."""
        try:
            with self._lock:
                ev = {"session": self.session, "seq": self._seq, "t": self.wall(), "e": self._elapsed(), "event": event,
                      **fields}
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
            self._thread = threading.Thread(target=self._mirror_loop, args=(store,), name="ledger-mirror",
                                            daemon=True)
            self._thread.start()

    def _recover_from_store(self, store: Any) -> None:
        """Copy events only the durable tier has (lost run dir) into the local file; queue the
        local events the durable tier lacks (a mirror cut short by a kill). Bounded; best effort."""
        local = read_events(self.path)
        local_keys = {_key(e) for e in local}
        deadline = time.monotonic() + RECOVER_TIMEOUT_S
        try:
            with store.deadline(deadline) if hasattr(store, "deadline") else _nothing():
                remote_keys = {k for k in map(_parse_object_key, store.list(LEDGER_DIR + "/")) if k}
            missing_here = read_store_events(store, skip=local_keys, deadline=deadline)
        except Exception as e:  # noqa: BLE001 - the durable tier being down must not stop training
            self.log.warning("event=ledger_recover ok=0 error=%r", e)
            return
        with self._lock:
            for ev in sorted(missing_here, key=_key):
                # Marked: as trustworthy as the bucket, not as this disk (trainer.loop.rollback).
                self._write_line({**ev, "recovered": True})
        for ev in local:
            if _key(ev) not in remote_keys and ev["session"] != self.session:
                self._mirror.put(ev)
        if missing_here:
            self.log.info("event=ledger_recover events=%d from=%s", len(missing_here), store.name)

    def _mirror_loop(self, store: Any) -> None:
        try:
            self._recover_from_store(store)
        finally:
            self._recovered.set()
        while True:
            ev = self._mirror.get()
            try:
                if ev is None:
                    return
                try:
                    store.put_bytes(_object_key(ev), json.dumps(ev, sort_keys=True).encode())
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


def session_start_fields(process_start_wall: float, *, price_per_hour: float | None = None,
                         on_demand_price_per_hour: float | None = None, main: bool = True,
                         world_size: int = 1) -> dict[str, Any]:
    """The ``session_start`` event: when the process started, where, and the hourly prices this
    session runs at (None: unknown). Prices are per session because they may change between restarts.
    ``main``: this session is the job's rank 0 (the one that speaks for the job)."""
    return {"started": process_start_wall, "pid": os.getpid(), "host": socket.gethostname(),
            "node": node_name(), "main": main, "world_size": world_size,
            "price_per_hour": price_per_hour, "on_demand_price_per_hour": on_demand_price_per_hour}

