"""Who may write a job: one trainer per run dir, one writer per GCS prefix.

Two trainers on one job (a duplicated VM, a second deploy on the same bucket prefix, a human
starting one by hand) would collide in their saves and double the ledger. Two mechanisms:

* ``RunDirLock``: an exclusive ``flock`` on ``RUN_DIR/.trainer.lock``, held for the process's
  life (the kernel drops it when the process dies, however it dies). The file names the holder
  (pid, host, start time); a second trainer on the same run dir exits 2 naming it.
* ``Lease``: the writer lease on the GCS prefix, one object ``<prefix>/lease.json`` written only
  with generation preconditions: created with ``ifGenerationMatch=0``, renewed every ``ttl/4``
  with ``ifGenerationMatch=<its generation>``, deleted (same precondition) on exit. Every GCS
  write of the trainer (checkpoint uploads, retention, the ledger mirror) first asks
  ``Lease.check`` (``GcsStore.guard``), so a trainer without the lease writes nothing there.

The holder is named by host and run dir (a job under torchrun: its rendezvous id, as every rank 0
it may have speaks for the same job). A trainer that finds the lease:

* absent, or its own (a restart on the same VM, or the group's replacement of it, which keeps the
  instance name): takes it at once;
* another's, not renewed for ``ttl`` (by Cloud Storage's clock, or unchanged for ``ttl`` while
  watched): takes it over (the holder died without releasing it);
* another's and renewed while watched (twice, so that a last renewal of a dying holder does not
  count): a live trainer writes the job; exits 2 naming it (a human must choose).

While it waits for an unrenewed lease to expire (at most ``ttl``: default 120 s, shorter than a
replacement VM takes to boot, so a preempted VM that died mid-save rarely delays the next one) the
health check answers ``ok waiting``. A holder that cannot renew for ``0.75 x ttl`` (Cloud Storage
unreachable) stops writing until a renewal succeeds; one that finds its lease taken (a 412 that
is not its own lost answer) has lost it: it stops writing at once and the trainer stops (exit 2).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from trainer import retry, untrusted
from trainer.checkpoint.stores import GcsStore, UploadAborted, is_unreachable
from trainer.checkpoint.tier_wait import TierUnknown

LOCK_FILE = ".trainer.lock"
LEASE_KEY = "lease.json"
DEFAULT_TTL_S = 120.0


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# ------------------------------------------------------------------------------------- run dir


class RunDirBusy(Exception):
    """Another trainer holds the run dir (bad input: exit 2)."""


class RunDirLock:
    """The exclusive lock on a run dir, held until ``release()`` or the process ends."""

    def __init__(self, run_dir: Path, log: logging.Logger | None = None):
        self.path = Path(run_dir) / LOCK_FILE
        self.log = log or logging.getLogger("trainer.lease")
        self._fd: int | None = None

    def acquire(self, started: float) -> "RunDirLock":
        """Take the lock or raise ``RunDirBusy`` naming the holder. A run dir that cannot hold a
        lock file (read-only) is locked through the directory itself."""
        run_dir = self.path.parent
        with contextlib.suppress(OSError):
            run_dir.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            self.log.warning("event=run_dir_lock file=%s error=%r (locking the directory itself)", self.path, e)
            fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(self.path)
            os.close(fd)
            raise RunDirBusy(f"run_dir: {run_dir} is in use by another trainer ({holder}; lock {self.path}). "
                             "Two trainers on one run dir would overwrite each other's checkpoints: stop "
                             "that one, or give this one another --run-dir") from None
        self._fd = fd
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": _iso(started)}
        try:  # who holds it, for the next one's message; a full disk only loses the names
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        except OSError:
            pass
        return self

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing drops the flock
            self._fd = None


def _read_holder(path: Path) -> str:
    try:
        h = json.loads(path.read_text() or "{}")
        return f"pid {h['pid']} on host {h['host']}, started {h['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder not recorded"


# ------------------------------------------------------------------------------------- GCS lease


class LeaseHeld(Exception):
    """A live trainer holds the job's writer lease (bad input: exit 2)."""


class LeaseLost(UploadAborted):
    """This trainer may not write the job's prefix (no lease, lapsed or taken): nothing written."""


def holder_id(run_dir: Path) -> str:
    """Who this trainer is to the lease: the job's rendezvous under torchrun, else host:run dir."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id:
        return f"torchrun job {run_id}"
    from trainer.distributed import node_name

    return f"{node_name()}:{Path(run_dir).resolve()}"


def describe_holder(doc: dict[str, Any]) -> str:
    return (f"{doc.get('holder', '?')} (pid {doc.get('pid', '?')} on host {doc.get('host', '?')}, started "
            f"{doc.get('started', '?')}, renewed {doc.get('renewed', '?')})")


class Lease:
    """The writer lease on one GCS prefix (see the module docstring)."""

    def __init__(self, store: GcsStore, *, holder: str, started: float, ttl_s: float = DEFAULT_TTL_S,
                 log: logging.Logger | None = None, op_timeout_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time):
        self.store, self.holder, self.ttl_s = store, holder, ttl_s
        self.log = log or logging.getLogger("trainer.lease")
        self.op_timeout_s = op_timeout_s
        self.clock, self.wall = clock, wall
        self._me = {"holder": holder, "pid": os.getpid(), "host": socket.gethostname(), "started": _iso(started),
                    "ttl_s": ttl_s}
        self._gen: int | None = None
        self._nonce = ""
        self._renewed_at: float | None = None  # monotonic send time of the last write that landed
        self._lost: str | None = None           # who took it
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- state -----------------------------------------------------------------------------
    @property
    def held(self) -> bool:
        return self._gen is not None and self._lost is None

    @property
    def lost(self) -> str | None:
        """Who took the lease from this trainer, or None."""
        return self._lost

    def check(self) -> None:
        """The guard of every GCS write: raises ``LeaseLost`` unless this trainer may write now."""
        if self._lost is not None:
            raise LeaseLost(f"the job's writer lease was taken by {self._lost}: this trainer writes "
                            "nothing more to GCS")
        if self._gen is None:
            raise LeaseLost("this trainer does not hold the job's writer lease")
        renewed = self._renewed_at
        if renewed is None or self.clock() - renewed > 0.75 * self.ttl_s:
            raise LeaseLost(f"the writer lease has not been renewed for {self.clock() - (renewed or 0):.0f} s "
                            f"(ttl {self.ttl_s:g} s): not writing until a renewal succeeds")

    # -- Cloud Storage calls, each bounded ---------------------------------------------------
    @contextlib.contextmanager
    def _bounded(self, seconds: float | None = None) -> Any:
        with self.store.deadline(self.clock() + (seconds or self.op_timeout_s)):
            yield

    def _read(self) -> tuple[dict[str, Any], int, float | None] | None:
        try:
            with self._bounded():
                got = self.store.read_versioned(LEASE_KEY)
        except Exception as e:
            if is_unreachable(e):
                raise TierUnknown({"gcs": f"writer lease: {type(e).__name__}: {e}"}) from e
            raise
        if got is None:
            return None
        data, gen, updated = got
        try:
            doc = untrusted.loads(data, limit=untrusted.SMALL_MAX_BYTES, what="the lease")
            if not isinstance(doc, dict):
                raise ValueError("not an object")
        except ValueError:  # untrusted.Garbage too: never a crash, a holder that must expire
            doc = {"holder": f"unreadable lease object {self.store.location(LEASE_KEY)}"}
        return doc, gen, updated

    def _write(self, generation: int, seconds: float | None = None) -> bool:
        """Write our lease document if the object is at ``generation``; True when it landed
        (also when a retry after our own lost answer met our own write)."""
        from google.api_core import exceptions as gexc

        nonce = uuid.uuid4().hex
        doc = dict(self._me, renewed=_iso(self.wall()), nonce=nonce)
        sent = self.clock()
        try:
            with self._bounded(seconds):
                gen = self.store.write_if_generation(LEASE_KEY, json.dumps(doc).encode(), generation)
        except gexc.PreconditionFailed:
            cur = self._read()
            if cur is None or cur[0].get("nonce") != nonce:
                return False
            gen = cur[1]  # our write landed; its answer was lost
        with self._lock:
            self._gen, self._nonce, self._renewed_at = gen, nonce, sent
        return True

    # -- acquire, renew, release -------------------------------------------------------------
    def acquire(self, *, sleep: Callable[[float], bool], on_wait: Callable[[str], None]) -> None:
        """Take the lease (see the module docstring). Raises ``LeaseHeld`` for a live holder,
        ``TierUnknown`` when Cloud Storage does not answer, and ``InterruptedError`` when
        ``sleep`` reports a preemption notice."""
        watched: tuple[int, float] | None = None  # (generation, monotonic first seen)
        renewals = 0
        while True:
            cur = self._read()
            if cur is None:
                if self._write(0):
                    self.log.info("event=lease_acquired holder=%s object=%s ttl_s=%g", self.holder,
                                  self.store.location(LEASE_KEY), self.ttl_s)
                    return
                continue  # someone created it meanwhile: look again
            doc, gen, updated = cur
            now = self.clock()
            if watched is not None and watched[0] != gen:
                renewals += 1
                watched = (gen, now)
            elif watched is None:
                watched = (gen, now)
            ttl = _ttl(doc, self.ttl_s)
            stale_by_gcs = updated is not None and self.wall() - updated > ttl
            stale_watched = now - watched[1] > ttl
            if doc.get("holder") == self.holder or stale_by_gcs or stale_watched:
                if self._write(gen):
                    how = "own" if doc.get("holder") == self.holder else "expired"
                    self.log.info("event=lease_acquired holder=%s object=%s took_over=%s previous=%s",
                                  self.holder, self.store.location(LEASE_KEY), how, describe_holder(doc))
                    return
                continue
            if renewals >= 2:
                raise LeaseHeld(
                    f"another trainer is writing this job: the writer lease {self.store.location(LEASE_KEY)} is "
                    f"held and renewed by {describe_holder(doc)}. Two trainers on one job would collide: stop "
                    "that one (or give this one another gcs_uri)")
            left = ttl - (now - watched[1])
            if updated is not None:
                left = min(left, ttl - (self.wall() - updated))
            left = max(0.0, left)
            # The health answer first: whoever reads the line below may ask it at once.
            on_wait(f"for the writer lease held by {doc.get('holder', '?')} (expires in {left:.0f}s)")
            self.log.warning("event=waiting_for_lease holder=%s expires_in_s=%.0f (taking it over if it is "
                             "not renewed)", describe_holder(doc), left)
            if sleep(min(max(0.2, left), max(0.5, ttl / 8))):
                raise InterruptedError("a preemption notice came while waiting for the writer lease")

    def start(self) -> "Lease":
        """Renew in the background every ``ttl/4`` until ``release()``."""
        self._thread = threading.Thread(target=self._renew_loop, name="lease-renew", daemon=True)
        self._thread.start()
        return self

    def _renew_loop(self) -> None:
        interval = self.ttl_s / 4
        # After a failed renewal, sooner: 2 s, doubling back to the interval (no jitter: one
        # holder, nobody to collide with, and every wait stays inside the lease's margin).
        again = retry.Backoff(retry.Policy(first_s=2.0, cap_s=interval, jitter=0.0))
        failures = 0
        while not self._stop.wait(interval if failures == 0 else again.next()):
            gen = self._gen
            if self._lost is not None or gen is None:
                return
            try:
                ok = self._write(gen, seconds=interval)
            except Exception as e:  # noqa: BLE001 - unreachable: retried; check() stops writes meanwhile
                failures += 1
                self.log.warning("event=lease_renew ok=0 error=%r (writes to GCS stop %.0f s after the last "
                                 "renewal)", e, 0.75 * self.ttl_s)
                continue
            failures = 0
            again.reset()
            if not ok:
                try:
                    cur = self._read()
                except Exception:  # noqa: BLE001
                    cur = None
                taker = describe_holder(cur[0]) if cur is not None else "someone (the lease object is gone)"
                self._lost = taker
                self.log.error("event=lease_lost taker=%s (this trainer writes nothing more to GCS)", taker)
                return

    def release(self, timeout: float = 10.0) -> None:
        """Stop renewing and delete the lease object if it is still ours (best effort)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        gen = self._gen
        if gen is None or self._lost is not None:
            return
        try:
            with self._bounded(max(0.5, timeout)):
                gone = self.store.delete_if_generation(LEASE_KEY, gen)
            self.log.info("event=lease_released ok=%d", int(gone))
        except Exception as e:  # noqa: BLE001 - it expires by itself
            self.log.warning("event=lease_released ok=0 error=%r (it expires after %g s)", e, self.ttl_s)
        self._gen = None


class FollowerLease:
    """What ranks other than 0 consult: rank 0 holds the job's lease and tells them (at start-up,
    then through the per-step flags) whether they may write."""

    def __init__(self) -> None:
        self.granted = False
        self._lost: str | None = None

    @property
    def lost(self) -> str | None:
        return self._lost

    def lose(self, taker: str) -> None:
        self._lost = taker

    def check(self) -> None:
        if self._lost is not None:
            raise LeaseLost(f"the job's writer lease was taken by {self._lost}")
        if not self.granted:
            raise LeaseLost("rank 0 holds no writer lease for the job")

    def release(self, timeout: float = 0.0) -> None:
        self.granted = False


def _ttl(doc: dict[str, Any], default: float) -> float:
    v = doc.get("ttl_s")
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 86400 else default
