"""The ``Checkpointer``: when to save, where to, in the background; what to restore from.

Tiers, fastest first: ``local`` (a local-SSD dir, optional; lost with the VM), ``persistent``
(the run dir on the stateful PD; survives preemption and repair in the same zone) and ``gcs``
(optional; survives everything, including a restart in another zone with a fresh disk).

Saving (CheckFreq's snapshot/persist split):

* ``save()`` blocks the loop only while the state is copied into a reusable host buffer (pinned
  when CUDA is involved) and its plain Python objects are pickled; that is the time it returns.
* A background thread then writes every tier that is due: the disk tiers straight from the buffer
  (``checkpoint.write_dir``: temporary folder, fsync, manifest last, atomic rename), then GCS from
  the folder just written (payload create-only, manifest last), then applies retention.
* One save is in flight at a time, because there is one host buffer. If a tier becomes due while a
  save is in flight, ``due()`` answers False and the tier stays due: the save happens at the first
  step after the in-flight one finished (counted in ``stats["deferred_steps"]``). The loop is never
  made to wait for the disk or the network. An explicit ``save()`` while one is in flight waits for
  it (counted in ``stats["waited"]``): the caller asked for that exact step to be saved.
* Background failures (disk full, GCS unreachable after retries) are logged and counted; they never
  raise into the loop and never leave anything a restore would choose.

Restoring: the newest checkpoint that verifies (manifest self-check and HMAC under the run's key,
sizes, sha256 of every file) across all tiers, preferring the fastest tier for equal steps. A GCS
checkpoint newer than anything on disk is downloaded into the persistent tier (atomically) and
loaded from there. Any invalid candidate is logged with the reason and the next older one is
tried. A tier that cannot be listed or read is unknown, not empty: a trainer's restore raises
``TierUnknown`` rather than choose without it (``trainer.tier_wait`` waits); ``status``
(``download=False``) only notes it. What is never a reason to fall back or start afresh (a
``ResumeMismatch``, exit 2, nothing deleted): a checkpoint that verified but cannot be decoded,
checkpoints of the other layout or another format version, and unauthenticated checkpoints when
nothing authentic is left.

Same step twice: a save that finds a folder of its step already on a tier keeps it when the same
session wrote it (the manifest's ``writer``: same session and step, same state), replaces it
atomically when it holds other state (an abandoned trajectory: the live run is the one a restart
must continue) or is invalid, and never touches a kept one (unauthenticated, another format or
layout): that tier then skips this step.
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

from trainer.checkpoint import (OTHER_FORMAT, OTHER_LAYOUT, CheckpointInfo, CheckpointInvalid,
                                CheckpointUnloadable, Snapshot, SnapshotBuffer, StepOccupied, check_checkpoint,
                                delete_checkpoint, download_dir, kept, kept_mismatch, layout_mismatch,
                                list_checkpoints, load_dir, other_layout, parse_manifest, read_manifest, step_name,
                                upload_dir, verify_dir, write_dir)
from trainer.checkpoint_key import CheckpointKey
from trainer.interval import DEFAULT_MTBF_S, YoungDalyPolicy, changed_materially
from trainer.storage import DirStore, GcsStore, Store, UploadAborted, is_unreachable
from trainer.tier_wait import TierUnknown

TIERS = ("local", "persistent", "gcs")


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


class Checkpointer:
    """Asynchronous multi-tier checkpointing; see the module docstring."""

    #: This checkpointer's layout: how its listings and retention read a manifest.
    parse_manifest = staticmethod(parse_manifest)

    def __init__(self, *, run_dir: Path, local_dir: Path | None = None, gcs_uri: str | None = None,
                 policies: dict[str, TierPolicy] | None = None,
                 mtbf_s: float = DEFAULT_MTBF_S, log: logging.Logger | None = None,
                 gcs_client: Any = None, key: CheckpointKey | None = None) -> None:
        """``key``: sign every manifest and load only checkpoints whose HMAC verifies under it
        (``trainer.checkpoint_key``); None trusts the sha256 alone (nothing is unpickled either
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
        self._buffer = SnapshotBuffer()
        self._thread: threading.Thread | None = None
        self._reserver: threading.Thread | None = None
        # Set by an emergency save to cut short the periodic upload in flight. Scoped to the
        # checkpoint uploads: the goodput ledger shares the GCS store and must keep working.
        self._upload_abort = threading.Event()
        self._restore_lock = threading.Lock()  # retention never deletes while a restore runs
        self._started = time.monotonic()
        #: Called with (tier, step) once a periodic save is durable on a tier (the goodput ledger's
        #: record of checkpoints per tier); it must not block.
        self.on_durable: Callable[[str, int], None] | None = None
        self.stats: dict[str, Any] = {
            "saves": 0, "tier_writes_ok": 0, "tier_writes_failed": 0, "deferred_steps": 0,
            "waited": 0, "blocked_s_total": 0.0, "last_blocked_s": None, "last_error": None,
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
        return self._thread is not None and self._thread.is_alive()

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

        False while a save is in flight (the due tier stays due and is saved after it finished).
        """
        if not self._due_tiers(step):
            return False
        if self._busy():
            self.stats["deferred_steps"] += 1
            return False
        return True

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
            names.append("persistent")  # GCS uploads from the persistent folder
        names = [n for n in TIERS if n in names]
        t_snap = time.perf_counter()
        snap = self._buffer.take(step, state, meta)
        # The cost C for the interval policy excludes the one-off buffer allocation.
        snap_s = time.perf_counter() - t_snap - self._buffer.last_alloc_s
        now = time.monotonic()
        for n in names:
            self._tiers[n].last_step, self._tiers[n].last_time = step, now
        self.stats["saves"] += 1
        self._thread = threading.Thread(target=self._persist, args=(snap, names, snap_s),
                                        name=f"checkpoint-{step}", daemon=True)
        self._thread.start()
        blocked = time.perf_counter() - t0
        self.stats["blocked_s_total"] += blocked
        self.stats["last_blocked_s"] = blocked
        return blocked

    def _persist(self, snap: Snapshot, names: list[str], snap_s: float) -> None:
        """Background: write the due tiers; never raises."""
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
                t = self._tiers["gcs"]
                src = written.get("persistent") or written.get("local")
                if src is None:
                    self._failed("gcs", snap.step, RuntimeError("no disk copy was written to upload from"))
                else:
                    t0 = time.monotonic()
                    try:
                        self._upload(t, src, snap.step, deadline=None)
                    except Exception as e:  # noqa: BLE001
                        self._failed("gcs", snap.step, e)
                    else:
                        self._succeeded(t, snap.step, time.monotonic() - t0)
        except BaseException as e:  # noqa: BLE001 - a background thread must not die silently
            self._failed("?", snap.step, e)

    def _succeeded(self, t: _Tier, step: int, write_s: float) -> None:
        self.stats["tier_writes_ok"] += 1
        if t.auto is not None:
            t.auto.observe(write_s=write_s)
        self.log.info("checkpoint step %d durable on %s in %.2fs", step, t.name, write_s)
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

    def _write_disk(self, t: _Tier, snap: Snapshot) -> Path:
        store = t.store
        assert isinstance(store, DirStore)
        folder = store.root / step_name(snap.step)
        replace = folder.exists()
        if replace and self._keep_same_step(t.name, folder, snap.step):
            return folder
        folder, _ = write_dir(snap, store.root, key=self.key, writer=self.session, replace=replace)
        return folder

    def _keep_same_step(self, tier: str, folder: Path, step: int, writer: str | None = None) -> bool:
        """A folder of this step is already on a disk tier (a save right after another of the same
        step, e.g. an emergency save of a step just saved): True to keep it (``writer``, default
        this session, wrote it: the same state), False to replace it; StepOccupied when it is a
        kept checkpoint."""
        writer = writer or self.session
        try:
            m = self._verify_folder(folder)
        except CheckpointInvalid as e:
            if kept(str(e)):
                raise StepOccupied(f"{folder} holds a checkpoint that is never overwritten ({e}); this tier "
                                   f"skips step {step}") from None
            self.log.warning("replacing invalid %s (%s)", folder, e)
            return False
        if m.get("writer") == writer:
            return True
        self.log.warning("%s step %d at %s verifies but holds other state (written by session %s, not this "
                         "one: an abandoned trajectory); replacing it atomically with this run's step %d",
                         tier, step, folder, m.get("writer", "unknown"), step)
        return False

    def _verify_folder(self, folder: Path) -> dict:
        """Full verification of a folder of this checkpointer's layout (the sharded one overrides)."""
        return verify_dir(folder, key=self.key)

    def _upload(self, t: _Tier, src: Path, step: int, *, deadline: float | None) -> None:
        store = t.store
        assert isinstance(store, GcsStore)
        with store.deadline(deadline), store.aborting(self._upload_abort):
            info = check_checkpoint(store, step, key=self.key)
            if info is not None:
                if info.valid and (info.manifest or {}).get("writer") == read_manifest(src, key=self.key).get("writer"):
                    return  # this very save is there already
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
            upload_dir(src, store, step, deadline=deadline)

    # ------------------------------------------------------------------------------ retention
    def _retain(self, t: _Tier, newest_step: int) -> None:
        """Keep the checkpoint just written plus the newest ``keep - 1`` valid older ones.

        Only checkpoints older than the one just written (and verified while writing) are ever
        deleted. Newer folders are left alone: they may be valid checkpoints a restore skipped
        because of a transient error, or corrupt ones that look valid to the quick check (which
        must not make us delete the good checkpoint we just wrote).
        """
        keep = t.policy.keep
        with self._restore_lock:
            older = [i for i in list_checkpoints(t.store, self.parse_manifest, key=self.key) if i.step < newest_step]
            keep_older = {i.step for i in [x for x in older if x.valid][: keep - 1]}
            for i in older:
                # Kept ones are never deleted: an unauthenticated checkpoint may be this run's own
                # work under a lost or rotated key, and garbage in the bucket must never cost a
                # good checkpoint (retention counts only valid ones).
                if i.step in keep_older or kept(i.reason):
                    continue
                self.log.info("retention: deleting %s step %d (%s)", t.name, i.step,
                              f"beyond the newest {keep} valid" if i.valid else f"invalid: {i.reason}")
                delete_checkpoint(t.store, i.step)

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
            from trainer.state import ResumeMismatch

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
            folder = self._download(t, step, persistent.root)
            self.log.info("downloaded step %d from %s into %s", step, info.location, folder)
            _, state = load_dir(folder, key=self.key)
            return state, info.location, t.name
        tmp = Path(tempfile.mkdtemp(prefix="spottrain-restore-"))
        try:
            folder = download_dir(t.store, step, tmp, key=self.key)
            _, state = load_dir(folder, key=self.key)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return state, info.location, t.name

    def _download(self, t: _Tier, step: int, root: Path) -> Path:
        """``download_dir``; a tier that stops answering midway is unknown (the checkpoint is
        not thereby invalid: never fall back to an older one for that)."""
        try:
            return download_dir(t.store, step, root, key=self.key)
        except Exception as e:
            if is_unreachable(e):
                raise TierUnknown({t.name: f"{type(e).__name__}: {e}"}) from e
            raise

    # ------------------------------------------------------------------------------ emergency
    def emergency_save(self, step: int, state: dict, *, deadline: float,
                       meta: dict | None = None) -> EmergencyReport:
        """Save now, on a preemption notice: persistent synchronously, then GCS until ``deadline``
        (time.monotonic). Returns when done or at the deadline, whichever is later for the
        persistent write (that one always completes) and earlier for GCS. A second signal (Ctrl-C)
        does not abort it."""
        t0 = time.monotonic()
        meta = _check_meta(meta)
        report = self._uninterrupted(step, t0, lambda: self._emergency(step, state, deadline, meta, t0))
        (self.log.info if report.persistent_ok else self.log.error)("emergency save: %s", report.detail)
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
        gcs = self._tiers.get("gcs")
        if self._busy():
            # The in-flight save is older than this one: let its disk write finish (its buffer is
            # the one we need), but cut its upload short (no manifest, so nothing visible).
            self._upload_abort.set()
            try:
                self._thread.join()  # type: ignore[union-attr]
            finally:
                self._upload_abort.clear()
        snap = self._buffer.take(step, state, meta)
        pers = self._tiers["persistent"]
        parts = []
        try:
            folder = self._write_disk(pers, snap)
            persistent_ok = True
            t_pers = time.monotonic() - t0
            parts.append(f"persistent saved ({folder}, {t_pers:.1f}s)")
            pers.last_step, pers.last_time = step, time.monotonic()
        except Exception as e:  # noqa: BLE001
            persistent_ok = False
            folder = None
            parts.append(f"persistent FAILED ({type(e).__name__}: {e})")
        gcs_ok: bool | None = None
        if gcs is not None:
            remaining = deadline - time.monotonic()
            if folder is None:
                gcs_ok = False
                parts.append("GCS not attempted (no persistent copy to upload)")
            elif remaining <= 0:
                gcs_ok = False
                parts.append("GCS not done (no time left before the deadline)")
            else:
                up: list[BaseException | None] = []

                def upload() -> None:
                    try:
                        self._upload(gcs, folder, step, deadline=deadline)
                        up.append(None)
                    except BaseException as e:  # noqa: BLE001
                        up.append(e)

                th = threading.Thread(target=upload, name="checkpoint-emergency-upload", daemon=True)
                th.start()
                th.join(max(0.0, deadline - time.monotonic()))
                if th.is_alive():
                    gcs_ok = False
                    parts.append(f"GCS not done by the deadline ({remaining:.1f}s were left; the "
                                 "manifest will not be uploaded, so nothing partial is visible)")
                elif up and up[0] is None:
                    gcs_ok = True
                    parts.append(f"GCS uploaded ({gcs.store.location(step_name(step))})")  # type: ignore[attr-defined]
                    gcs.last_step, gcs.last_time = step, time.monotonic()
                else:
                    gcs_ok = False
                    e = up[0] if up else None
                    parts.append(f"GCS not done ({type(e).__name__}: {e})")
        self._buffer_release_if_big()
        return EmergencyReport(step=step, persistent_ok=persistent_ok, gcs_ok=gcs_ok,
                               seconds=time.monotonic() - t0,
                               detail=f"step {step}: " + "; ".join(parts))

    def _buffer_release_if_big(self) -> None:
        # After an emergency save the process is about to exit; nothing to do, kept as a hook.
        return None

    # ------------------------------------------------------------------------------ lifecycle
    def wait(self) -> None:
        """Block until the background save (if any) finished."""
        th = self._thread
        if th is not None:
            th.join()

    def close(self) -> None:
        """Finish background work and release the host buffer."""
        self.wait()
        if self._reserver is not None:
            self._reserver.join()
        self._buffer = SnapshotBuffer()

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


def _check_meta(meta: dict | None) -> dict:
    meta = dict(meta or {})
    try:
        json.dumps(meta)
    except (TypeError, ValueError) as e:
        raise TypeError(f"checkpoint meta must be JSON-serializable: {e}") from None
    return meta


__all__ = ["Checkpointer", "EmergencyReport", "Restored", "TierPolicy", "UploadAborted"]
