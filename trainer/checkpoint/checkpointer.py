"""The ``Checkpointer``: when to save, where to, in the background; what to restore from; when a
checkpoint counts as durable.

Tiers, fastest first: ``local`` (a local-SSD dir, optional; lost with the VM), ``persistent``
(the run dir on the stateful PD; survives preemption and repair in the same zone) and ``gcs``
(optional; survives everything, including a restart in another zone with a fresh disk). The
*durable* tiers are ``persistent`` and ``gcs``: they outlive the VM. The local SSD is a cache.

Saving (CheckFreq's snapshot/persist split), every tier failing on its own:

* ``save()`` blocks the loop only while the state is copied into a host buffer (pinned when CUDA
  is involved) and its plain Python objects are pickled; that is the time it returns.
* The *disk writer* (a thread per save) then writes the due disk tiers straight from the buffer
  (``checkpoint.write_dir``: temporary folder, fsync, manifest last, atomic rename). It never
  touches the network.
* The *uploader* (one long-lived thread) uploads a save that GCS is due for: from its committed
  disk folder (persistent, else local), which frees the buffer for the next save at once; or,
  when no disk tier could take the save (a full or read-only disk), straight from the host buffer
  (``checkpoint.upload_snapshot``), which that upload then owns until it ends. Then it applies
  GCS retention. Every request it makes is bounded (``GcsStore.request_timeout_s``) and each
  upload has its own abort flag, checked between requests and chunks.
* One disk write at a time: ``due()`` answers False while the disk writer runs (the due tier
  stays due and is saved at the first step after it finished; counted in
  ``stats["deferred_steps"]``). An upload never holds a disk save back: while one is in flight,
  the next save's upload waits in a queue of one, where a newer save's replaces it (only the
  newest matters). An explicit ``save()`` while the disk writer runs waits for it (counted in
  ``stats["waited"]``): the caller asked for that exact step to be saved.
* Host memory: at most two buffers while training. The second is allocated only while an upload
  from memory holds the first; a queued upload from memory is dropped when its buffer is needed,
  and ``due()`` answers False when neither buffer is free. An explicit save (final, pause,
  emergency) never waits for the network: it takes another buffer if both are held by uploads.
* Background failures (disk full, GCS unreachable after retries) are logged and counted; they never
  raise into the loop and never leave anything a restore would choose. A tier whose writes keep
  failing is reported by ``failing()`` (the health answer, the ledger, ``status``) until one
  succeeds.

Durable: ``durable(step, deadline=...)`` waits for the saves in flight (until the deadline) and
reads ``step`` back from every durable tier: its manifest parses and checks out, and every file it
lists is there with the listed size. The final checkpoint and a pause's count only then.

Restoring: the newest checkpoint that verifies (manifest self-check and HMAC under the run's key,
sizes, sha256 of every file) across all tiers, preferring the fastest tier for equal steps. A GCS
checkpoint newer than anything on disk is downloaded into the persistent tier (atomically) and
loaded from there; when the run dir cannot take it (full, read-only) through a temporary folder
instead, and when nothing can, the run dir is unknown (start-up waits): a disk's failure never
makes a checkpoint unusable. Any invalid candidate is logged with the reason and the next older one is
tried. A tier that cannot be listed or read is unknown, not empty: a trainer's restore raises
``TierUnknown`` rather than choose without it (``trainer.checkpoint.tier_wait`` waits); ``status``
(``download=False``) only notes it. What is never a reason to fall back or start afresh (a
``ResumeMismatch``, exit 2, nothing deleted): a checkpoint that verified but cannot be decoded,
checkpoints of the other layout or another format version, and unauthenticated checkpoints when
nothing authentic is left.

Same step twice: a save that finds a folder of its step already on a tier keeps it when the same
session wrote it (the manifest's ``writer``: same session and step, same state), replaces it
atomically when it holds other state (an abandoned trajectory: the live run is the one a restart
must continue) or is invalid, and never touches a kept one (unauthenticated, another format or
layout): that tier then skips this step.
A process's own state at a step is also what the checkpoint it restored from holds: after a
restore, copies of that step by its writer are kept too (a re-run of a finished job writes only
the copies that are missing).

Emergency (``emergency_save``, on a preemption notice): it never waits on the network. It drops
the queued upload and aborts the one in flight, leaving its thread behind; waits only for a disk
writer still running (disk I/O); writes the local SSD and the persistent disk at the same time from
the buffer; then uploads to GCS from the persistent copy (else the local one, else host memory)
until the deadline. *Saved* means on a tier that outlives the VM (persistent or GCS): a save only
the local SSD got serves a restart of the trainer on this VM (systemd, a reboot) but is lost with
the VM (a preemption, a recreation), so it does not count as saved.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import shutil
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from trainer.checkpoint.format import (OTHER_FORMAT, OTHER_LAYOUT, CheckpointInfo, CheckpointInvalid,
                                CheckpointUnloadable, Snapshot, SnapshotBuffer, StepOccupied, check_checkpoint,
                                delete_checkpoint, download_dir, kept, kept_mismatch, layout_mismatch,
                                list_checkpoints, load_dir, other_layout, parse_manifest, read_manifest, step_name,
                                upload_dir, upload_snapshot, verify_dir, write_dir)
from trainer.checkpoint.key import CheckpointKey
from trainer.checkpoint.interval import DEFAULT_MTBF_S, YoungDalyPolicy, changed_materially
from trainer.checkpoint.stores import DirStore, GcsStore, Store, UploadAborted, is_unreachable
from trainer.checkpoint.tier_wait import TierUnknown

TIERS = ("local", "persistent", "gcs")
#: The tiers that outlive the VM: a checkpoint on one of them is saved.
DURABLE_TIERS = ("persistent", "gcs")
#: Buffers a training run keeps at most (see the module docstring).
MAX_BUFFERS = 2


class _CannotStore(Exception):
    """A download that the folder it goes to cannot take (full, read-only, failing): the disk's
    problem, not the checkpoint's."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


@dataclasses.dataclass(frozen=True)
class TierPolicy:
    """When to save to one tier and how many checkpoints to keep there."""

    every_steps: int | None = None      # save every K steps
    every_seconds: float | None = None  # and/or every T seconds
    keep: int = 3                       # retention: last K valid checkpoints on this tier
    # both None => automatic (Young/Daly from measured cost and mtbf_s)

    def __post_init__(self) -> None:
        if self.every_steps is not None and (not isinstance(self.every_steps, int) or self.every_steps < 1):
            raise ValueError(f"every_steps must be a positive integer, got {self.every_steps!r}")
        if self.every_seconds is not None and not self.every_seconds > 0:
            raise ValueError(f"every_seconds must be > 0, got {self.every_seconds!r}")
        if not isinstance(self.keep, int) or self.keep < 1:
            raise ValueError(f"keep must be an integer >= 1, got {self.keep!r}")

    @property
    def automatic(self) -> bool:
        return self.every_steps is None and self.every_seconds is None


@dataclasses.dataclass
class Restored:
    step: int
    state: dict          # exactly what was passed to save(), tensors on CPU
    tier: str            # where it was read from
    path: str            # folder/URI, for logs
    seconds: float       # restore wall time


@dataclasses.dataclass
class EmergencyReport:
    step: int
    persistent_ok: bool
    gcs_ok: bool | None   # None when no GCS tier
    seconds: float        # notice -> durable
    detail: str           # one human line: what was saved and what was not
    local_ok: bool | None = None  # None when no local tier (or not attempted)
    complete: bool = False  # on every durable tier this run has (a final checkpoint then counts)

    @property
    def saved(self) -> bool:
        """On a tier that outlives the VM (see the module docstring)."""
        return self.persistent_ok or bool(self.gcs_ok)


@dataclasses.dataclass
class Durability:
    """``durable()``'s verdict: each durable tier with ``"ok"`` or why ``step`` is not there."""

    step: int
    tiers: dict[str, str]

    @property
    def ok(self) -> bool:
        return bool(self.tiers) and all(v == "ok" for v in self.tiers.values())

    @property
    def missing(self) -> list[str]:
        return [k for k, v in self.tiers.items() if v != "ok"]

    @property
    def detail(self) -> str:
        return "; ".join(f"{k} {'ok' if v == 'ok' else 'NOT DURABLE: ' + v}" for k, v in self.tiers.items())


@dataclasses.dataclass
class _Tier:
    name: str
    store: Store
    policy: TierPolicy
    auto: YoungDalyPolicy | None
    last_step: int = 0
    last_time: float | None = None
    logged_interval: float | None = None

    @property
    def is_disk(self) -> bool:
        return isinstance(self.store, DirStore)


@dataclasses.dataclass(eq=False)
class _Upload:
    """One upload the uploader owes: a committed folder, or a snapshot still in host memory."""

    step: int
    folder: Path | None = None            # a committed copy (or a staged one, see cleanup)
    tier: str | None = None               # the disk tier holding ``folder`` (kept from retention)
    snap: Snapshot | None = None          # else the host snapshot ...
    buffer: SnapshotBuffer | None = None  # ... whose buffer this upload owns until it ends
    manifest: bytes | None = None         # sharded layouts: the manifest to commit
    collective: bool = False              # sharded across nodes: every rank uploads its part
    cleanup: Callable[[], None] | None = None  # run once the upload ended (a staging folder)
    abort: threading.Event = dataclasses.field(default_factory=threading.Event)
    deadline: float | None = None


class Checkpointer:
    """Asynchronous multi-tier checkpointing; see the module docstring."""

    #: This checkpointer's layout: how its listings and retention read a manifest.
    parse_manifest = staticmethod(parse_manifest)

    def __init__(self, *, run_dir: Path, local_dir: Path | None = None, gcs_uri: str | None = None,
                 policies: dict[str, TierPolicy] | None = None,
                 mtbf_s: float = DEFAULT_MTBF_S, log: logging.Logger | None = None,
                 gcs_client: Any = None, key: CheckpointKey | None = None) -> None:
        """``key``: sign every manifest and load only checkpoints whose HMAC verifies under it
        (``trainer.checkpoint.key``); None trusts the sha256 alone (nothing is unpickled either
        way, but anyone who can write a tier can then make a checkpoint this run loads)."""
        self.log = log or logging.getLogger("spottrain.checkpoint")
        self.key = key
        #: This checkpointer's saves, in manifests as ``writer``: a save id (see the module docstring).
        self.session = uuid.uuid4().hex
        #: Kept checkpoints the last survey met that are not of the other layout: "format" and
        #: "unauthenticated" lines (the restore decides what they block).
        self._survey_kept: dict[str, list[str]] = {"format": [], "unauthenticated": []}
        policies = dict(policies or {})
        unknown = set(policies) - set(TIERS)
        if unknown:
            raise ValueError(f"unknown checkpoint tier(s) {sorted(unknown)}; expected {list(TIERS)}")
        self.run_dir = Path(run_dir)
        stores: list[Store] = []
        if local_dir is not None:
            stores.append(DirStore(Path(local_dir), "local"))
        stores.append(DirStore(self.run_dir, "persistent"))
        if gcs_uri:
            stores.append(GcsStore(gcs_uri, client=gcs_client))
        self._tiers: dict[str, _Tier] = {}
        for st in stores:
            pol = policies.get(st.name, TierPolicy())
            auto = YoungDalyPolicy(mtbf_s=mtbf_s) if pol.automatic else None
            self._tiers[st.name] = _Tier(st.name, st, pol, auto)
        self._buffer = SnapshotBuffer()  # the first buffer; see ``_acquire_buffer`` for the others
        self._buffers: list[SnapshotBuffer] = [self._buffer]
        self._held: set[int] = set()  # ids of buffers owned by uploads from memory
        self._thread: threading.Thread | None = None  # the disk writer of the newest save
        self._reserver: threading.Thread | None = None
        # The uploader: its thread, the upload it runs, the queue (one entry, or FIFO when
        # collective), and a condition over all of it and the buffers, pins and tier health.
        self._cv = threading.Condition(threading.RLock())
        self._uploader: threading.Thread | None = None
        self._active: _Upload | None = None
        self._pending: list[_Upload] = []
        self._closing = False
        self.abandoned = 0  # uploads left running on their thread (emergency, deadline)
        self._pins: dict[tuple[str, int], int] = {}  # (tier, step) folders an upload reads
        #: (tier, step) disk folders holding this process's state: it wrote them, or restored from them.
        self._verified: set[tuple[str, int]] = set()
        self._restored: dict[int, str] = {}  # step -> writer of the checkpoint this process restored
        self._failing: dict[str, dict[str, Any]] = {}
        #: Called with (tier, failure record or None when it works again) on each change; the
        #: session puts it into the goodput ledger. Must not raise (errors are logged).
        self.on_tier_health: Callable[[str, dict | None], None] | None = None
        # Retention never deletes while a restore runs: one lock per tier (retention on GCS, which
        # may sit in a stalled request, must never hold a disk tier's retention up), all of them
        # for a restore.
        self._tier_locks = {name: threading.Lock() for name in self._tiers}
        self._restore_lock = _Locks(list(self._tier_locks.values()))
        self._started = time.monotonic()
        #: Called with (tier, step) once a periodic save is durable on a tier (the goodput ledger's
        #: record of checkpoints per tier); it must not block.
        self.on_durable: Callable[[str, int], None] | None = None
        self.stats: dict[str, Any] = {
            "saves": 0, "tier_writes_ok": 0, "tier_writes_failed": 0, "deferred_steps": 0,
            "waited": 0, "blocked_s_total": 0.0, "last_blocked_s": None, "last_error": None,
            "uploads_superseded": 0,
        }

    # ------------------------------------------------------------------------------ properties
    @property
    def gcs(self) -> Store | None:
        t = self._tiers.get("gcs")
        return t.store if t else None

    @property
    def tiers(self) -> tuple[str, ...]:
        return tuple(self._tiers)

    def _busy(self) -> bool:
        """A disk writer is running (the uploader is not counted: it never holds saves back)."""
        return self._thread is not None and self._thread.is_alive()

    def uploading(self) -> bool:
        """An upload is running or queued."""
        with self._cv:
            return self._active is not None or bool(self._pending)

    def _durable_tiers(self) -> list[str]:
        """The tiers a checkpoint must be on to count as durable (see the module docstring)."""
        return [n for n in DURABLE_TIERS if n in self._tiers]

    # ------------------------------------------------------------------------------ scheduling
    def interval_s(self, tier: str) -> float | None:
        """The automatic interval currently in force for ``tier`` (None for fixed policies)."""
        t = self._tiers[tier]
        return t.auto.decide().seconds if t.auto else None

    def _tier_due(self, t: _Tier, step: int, now: float) -> bool:
        base = t.last_time if t.last_time is not None else self._started
        if t.auto is not None:
            d = t.auto.decide()
            if changed_materially(t.logged_interval, d.seconds):
                self.log.info("checkpoint interval for %s: %.0fs (%s)", t.name, d.seconds, d.reason)
                t.logged_interval = d.seconds
            return now - base >= d.seconds
        p = t.policy
        if p.every_steps is not None and step >= (t.last_step // p.every_steps + 1) * p.every_steps:
            return True
        return p.every_seconds is not None and now - base >= p.every_seconds

    def _due_tiers(self, step: int) -> list[str]:
        now = time.monotonic()
        return [n for n, t in self._tiers.items() if self._tier_due(t, step, now)]

    def due(self, step: int) -> bool:
        """Whether to call ``save(step, ...)`` now; cheap, call it every step.

        False while a disk write is in flight, or while both host buffers are held by uploads
        from memory (the due tier stays due and is saved once that is over).
        """
        if not self._due_tiers(step):
            return False
        if self._busy() or not self._buffer_free():
            self.stats["deferred_steps"] += 1
            return False
        return True

    # ------------------------------------------------------------------------------ buffers
    def _buffer_free(self) -> bool:
        with self._cv:
            return (any(id(b) not in self._held for b in self._buffers) or len(self._buffers) < MAX_BUFFERS
                    or any(j.buffer is not None for j in self._pending))

    def _acquire_buffer(self) -> SnapshotBuffer:
        """A buffer no upload owns (the disk writer is idle when this is called)."""
        with self._cv:
            free = [b for b in self._buffers if id(b) not in self._held]
            if not free:
                for job in [j for j in self._pending if j.buffer is not None][:1]:
                    self._pending.remove(job)
                    self._superseded(job, "its host buffer is needed by a newer save")
                free = [b for b in self._buffers if id(b) not in self._held]
            if free:
                return free[0]
            # A second buffer while an upload from memory holds the first; a third only for an
            # explicit save while both are held (it is dropped again when released).
            buf = SnapshotBuffer()
            self._buffers.append(buf)
            return buf

    def _release(self, job: _Upload) -> None:
        """The upload ``job`` ended (or never started): give back its buffer, pin and folder."""
        with self._cv:
            if job.buffer is not None:
                self._held.discard(id(job.buffer))
                if len(self._buffers) > MAX_BUFFERS and job.buffer is not self._buffer:
                    self._buffers = [b for b in self._buffers if b is not job.buffer]
                job.buffer = None
            job.snap = None
            if job.tier is not None:
                key = (job.tier, job.step)
                self._pins[key] -= 1
                if not self._pins[key]:
                    del self._pins[key]
                job.tier = None
            cleanup, job.cleanup = job.cleanup, None
            self._cv.notify_all()
        if cleanup is not None:
            try:
                cleanup()
            except Exception as e:  # noqa: BLE001 - a leftover staging folder is removed at restore
                self.log.warning("cleaning up after the upload of step %d failed: %s", job.step, e)

    def _pin(self, tier: str, step: int) -> None:
        with self._cv:
            self._pins[(tier, step)] = self._pins.get((tier, step), 0) + 1

    def _pinned(self, tier: str) -> set[int]:
        with self._cv:
            return {s for (t, s) in self._pins if t == tier}

    # ------------------------------------------------------------------------------ saving
    def save(self, step: int, state: dict, *, meta: dict | None = None, every_tier: bool = False) -> float:
        """Snapshot ``state`` and write it in the background; returns the seconds the caller was
        blocked. Saves to the tiers that are due, or to every tier when none is (explicit save)
        or when ``every_tier`` (the final checkpoint, a pause)."""
        t0 = time.perf_counter()
        meta = _check_meta(meta)
        if self._busy():
            self.stats["waited"] += 1
            self._thread.join()  # type: ignore[union-attr]
        names = list(self._tiers) if every_tier else (self._due_tiers(step) or list(self._tiers))
        if "gcs" in names and not any(self._tiers[n].is_disk for n in names):
            names.append("persistent")  # GCS uploads from the persistent folder (the buffer is freed)
        names = [n for n in TIERS if n in names]
        buffer = self._acquire_buffer()
        t_snap = time.perf_counter()
        snap = buffer.take(step, state, meta)
        # The cost C for the interval policy excludes the one-off buffer allocation.
        snap_s = time.perf_counter() - t_snap - buffer.last_alloc_s
        now = time.monotonic()
        for n in names:
            self._tiers[n].last_step, self._tiers[n].last_time = step, now
        self.stats["saves"] += 1
        self._thread = threading.Thread(target=self._persist, args=(snap, buffer, names, snap_s),
                                        name=f"checkpoint-{step}", daemon=True)
        self._thread.start()
        blocked = time.perf_counter() - t0
        self.stats["blocked_s_total"] += blocked
        self.stats["last_blocked_s"] = blocked
        return blocked

    def _persist(self, snap: Snapshot, buffer: SnapshotBuffer, names: list[str], snap_s: float) -> None:
        """The disk writer: the due disk tiers from the buffer, then hand the upload over; never
        raises, never touches the network."""
        try:
            for n in names:
                t = self._tiers[n]
                if t.auto is not None:
                    t.auto.observe(blocked_s=snap_s)
            written: dict[str, Path] = {}
            for n in names:
                t = self._tiers[n]
                if not t.is_disk:
                    continue
                t0 = time.monotonic()
                try:
                    written[n] = self._write_disk(t, snap)
                except Exception as e:  # noqa: BLE001 - background: log, count, carry on
                    self._failed(n, snap.step, e)
                    continue
                self._succeeded(t, snap.step, time.monotonic() - t0)
            if "gcs" in names:
                self._enqueue(self._upload_of(snap, buffer, written))
        except BaseException as e:  # noqa: BLE001 - a background thread must not die silently
            self._failed("?", snap.step, e)

    def _upload_of(self, snap: Snapshot, buffer: SnapshotBuffer, written: dict[str, Path]) -> _Upload:
        """The upload of a save: from its committed disk copy, else from the host buffer."""
        tier = next((n for n in ("persistent", "local") if n in written), None)
        if tier is not None:
            self._pin(tier, snap.step)
            return _Upload(snap.step, folder=written[tier], tier=tier)
        self.log.warning("checkpoint step %d: no disk tier took it; uploading it to gcs from host memory",
                         snap.step)
        with self._cv:
            self._held.add(id(buffer))
        return _Upload(snap.step, snap=snap, buffer=buffer)

    def _succeeded(self, t: _Tier, step: int, write_s: float) -> None:
        self.stats["tier_writes_ok"] += 1
        if t.auto is not None:
            t.auto.observe(write_s=write_s)
        self.log.info("checkpoint step %d durable on %s in %.2fs", step, t.name, write_s)
        self._note(t.name, None)
        if self.on_durable is not None:
            with contextlib.suppress(Exception):
                self.on_durable(t.name, step)
        try:
            self._retain(t, step)
        except Exception as e:  # noqa: BLE001
            self.log.warning("retention on %s failed (nothing lost): %s: %s", t.name, type(e).__name__, e)

    def _failed(self, tier: str, step: int, e: BaseException) -> None:
        self.stats["tier_writes_failed"] += 1
        self.stats["last_error"] = f"{tier} step {step}: {type(e).__name__}: {e}"
        self.log.error("checkpoint step %d on %s failed (training continues; nothing partial is "
                       "visible): %s: %s", step, tier, type(e).__name__, e)
        if tier in self._tiers:
            self._note(tier, f"{type(e).__name__}: {e}"[:300])

    def _note(self, tier: str, error: str | None) -> None:
        """Track whether ``tier`` keeps failing (``error`` None: it just worked)."""
        with self._cv:
            rec = self._failing.get(tier)
            if error is None:
                if rec is None:
                    return
                del self._failing[tier]
                changed: dict | None = None
                self.log.info("checkpoint tier %s works again (after %d failed write(s))", tier, rec["failures"])
            else:
                rec = self._failing.setdefault(tier, {"since": time.time(), "failures": 0})
                rec["failures"] += 1
                rec["error"] = " ".join(error.split())  # one line: it goes into the health answer
                changed = dict(rec)
        if self.on_tier_health is not None:
            try:
                self.on_tier_health(tier, changed)
            except Exception as e:  # noqa: BLE001 - reporting must never break a save
                self.log.warning("reporting the health of tier %s failed: %s", tier, e)

    def failing(self) -> dict[str, dict[str, Any]]:
        """Tiers whose latest writes failed: tier -> {since (unix time), failures, error}."""
        with self._cv:
            return {k: dict(v) for k, v in self._failing.items()}

    def _write_disk(self, t: _Tier, snap: Snapshot) -> Path:
        store = t.store
        assert isinstance(store, DirStore)
        folder = store.root / step_name(snap.step)
        replace = folder.exists()
        if replace and ((t.name, snap.step) in self._verified or self._keep_same_step(t.name, folder, snap.step)):
            return folder
        folder, _ = write_dir(snap, store.root, key=self.key, writer=self.session, replace=replace)
        self._verified.add((t.name, snap.step))
        return folder

    def _same_state(self, step: int, writer: str | None = None) -> set[str]:
        """The writers whose copy of ``step`` holds the state this process saves for it: this
        session, the one whose checkpoint of that step it restored, and ``writer``."""
        return {w for w in (self.session, self._restored.get(step), writer) if w}

    def _keep_same_step(self, tier: str, folder: Path, step: int, writer: str | None = None) -> bool:
        """A folder of this step is already on a disk tier (a save right after another of the same
        step, e.g. an emergency save of a step just saved, the final save of a re-run): True to
        keep it (written by ``_same_state``'s writers: the same state), False to replace it;
        StepOccupied when it is a kept checkpoint."""
        try:
            m = self._verify_folder(folder)
        except CheckpointInvalid as e:
            if kept(str(e)):
                raise StepOccupied(f"{folder} holds a checkpoint that is never overwritten ({e}); this tier "
                                   f"skips step {step}") from None
            self.log.warning("replacing invalid %s (%s)", folder, e)
            return False
        if m.get("writer") in self._same_state(step, writer):
            return True
        self.log.warning("%s step %d at %s verifies but holds other state (written by session %s, not this "
                         "one: an abandoned trajectory); replacing it atomically with this run's step %d",
                         tier, step, folder, m.get("writer", "unknown"), step)
        return False

    def _verify_folder(self, folder: Path) -> dict:
        """Full verification of a folder of this checkpointer's layout (the sharded one overrides)."""
        return verify_dir(folder, key=self.key)

    # ------------------------------------------------------------------------------ uploading
    def _enqueue(self, job: _Upload) -> None:
        """Queue ``job`` for the uploader: it replaces a queued one (FIFO when collective)."""
        with self._cv:
            if self._closing:
                self._superseded(job, "the checkpointer is closing")
                return
            if not job.collective:
                for old in self._pending:
                    self._superseded(old, f"step {job.step} is newer")
                self._pending = []
            self._pending.append(job)
            if self._uploader is None:
                self._uploader = threading.Thread(target=self._upload_loop, name="checkpoint-uploader", daemon=True)
                self._uploader.start()
            self._cv.notify_all()

    def _superseded(self, job: _Upload, why: str) -> None:
        self.stats["uploads_superseded"] += 1
        self.log.info("upload of step %d to gcs dropped: %s", job.step, why)
        self._release(job)

    def _upload_loop(self) -> None:
        me = threading.current_thread()
        while True:
            with self._cv:
                while not self._pending and self._uploader is me:
                    self._cv.wait()
                if self._uploader is not me:
                    return  # replaced: this thread's upload was abandoned
                job = self._active = self._pending.pop(0)
            try:
                self._run_upload(job)
            except BaseException as e:  # noqa: BLE001 - this thread must not die silently
                self._failed("gcs", job.step, e)
            finally:
                with self._cv:
                    if self._active is job:
                        self._active = None
                    self._release(job)

    def _run_upload(self, job: _Upload) -> None:
        t = self._tiers["gcs"]
        store = t.store
        assert isinstance(store, GcsStore)
        t0 = time.monotonic()
        with store.aborting(job.abort):  # retention too: an abandoned upload stops at its next request
            try:
                self._upload(t, job.folder if job.folder is not None else job.snap, job.step,
                             deadline=job.deadline, abort=job.abort)
            except Exception as e:  # noqa: BLE001
                self._failed("gcs", job.step, e)
            else:
                self._succeeded(t, job.step, time.monotonic() - t0)

    def _upload(self, t: _Tier, src: Path | Snapshot | None, step: int, *, deadline: float | None,
                abort: threading.Event | None = None) -> None:
        """Every checkpoint upload goes through here (the writer lease guards the store): ``src``
        is a committed folder, or a snapshot in host memory."""
        store = t.store
        assert isinstance(store, GcsStore) and src is not None
        with store.deadline(deadline), store.aborting(abort):
            info = check_checkpoint(store, step, self.parse_manifest, key=self.key)
            if info is not None:
                mine = (read_manifest(src, self.parse_manifest, key=self.key).get("writer")
                        if isinstance(src, Path) else None)
                if info.valid and (info.manifest or {}).get("writer") in self._same_state(step, mine):
                    return  # this very state is there already
                if kept(info.reason):
                    raise StepOccupied(f"gcs holds a checkpoint at step {step} that is never overwritten "
                                       f"({info.reason}); this tier skips step {step}")
                if info.valid:
                    self.log.warning("gcs step %d verifies but holds other state (written by session %s, not "
                                     "this one); replacing it with this run's", step,
                                     (info.manifest or {}).get("writer", "unknown"))
                else:
                    # A leftover partial upload of this step: its objects are create-only, so remove
                    # them first; they were never visible as a checkpoint.
                    self.log.info("removing partial upload of step %d on gcs (%s)", step, info.reason)
                delete_checkpoint(store, step)
            if isinstance(src, Snapshot):
                upload_snapshot(src, store, deadline=deadline, key=self.key, writer=self.session)
            else:
                upload_dir(src, store, step, deadline=deadline, parse=self.parse_manifest)

    def _stop_uploads(self, why: str) -> None:
        """Drop the queued uploads and abort the one in flight, without waiting for it: its thread
        is left to end by itself (at its next request, or when a request times out)."""
        with self._cv:
            for job in self._pending:
                self._superseded(job, why)
            self._pending = []
            job = self._active
            if job is not None:
                job.abort.set()
                self._active = None
                self._uploader = None  # a later upload gets a fresh thread
                self.abandoned += 1
                self.log.warning("upload of step %d to gcs abandoned: %s", job.step, why)
            self._cv.notify_all()

    # ------------------------------------------------------------------------------ durability
    def durable(self, step: int, *, deadline: float) -> Durability:
        """Wait for the saves in flight (at most until ``deadline``, time.monotonic), then read
        ``step`` back from every durable tier (see the module docstring). An upload still running
        at the deadline is aborted: it does not count."""
        if not self.wait(timeout=max(0.0, deadline - time.monotonic())):
            self._stop_uploads(f"step {step} was due durable by the deadline")
        return Durability(step, {n: self._check(n, step, deadline) for n in self._durable_tiers()})

    def _check(self, tier: str, step: int, deadline: float) -> str:
        t = self._tiers.get(tier)
        if t is None:
            return "not configured: no tier of this run can hold a complete copy"
        try:
            if isinstance(t.store, GcsStore):
                # After the deadline the check still gets a short while of its own.
                with t.store.deadline(max(deadline, time.monotonic() + 10.0)):
                    info = check_checkpoint(t.store, step, self.parse_manifest)
            else:
                info = check_checkpoint(t.store, step, self.parse_manifest)
        except Exception as e:  # noqa: BLE001 - the tier cannot be read: not durable as far as we know
            return f"cannot check it ({type(e).__name__}: {str(e)[:200]})"
        if info is None:
            return f"step {step} is not there"
        return "ok" if info.valid else info.reason

    # ------------------------------------------------------------------------------ retention
    def _retain(self, t: _Tier, newest_step: int) -> None:
        """Keep the checkpoint just written plus the newest ``keep - 1`` valid older ones.

        Only checkpoints older than the one just written (and verified while writing) are ever
        deleted. Newer folders are left alone: they may be valid checkpoints a restore skipped
        because of a transient error, or corrupt ones that look valid to the quick check (which
        must not make us delete the good checkpoint we just wrote). A folder an upload is reading
        is kept until that upload ended.
        """
        keep = t.policy.keep
        with self._tier_locks[t.name]:
            older = [i for i in list_checkpoints(t.store, self.parse_manifest, key=self.key) if i.step < newest_step]
            keep_older = {i.step for i in [x for x in older if x.valid][: keep - 1]}
            pinned = self._pinned(t.name)
            for i in older:
                # Kept ones are never deleted: an unauthenticated checkpoint may be this run's own
                # work under a lost or rotated key, and garbage in the bucket must never cost a
                # good checkpoint (retention counts only valid ones). Nor is a folder an upload reads.
                if i.step in keep_older or i.step in pinned or kept(i.reason):
                    continue
                self.log.info("retention: deleting %s step %d (%s)", t.name, i.step,
                              f"beyond the newest {keep} valid" if i.valid else f"invalid: {i.reason}")
                delete_checkpoint(t.store, i.step)
                self._verified.discard((t.name, i.step))

    # ------------------------------------------------------------------------------ restoring
    def newest_valid_step(self) -> int | None:
        """The newest step that passes the quick check (manifest, sizes) on any tier, or None.

        Cheap (listings only): in a multi-node job every node leader answers it, so that the node
        whose disk holds the newest checkpoint restores for everyone. Raises ``TierUnknown``
        when a tier cannot be listed.
        """
        candidates, _ = self._survey()
        return candidates[0][0] if candidates else None

    def _survey(self, *, tolerate_unknown: bool = False
                ) -> tuple[list[tuple[int, int, _Tier, CheckpointInfo]], list[str]]:
        """Every tier listed for a restore: the valid checkpoints as (step, tier rank, tier,
        info), newest first and fastest tier first for equal steps, and a line per checkpoint of
        the other layout. Invalid ones are logged with the reason. A tier that cannot be listed
        raises ``TierUnknown`` (after every tier was tried), or with ``tolerate_unknown`` (a
        read-only look) is logged and skipped."""
        candidates: list[tuple[int, int, _Tier, CheckpointInfo]] = []
        other: list[str] = []
        unknown: dict[str, str] = {}
        self._survey_kept = {"format": [], "unauthenticated": []}
        for rank, t in enumerate(self._tiers.values()):
            try:
                infos = self._list(t)
            except Exception as e:  # noqa: BLE001 - a tier being down: unknown, never empty
                self.log.warning("cannot list checkpoints on %s (%s: %s); what it holds is unknown",
                                 t.name, type(e).__name__, e)
                unknown[t.name] = f"{type(e).__name__}: {e}"
                continue
            for i in infos:
                if i.valid:
                    candidates.append((i.step, rank, t, i))
                elif other_layout(i.reason):
                    other.append(f"{t.name} step {i.step}: {i.reason[len(OTHER_LAYOUT):]}")
                elif kept(i.reason):
                    what = "format" if i.reason.startswith(OTHER_FORMAT) else "unauthenticated"
                    self._survey_kept[what].append(f"{t.name} step {i.step} at {i.location}: {i.reason}")
                    self.log.warning("refusing %s checkpoint step %d at %s: %s", t.name, i.step, i.location, i.reason)
                else:
                    self.log.warning("ignoring %s checkpoint step %d at %s: %s",
                                     t.name, i.step, i.location, i.reason)
        if unknown and not tolerate_unknown:
            raise TierUnknown(unknown)
        candidates.sort(key=lambda c: (-c[0], c[1]))
        return candidates, other

    def mark_restored(self, step: int) -> None:
        """Another node restored ``step`` for the job: count the tiers' intervals from there."""
        now = time.monotonic()
        for t in self._tiers.values():
            t.last_step, t.last_time = step, now

    def restore(self, *, download: bool = True, step: int | None = None) -> Restored | None:
        """Load the newest valid checkpoint across all tiers (see the module docstring), or the
        valid checkpoint of ``step`` (a read-only look at another run: ``download=False``)."""
        wanted = step
        t_start = time.monotonic()
        self.wait()  # outside the lock: the background thread takes it for retention
        with self._restore_lock:
            if download:
                for t in self._tiers.values():
                    if isinstance(t.store, DirStore):
                        removed = t.store.clean_temporaries()
                        if removed:
                            self.log.info("removed leftovers of interrupted writes on %s: %s",
                                          t.name, ", ".join(removed))
            from trainer.loop.state import ResumeMismatch

            candidates, other = self._survey(tolerate_unknown=not download)
            if other and download:  # a trainer starting; status (download=False) only looks
                raise ResumeMismatch(layout_mismatch("ddp", other))
            if self._survey_kept["format"] and download:
                raise ResumeMismatch(kept_mismatch(self._survey_kept["format"], None))
            for step, _, t, info in candidates:
                if wanted is not None and step != wanted:
                    continue
                try:
                    state, path, tier = self._load(t, step, info, download=download)
                except TierUnknown:
                    raise
                except CheckpointUnloadable as e:
                    raise ResumeMismatch(f"cannot resume from step {step} on {t.name} ({info.location}): {e}; "
                                         "use the spottrain version that wrote it, or a new --run-dir/--gcs-uri "
                                         "for a new run (nothing was deleted)") from None
                except (CheckpointInvalid, Exception) as e:  # noqa: BLE001
                    self.log.warning("checkpoint step %d on %s at %s is unusable: %s; falling back "
                                     "to the next older one", step, t.name, info.location,
                                     e if isinstance(e, CheckpointInvalid) else f"{type(e).__name__}: {e}")
                    continue
                if download:  # a trainer starting (download=False is a read-only look)
                    self._reserve_in_background(state)
                    if (info.manifest or {}).get("writer"):  # its copies hold this process's state
                        self._restored[step] = info.manifest["writer"]  # type: ignore[index]
                seconds = time.monotonic() - t_start
                self.log.info("restored step %d from %s (%s) in %.2fs", step, tier, path, seconds)
                now = time.monotonic()
                for x in self._tiers.values():
                    x.last_step, x.last_time = step, now
                return Restored(step=step, state=state, tier=tier, path=path, seconds=seconds)
            if self._survey_kept["unauthenticated"] and download:
                # Never a fresh start over them: they may be this run's work under a lost key.
                raise ResumeMismatch(kept_mismatch(self._survey_kept["unauthenticated"], self.key))
            self.log.info("no valid checkpoint on any tier; starting from scratch")
            return None

    def _reserve_in_background(self, state: Any) -> None:
        """Allocate the snapshot buffer while the loop starts, rather than during the first save
        (training time). Best effort: a failure only moves the cost to the first save."""
        buf = self._buffer

        def reserve() -> None:
            try:
                buf.reserve(state)
            except Exception as e:  # noqa: BLE001
                self.log.debug("snapshot buffer not reserved: %s", e)

        self._reserver = threading.Thread(target=reserve, name="checkpoint-reserve", daemon=True)
        self._reserver.start()

    #: Listing a tier gives up after this long (GCS unreachable at start-up must not stall the
    #: restore for the full upload retry budget; the disk tiers are still tried).
    LIST_TIMEOUT_S = 60.0

    def _list(self, t: _Tier) -> list[CheckpointInfo]:
        if isinstance(t.store, GcsStore):
            with t.store.deadline(time.monotonic() + self.LIST_TIMEOUT_S):
                return list_checkpoints(t.store, self.parse_manifest, key=self.key)
        return list_checkpoints(t.store, self.parse_manifest, key=self.key)

    def _load(self, t: _Tier, step: int, info: CheckpointInfo, *, download: bool) -> tuple[Any, str, str]:
        if isinstance(t.store, DirStore):
            folder = t.store.root / step_name(step)
            _, state = load_dir(folder, key=self.key)
            self._verified.add((t.name, step))
            return state, str(folder), t.name
        persistent = self._tiers["persistent"].store
        assert isinstance(persistent, DirStore)
        if download:
            stale = check_checkpoint(persistent, step, key=self.key)
            if stale is not None and kept(stale.reason):
                self.log.warning("the persistent tier's step %d is kept (%s): loading the GCS copy without "
                                 "storing it there", step, stale.reason)
                download = False
            elif stale is not None:
                # The persistent copy of this step failed verification (or it would have been
                # chosen first): replace it with the good one from GCS.
                self.log.warning("replacing invalid persistent copy of step %d with the GCS one", step)
                delete_checkpoint(persistent, step)
        if download:
            try:
                folder = self._download(t, step, persistent.root)
            except _CannotStore as e:  # a full or read-only run dir: load it from elsewhere all the same
                self.log.warning("the run dir cannot take the download of step %d (%s): loading it through a "
                                 "temporary folder; the run dir gets checkpoints again once it takes writes",
                                 step, e.error)
            else:
                self.log.info("downloaded step %d from %s into %s", step, info.location, folder)
                _, state = load_dir(folder, key=self.key)
                self._verified.add(("persistent", step))
                return state, info.location, t.name
        try:
            tmp = Path(tempfile.mkdtemp(prefix="spottrain-restore-"))
        except OSError as e:
            raise self._nowhere(step, e) from e
        try:
            try:
                folder = self._download(t, step, tmp)
            except _CannotStore as e:
                raise self._nowhere(step, e.error) from e
            _, state = load_dir(folder, key=self.key)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return state, info.location, t.name

    def _download(self, t: _Tier, step: int, root: Path) -> Path:
        """``download_dir``; a tier that stops answering midway is unknown, and a folder that cannot
        take the files is ``_CannotStore`` (the checkpoint is not thereby invalid: never fall back
        to an older one for either)."""
        try:
            return download_dir(t.store, step, root, key=self.key)
        except Exception as e:
            if is_unreachable(e):
                raise TierUnknown({t.name: f"{type(e).__name__}: {e}"}) from e
            if isinstance(e, OSError):  # writing the files here failed (ENOSPC, EROFS, EIO, ...)
                raise _CannotStore(e) from e
            raise

    def _nowhere(self, step: int, e: OSError) -> TierUnknown:
        """Neither the run dir nor a temporary folder takes the download: the run dir cannot be used
        now, so start-up waits for it (trainer.checkpoint.tier_wait), as for any tier it cannot use."""
        return TierUnknown({"persistent": f"cannot store the download of step {step} in the run dir nor in a "
                                          f"temporary folder ({type(e).__name__}: {e})"})

    # ------------------------------------------------------------------------------ emergency
    def emergency_save(self, step: int, state: dict, *, deadline: float,
                       meta: dict | None = None) -> EmergencyReport:
        """Save now, on a preemption notice (see the module docstring): the disk tiers
        synchronously (they always complete), then GCS until ``deadline`` (time.monotonic). A
        second signal (Ctrl-C) does not abort it."""
        t0 = time.monotonic()
        meta = _check_meta(meta)
        report = self._uninterrupted(step, t0, lambda: self._emergency(step, state, deadline, meta, t0))
        (self.log.info if report.saved else self.log.error)("emergency save: %s", report.detail)
        return report

    def _uninterrupted(self, step: int, t0: float, save: Callable[[], EmergencyReport]) -> EmergencyReport:
        """Run an emergency ``save`` in a thread and wait for it, ignoring Ctrl-C meanwhile: a
        second signal must not break off the save (or, sharded, a collective) midway. A save
        that raises is reported as failed, never raised."""
        result: list[EmergencyReport] = []
        done = threading.Event()

        def work() -> None:
            try:
                result.append(save())
            except BaseException as e:  # noqa: BLE001
                result.append(EmergencyReport(step, False, None if self.gcs is None else False,
                                              time.monotonic() - t0,
                                              f"step {step}: emergency save failed: {type(e).__name__}: {e}"))
            finally:
                done.set()

        threading.Thread(target=work, name="checkpoint-emergency", daemon=True).start()
        while True:
            try:
                if done.wait(1.0):
                    return result[0]
            except KeyboardInterrupt:
                self.log.warning("interrupt ignored: emergency checkpoint of step %d in progress", step)

    def _emergency(self, step: int, state: dict, deadline: float, meta: dict, t0: float) -> EmergencyReport:
        # Nothing on the network is waited for: older uploads are dropped or left behind.
        self._stop_uploads(f"emergency save of step {step}")
        if self._busy():
            self._thread.join()  # type: ignore[union-attr]  # the disk writer: disk I/O only
        snap = self._acquire_buffer().take(step, state, meta)
        ok: dict[str, bool] = {}
        parts: list[str] = []
        folders: dict[str, Path] = {}

        def write(name: str) -> None:
            t = self._tiers[name]
            try:
                folders[name] = self._write_disk(t, snap)
                ok[name] = True
                parts.append(f"{name} saved ({folders[name]}, {time.monotonic() - t0:.1f}s)")
                t.last_step, t.last_time = step, time.monotonic()
                self._note(name, None)
            except Exception as e:  # noqa: BLE001
                ok[name] = False
                parts.append(f"{name} FAILED ({type(e).__name__}: {e})")
                self._note(name, f"{type(e).__name__}: {e}"[:300])

        # The disk tiers at once: the local SSD (fastest) never delays the persistent disk.
        writers = [threading.Thread(target=write, args=(n,), name=f"checkpoint-emergency-{n}", daemon=True)
                   for n in ("local", "persistent") if n in self._tiers]
        for th in writers:
            th.start()
        for th in writers:
            th.join()
        gcs = self._tiers.get("gcs")
        if gcs is not None:
            src = folders.get("persistent") or folders.get("local") or snap
            ok["gcs"] = self._emergency_upload(gcs, step, src, deadline, parts)
        if ok.get("local") and not any(ok.get(n) for n in DURABLE_TIERS):
            parts.append(f"step {step} is only on the local SSD: a restart of the trainer on this VM "
                         "resumes from it, but it is lost with the VM, so it does not count as saved")
        return EmergencyReport(step=step, persistent_ok=bool(ok.get("persistent")), gcs_ok=ok.get("gcs"),
                               seconds=time.monotonic() - t0, detail=f"step {step}: " + "; ".join(parts),
                               local_ok=ok.get("local"), complete=all(ok.get(n) for n in self._durable_tiers()))

    def _emergency_upload(self, gcs: _Tier, step: int, src: Path | Snapshot, deadline: float,
                          parts: list[str]) -> bool:
        """Upload ``step`` from ``src`` (its persistent copy, else the local one, else host
        memory) until ``deadline``; a request still running then is abandoned on its thread."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            parts.append("GCS not done (no time left before the deadline)")
            return False
        abort = threading.Event()
        result: list[BaseException | None] = []

        def upload() -> None:
            try:
                self._upload(gcs, src, step, deadline=deadline, abort=abort)
                result.append(None)
            except BaseException as e:  # noqa: BLE001
                result.append(e)

        th = threading.Thread(target=upload, name="checkpoint-emergency-upload", daemon=True)
        th.start()
        th.join(max(0.0, deadline - time.monotonic()))
        if th.is_alive():
            abort.set()
            parts.append(f"GCS not done by the deadline ({remaining:.1f}s were left; the manifest will not "
                         "be uploaded, so nothing partial is visible)")
            self._note("gcs", "the emergency upload did not finish by the deadline")
            return False
        if result and result[0] is None:
            parts.append(f"GCS uploaded ({gcs.store.location(step_name(step))})"  # type: ignore[attr-defined]
                         + ("" if isinstance(src, Path) else " from host memory"))
            gcs.last_step, gcs.last_time = step, time.monotonic()
            self._note("gcs", None)
            return True
        e = result[0] if result else None
        parts.append(f"GCS not done ({type(e).__name__}: {e})")
        self._note("gcs", f"{type(e).__name__}: {e}"[:300])
        return False

    # ------------------------------------------------------------------------------ lifecycle
    def wait(self, timeout: float | None = None) -> bool:
        """Block until the disk writer and the uploads queued so far are done (at most
        ``timeout`` seconds); False if they are not by then. Abandoned uploads are not waited for."""
        end = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if end is None else max(0.0, end - time.monotonic())

        th = self._thread
        if th is not None:
            th.join(left())
            if th.is_alive():
                return False
        with self._cv:
            while self._active is not None or self._pending:
                if end is not None and time.monotonic() >= end:
                    return False
                self._cv.wait(left())
        return True

    def close(self, timeout: float | None = None) -> bool:
        """Finish background work and release the host buffers: the disk writer always (disk
        I/O; sharded, a collective), the uploads for at most ``timeout`` seconds (then they are
        abandoned). True if nothing was left unfinished."""
        if self._thread is not None:
            self._thread.join()
        done = self.wait(timeout)
        with self._cv:
            self._closing = True
        if not done:
            self._stop_uploads("the checkpointer is closing")
        with self._cv:
            self._uploader = None  # an idle uploader thread ends
            self._cv.notify_all()
        if self._reserver is not None:
            self._reserver.join()
        self._buffer = SnapshotBuffer()
        self._buffers = [self._buffer]
        return done

    # ------------------------------------------------------------------------------ status
    def describe(self, *, deep: bool = False) -> dict:
        """Per tier: checkpoints (valid or not, with the reason), the newest valid, the policy.

        ``deep`` also hashes every file of disk checkpoints (slow for big states); by default the
        check is the manifest self-checksum plus file presence and sizes.
        """
        out: dict[str, Any] = {"tiers": {}, "stats": dict(self.stats)}
        for name, t in self._tiers.items():
            loc = str(t.store.root) if isinstance(t.store, DirStore) else getattr(t.store, "uri", name)
            entry: dict[str, Any] = {
                "location": loc,
                "policy": dataclasses.asdict(t.policy) | {"automatic": t.policy.automatic},
                "interval_s": t.auto.decide().seconds if t.auto else None,
                "checkpoints": [], "newest_valid": None,
            }
            try:
                infos = self._list(t)
            except Exception as e:  # noqa: BLE001
                entry["error"] = f"{type(e).__name__}: {e}"
                infos = []
            for i in infos:
                valid, reason = i.valid, i.reason
                if deep and valid and isinstance(t.store, DirStore):
                    try:
                        verify_dir(t.store.root / step_name(i.step), key=self.key)
                    except CheckpointInvalid as e:
                        valid, reason = False, str(e)
                entry["checkpoints"].append({"step": i.step, "valid": valid, "reason": reason,
                                             "bytes": i.bytes, "created": i.created,
                                             "location": i.location})
                if valid and entry["newest_valid"] is None:
                    entry["newest_valid"] = i.step
            out["tiers"][name] = entry
        return out


class _Locks:
    """Several locks taken together, always in the same order."""

    def __init__(self, locks: list[threading.Lock]) -> None:
        self._locks = locks

    def __enter__(self) -> None:
        for lock in self._locks:
            lock.acquire()

    def __exit__(self, *exc: object) -> None:
        for lock in reversed(self._locks):
            lock.release()


def describe_failing(failing: dict[str, dict[str, Any]]) -> str:
    """One line for the tiers ``failing()`` returns, e.g. ``gcs failing since
    2026-11-24T04:00:00Z (3 failed writes; last: Forbidden: ...)``; empty when none is."""
    def one(tier: str, rec: dict[str, Any]) -> str:
        since, n = rec.get("since"), rec.get("failures")
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(since)) if isinstance(since, (int, float)) else "?"
        return f"{tier} failing since {when} ({n} failed write{'' if n == 1 else 's'}; last: {rec.get('error')})"

    return "; ".join(one(tier, rec) for tier, rec in sorted(failing.items()))


def _check_meta(meta: dict | None) -> dict:
    meta = dict(meta or {})
    try:
        json.dumps(meta)
    except (TypeError, ValueError) as e:
        raise TypeError(f"checkpoint meta must be JSON-serializable: {e}") from None
    return meta


__all__ = ["Checkpointer", "Durability", "EmergencyReport", "Restored", "TierPolicy", "UploadAborted",
           "describe_failing"]
