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

Each trainer process is its own incarnation (a random id in the lease document): a second trainer
named like the first (every torchrun job of a pool has the experiment's rendezvous id) is still
another writer. The holder's name (host and run dir, and the rendezvous id under torchrun) is for
humans. A trainer that finds the lease:

* absent, or its predecessor's (the run dir records which incarnation took the lease on which
  boot; a trainer that holds the run dir's lock on that same boot knows that incarnation is dead,
  since the kernel drops the lock only when its holder ends): takes it at once;
* another's, not renewed for ``ttl``: takes it over (the holder died without releasing it). The
  lease's age is judged by Cloud Storage's clock only: the lease's ``updated`` against the
  ``updated`` the store gives ``lease-clock.json`` as the taker overwrites it, then counted on by
  the taker's monotonic clock. A VM whose wall clock is wrong cannot take a live lease;
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
import stat
import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from trainer import retry, untrusted
from trainer.checkpoint.stores import TMP_PREFIX, GcsStore, UploadAborted, is_unreachable
from trainer.checkpoint.tier_wait import TierUnknown

LOCK_FILE = ".trainer.lock"
LEASE_KEY = "lease.json"
#: Overwritten by a trainer waiting for the lease: the ``updated`` Cloud Storage gives it is the
#: store's clock now, against which the lease's own ``updated`` is judged.
CLOCK_KEY = "lease-clock.json"
#: In the run dir: which lease (object and incarnation) this run dir's trainer took, on which boot.
LEASE_RECORD = ".trainer.lease"
RECORD_MAX_BYTES = 4096
DEFAULT_TTL_S = 120.0
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


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
    """Who this trainer is to a human reading the lease: host and run dir, and under torchrun the
    job's rendezvous id too. A name only: which trainer holds the lease is its ``incarnation``."""
    from trainer.distributed import node_name

    where = f"{node_name()}:{Path(run_dir).resolve()}"
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    return f"torchrun job {run_id} on {where}" if run_id else where


def describe_holder(doc: dict[str, Any]) -> str:
    """Who a lease document says holds it, for a log line or a message: one quoted word
    (``untrusted.shown``), since whoever can write the bucket wrote every part of it."""
    return untrusted.shown(f"{doc.get('holder', '?')} (pid {doc.get('pid', '?')} on host {doc.get('host', '?')}, "
                           f"started {doc.get('started', '?')}, renewed {doc.get('renewed', '?')})")


def boot_id() -> str | None:
    """This machine's boot (the kernel's random id, new at every boot), or None."""
    try:
        return BOOT_ID.read_text().strip() or None
    except OSError:
        return None


def read_record(path: Path) -> dict[str, Any] | None:
    """The run dir's lease record, or None (absent, not a regular file, unreadable, garbage)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = os.read(fd, RECORD_MAX_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        doc = untrusted.loads(data, limit=RECORD_MAX_BYTES, what=str(path))
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


class Lease:
    """The writer lease on one GCS prefix (see the module docstring)."""

    def __init__(self, store: GcsStore, *, holder: str, started: float, ttl_s: float = DEFAULT_TTL_S,
                 log: logging.Logger | None = None, op_timeout_s: float = 60.0, record: Path | None = None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time):
        """``record``: the run dir's lease record, given only by a trainer that holds the run
        dir's lock. ``wall`` only stamps the document for humans: no decision reads it."""
        self.store, self.holder, self.ttl_s = store, holder, ttl_s
        self.log = log or logging.getLogger("trainer.lease")
        self.op_timeout_s = op_timeout_s
        self.record = record
        self.clock, self.wall = clock, wall
        self.incarnation = uuid.uuid4().hex  # this process, and nobody else
        self._me = {"holder": holder, "incarnation": self.incarnation, "pid": os.getpid(),
                    "host": socket.gethostname(), "started": _iso(started), "ttl_s": ttl_s}
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
                raise TierUnknown({self.store.name: f"writer lease: {type(e).__name__}: {e}"}) from e
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
    def _store_now(self) -> tuple[float | None, float]:
        """Cloud Storage's clock now (None: its answer had none), and this process's monotonic
        clock once it answered."""
        try:
            with self._bounded():
                stamp = self.store.stamp(CLOCK_KEY, json.dumps(self._me).encode())
        except Exception as e:
            if is_unreachable(e):
                raise TierUnknown({self.store.name: f"writer lease: {type(e).__name__}: {e}"}) from e
            raise
        return stamp, self.clock()

    def _predecessor(self) -> str | None:
        """The incarnation that held this lease from this run dir on this boot, if any: it is
        dead (this process holds the run dir's lock, which the kernel drops only when its holder
        ends). A copy of the disk on another machine has another boot, so it is nobody's."""
        doc = read_record(self.record) if self.record is not None else None
        boot = boot_id()
        if doc is None or boot is None or doc.get("boot") != boot or \
                doc.get("lease") != self.store.location(LEASE_KEY):
            return None
        inc = doc.get("incarnation")
        return inc if isinstance(inc, str) and inc else None

    def _remember(self) -> None:
        """Record in the run dir that this incarnation holds the lease (atomically; a record that
        cannot be written only costs a successor the wait for the lease to expire)."""
        if self.record is None:
            return
        doc = {"lease": self.store.location(LEASE_KEY), "incarnation": self.incarnation, "boot": boot_id()}
        # A leftover of a crash here is cleaned with the run dir's other temporaries.
        tmp = self.record.with_name(f"{TMP_PREFIX}{self.record.name}-{self.incarnation[:8]}")
        try:
            tmp.write_text(json.dumps(doc) + "\n")
            os.replace(tmp, self.record)
        except OSError as e:
            self.log.warning("event=lease_record ok=0 file=%s error=%r (a restart here waits for the lease to "
                             "expire)", self.record, e)
            with contextlib.suppress(OSError):
                tmp.unlink()

    def acquire(self, *, sleep: Callable[[float], bool], on_wait: Callable[[str], None]) -> None:
        """Take the lease (see the module docstring). Raises ``LeaseHeld`` for a live holder,
        ``TierUnknown`` when Cloud Storage does not answer, and ``InterruptedError`` when
        ``sleep`` reports a preemption notice."""
        predecessor = self._predecessor()
        # (generation, q): the lease has been at that generation since monotonic time q at the
        # latest, so its age at t is at least t - q. First seen: its age by Cloud Storage's clock
        # (the lease's `updated` against the store's now), then counted on by the monotonic clock.
        quiet: tuple[int, float] | None = None
        renewals = 0
        while True:
            cur = self._read()
            if cur is None:
                if self._write(0):
                    self.log.info("event=lease_acquired holder=%s object=%s ttl_s=%g", self.holder,
                                  self.store.location(LEASE_KEY), self.ttl_s)
                    self._remember()
                    return
                continue  # someone created it meanwhile: look again
            doc, gen, updated = cur
            inc = doc.get("incarnation")
            own = isinstance(inc, str) and inc != "" and inc in (self.incarnation, predecessor)
            if quiet is None or quiet[0] != gen:
                if quiet is not None:
                    renewals += 1
                since = self.clock()
                if not own and updated is not None:
                    stamp, answered = self._store_now()
                    if stamp is not None:
                        since = min(since, answered - (stamp - updated))
                quiet = (gen, since)
            ttl = _ttl(doc, self.ttl_s)
            age = self.clock() - quiet[1]
            if own or age > ttl:
                if self._write(gen):
                    self.log.info("event=lease_acquired holder=%s object=%s took_over=%s previous=%s",
                                  self.holder, self.store.location(LEASE_KEY), "own" if own else "expired",
                                  describe_holder(doc))
                    self._remember()
                    return
                continue
            if renewals >= 2:
                raise LeaseHeld(
                    f"another trainer is writing this job: the writer lease {self.store.location(LEASE_KEY)} is "
                    f"held and renewed by {describe_holder(doc)}. Two trainers on one job would collide: stop "
                    "that one (or give this one another gcs_uri)")
            left = max(0.0, ttl - age)
            # The health answer first: whoever reads the line below may ask it at once.
            on_wait(f"for the writer lease held by {untrusted.shown(doc.get('holder', '?'))} (expires in {left:.0f}s)")
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
                self.log.warning("event=lease_renew ok=0 error=%s (writes to GCS stop %.0f s after the last "
                                 "renewal)", untrusted.shown(f"{type(e).__name__}: {e}"), 0.75 * self.ttl_s)
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
