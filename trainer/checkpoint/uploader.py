"""The uploader: one long-lived thread that uploads the saves a remote tier is due for, and
retention on every tier.

* **What an upload reads** (``Source``): the save's committed folder on a disk tier (the home
  tier's first), which frees host memory for the next save at once and is pinned (kept from
  retention) until every upload of it ended; else the layout's staging folder; else host memory,
  which that upload then owns until it ends. The uploads of one save share it (``Refs``).
* **The queue**: an upload never holds a disk save back. While one is in flight, the next save's
  upload to the same tier waits in a queue of one, where a newer save's replaces it
  (``stats["uploads_superseded"]``); across nodes every rank uploads its own files, so collective
  uploads queue in order instead. A queued upload from host memory gives its buffer up to a newer
  save (``drop_memory_upload``).
* **Lanes**: the uploader's collectives run on the group's ``"upload"`` lane, an emergency
  upload's on ``"save"``: collectives from two threads on one process group are unsafe.
* **One way up** (``upload``): rank 0 looks at what the tier holds at the step first (this very
  state: skip; a partial upload or other state: removed; a quarantined one: the tier skips the
  step); every rank that holds files uploads its own; rank 0 writes the session's signed run
  record (``trainer.checkpoint.run_record``) and then the manifest, last, before the deadline, so
  nothing partial is ever valid. Every upload has its own abort flag (``stop``), checked by the
  store between requests and chunks; an abandoned upload is left to its thread.
* **Retention** (``retain``): after a save is on a tier, the newest ``keep - 1`` valid older
  checkpoints are kept and the other older ones deleted, never a quarantined one or a folder an
  upload reads. A restore takes every tier's retention lock (``restoring``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from trainer.checkpoint import run_record
from trainer.checkpoint.bookkeeping import Bookkeeping
from trainer.checkpoint.format import check_checkpoint, delete_checkpoint, list_checkpoints, read_manifest
from trainer.checkpoint.key import CheckpointKey
from trainer.checkpoint.layout import Group, Layout, Refs, Staged, Written
from trainer.checkpoint.manifest import MANIFEST, StepOccupied, quarantined, step_name
from trainer.checkpoint.stores import UploadAborted
from trainer.checkpoint.tiers import Tier, Tiers


@dataclasses.dataclass(eq=False)
class Source:
    """What an upload reads: a folder (committed on ``pin``'s disk tier, or a staging folder),
    or a staged state in host memory; shared by the uploads of one save (``refs``)."""

    step: int
    refs: Refs
    folder: Path | None = None
    memory: Staged | None = None
    manifest: bytes | None = None
    pin: str | None = None        # the disk tier whose committed folder this is (kept from retention)


@dataclasses.dataclass(eq=False)
class Upload:
    """One upload the uploader owes: ``source`` to the remote ``tier``."""

    tier: Tier
    source: Source
    collective: bool = False      # across nodes: every rank uploads its own files
    abort: threading.Event = dataclasses.field(default_factory=threading.Event)
    deadline: float | None = None
    released: bool = False

    @property
    def step(self) -> int:
        return self.source.step


class Uploader:
    """The upload queue and its thread, the folders uploads read (pins), retention; see the
    module docstring."""

    def __init__(self, tiers: Tiers, layout: Layout, group: Group, book: Bookkeeping, *,
                 key: CheckpointKey | None, log: logging.Logger) -> None:
        self.tiers, self.layout, self.group, self.book, self.key, self.log = tiers, layout, group, book, key, log
        # The thread, the upload it runs, the queue, and a condition over all of it and the pins.
        self._cv = threading.Condition(threading.RLock())
        self._thread: threading.Thread | None = None
        self._active: Upload | None = None
        self._pending: list[Upload] = []
        self._closing = False
        self.abandoned = 0  # uploads left running on their thread (emergency, deadline)
        self._pins: dict[tuple[str, int], int] = {}  # (tier, step) folders an upload reads
        #: Remote tiers this session wrote its run record to (``trainer.checkpoint.run_record``).
        self._recorded: set[str] = set()
        # Retention never deletes while a restore runs: one lock per tier (a remote tier's
        # retention, which may sit in a stalled request, must never hold a disk tier's up), all of
        # them for a restore.
        self._tier_locks = {t.name: threading.Lock() for t in tiers}

    # ------------------------------------------------------------------------------ sources
    def source(self, staged: Staged, written: Written, remotes: list[Tier]) -> Source | None:
        """What the uploads of a save read: this node's committed copy (the home tier's first),
        else the staging folder, else host memory. The caller holds one reference (``refs``)."""
        step = staged.step
        committed = sorted(written.folders, key=lambda n: n != self.tiers.roles.home)
        if committed and not written.collective:
            tier = committed[0]
            self._pin(tier, step)
            return Source(step, Refs(lambda: self._unpin(tier, step)), folder=written.folders[tier], pin=tier)
        if written.staging is not None:
            stage, leader = written.staging, self.group.is_leader

            def remove_stage() -> None:
                if leader:
                    shutil.rmtree(stage, ignore_errors=True)

            return Source(step, Refs(remove_stage), folder=stage, manifest=written.manifest)
        if written.memory is not None:
            self.log.warning("checkpoint step %d: no disk tier took it; uploading it to %s from host memory", step,
                             ", ".join(t.name for t in remotes))
            memory = written.memory
            return Source(step, Refs(memory.release), memory=memory)
        return None

    def discard(self, written: Written) -> None:
        """Nothing uploads what ``written`` left for an upload: give it back."""
        if written.staging is not None and self.group.is_leader:
            shutil.rmtree(written.staging, ignore_errors=True)
        if written.memory is not None:
            written.memory.release()

    def uploads_here(self, written: Written) -> bool:
        """This rank uploads the save: every rank across nodes (each its own files), else rank 0."""
        return written.collective or self.group.rank == 0

    def _pin(self, tier: str, step: int) -> None:
        with self._cv:
            self._pins[(tier, step)] = self._pins.get((tier, step), 0) + 1

    def _unpin(self, tier: str, step: int) -> None:
        with self._cv:
            self._pins[(tier, step)] -= 1
            if not self._pins[(tier, step)]:
                del self._pins[(tier, step)]
            self._cv.notify_all()

    def _pinned(self, tier: str) -> set[int]:
        with self._cv:
            return {s for (t, s) in self._pins if t == tier}

    # ------------------------------------------------------------------------------ the queue
    def busy(self) -> bool:
        """An upload is running or queued."""
        with self._cv:
            return self._active is not None or bool(self._pending)

    def droppable(self) -> bool:
        """A queued upload reads host memory that a newer save could take instead."""
        with self._cv:
            return any(j.source.memory is not None for j in self._pending)

    def drop_memory_upload(self) -> bool:
        """Drop one queued upload from host memory (its buffer is needed by a newer save)."""
        with self._cv:
            job = next((j for j in self._pending if j.source.memory is not None), None)
            if job is None:
                return False
            self._pending.remove(job)
        self._superseded(job, "its host memory is needed by a newer save")
        return True

    def enqueue(self, job: Upload, *, hold: bool = False) -> None:
        """Queue ``job`` for the uploader: it replaces a queued one to the same tier (in order when
        collective). ``hold``: take a reference on its source first."""
        if hold:
            job.source.refs.hold()
        with self._cv:
            if self._closing:
                dropped = [job]
            else:
                dropped = [] if job.collective else [j for j in self._pending if j.tier is job.tier]
                self._pending = [j for j in self._pending if j not in dropped] + [job]
                if self._thread is None:
                    self._thread = threading.Thread(target=self._loop, name="checkpoint-uploader", daemon=True)
                    self._thread.start()
                self._cv.notify_all()
        for old in dropped:
            self._superseded(old, "the checkpointer is closing" if old is job else f"step {job.step} is newer")

    def _superseded(self, job: Upload, why: str) -> None:
        self.book.stats["uploads_superseded"] += 1
        self.log.info("upload of step %d to %s dropped: %s", job.step, job.tier.name, why)
        self._release(job)

    def _release(self, job: Upload) -> None:
        """The upload ``job`` ended (or never started): give its source back."""
        if job.released:
            return
        job.released = True
        try:
            job.source.refs.release()
        except Exception as e:  # noqa: BLE001 - a leftover staging folder is removed at restore
            self.log.warning("cleaning up after the upload of step %d failed: %s", job.step, e)
        with self._cv:
            self._cv.notify_all()

    def _loop(self) -> None:
        me = threading.current_thread()
        while True:
            with self._cv:
                while not self._pending and self._thread is me:
                    self._cv.wait()
                if self._thread is not me:
                    return  # replaced: this thread's upload was abandoned
                job = self._active = self._pending.pop(0)
            try:
                t0 = time.monotonic()
                with job.tier.store.aborting(job.abort):  # retention too: an abandoned upload stops at its next request
                    try:
                        self.upload(job, lane="upload")
                    except Exception as e:  # noqa: BLE001
                        if self.group.rank == 0:
                            self.book.failed(job.tier.name, job.step, e)
                    else:
                        if self.group.rank == 0:
                            self.kept(job.tier, job.step, time.monotonic() - t0)
            except BaseException as e:  # noqa: BLE001 - this thread must not die silently
                self.book.failed(job.tier.name, job.step, e)
            finally:
                with self._cv:
                    if self._active is job:
                        self._active = None
                self._release(job)

    def wait(self, end: float | None) -> bool:
        """Block until the uploads queued so far are done (at most until ``end``,
        time.monotonic); False if they are not by then. Abandoned uploads are not waited for."""
        with self._cv:
            while self._active is not None or self._pending:
                if end is not None and time.monotonic() >= end:
                    return False
                self._cv.wait(None if end is None else max(0.0, end - time.monotonic()))
        return True

    def stop(self, why: str) -> None:
        """Drop the queued uploads and abort the one in flight, without waiting for it: its thread
        is left to end by itself (at its next request, or when a request times out)."""
        with self._cv:
            dropped, self._pending = self._pending, []
            job = self._active
            if job is not None:
                job.abort.set()
                self._active = None
                self._thread = None  # a later upload gets a fresh thread
                self.abandoned += 1
                self.log.warning("upload of step %d to %s abandoned: %s", job.step, job.tier.name, why)
            self._cv.notify_all()
        for old in dropped:
            self._superseded(old, why)

    def close(self, done: bool) -> None:
        """Take no more uploads; ``done`` False: abandon what is left. An idle thread ends."""
        with self._cv:
            self._closing = True
        if not done:
            self.stop("the checkpointer is closing")
        with self._cv:
            self._thread = None  # an idle uploader thread ends
            self._cv.notify_all()

    # ------------------------------------------------------------------------------ one upload
    def upload(self, job: Upload, *, lane: str) -> None:
        """Every checkpoint upload goes through here (the writer lease guards the store). Rank 0
        looks at what the tier holds at this step first; then every rank that holds files of it
        uploads its own (one rank alone unless ``job.collective``), and rank 0 uploads the manifest
        last, once every part is there (before the deadline), so nothing partial is ever valid.
        Raises when the upload did not complete."""
        g, store, step, src = self.group, job.tier.store, job.step, job.source

        def agree(obj: Any) -> Any:
            return g.bcast(obj, lane=lane) if job.collective else obj

        decision: Any = None
        if g.rank == 0:
            try:
                with store.deadline(job.deadline), store.aborting(job.abort):
                    decision = self._remote_plan(job)
            except Exception as e:  # noqa: BLE001 - said on every rank below
                decision = e if not job.collective else f"{type(e).__name__}: {e}"
        decision = agree(decision)
        if decision == "skip":
            return
        if decision != "upload":
            raise decision if isinstance(decision, BaseException) else RuntimeError(decision)
        manifest = src.manifest
        if manifest is None:
            manifest = (self.layout.memory_manifest(src.memory, key=self.key, writer=self.book.session)
                        if src.memory is not None else (_folder(src) / MANIFEST).read_bytes())
        names = self.layout.uploads(sorted(self.layout.parse_manifest(manifest)["files"]), collective=job.collective)
        prefix = step_name(step)

        def upload_mine() -> None:
            with store.deadline(job.deadline), store.aborting(job.abort):
                for name in names:
                    if src.memory is not None:
                        store.put_memory(f"{prefix}/{name}", self.layout.memory_file(src.memory, name))
                    else:
                        store.put_file(_folder(src) / name, f"{prefix}/{name}")

        error: BaseException | None = None
        try:
            upload_mine()
        except Exception as e:  # noqa: BLE001 - travels to rank 0
            error = e
        errors = g.all(None if error is None else f"{type(error).__name__}: {error}", lane=lane) \
            if job.collective else [error]
        result: Any = None
        if g.rank == 0:
            bad = [(r, e) for r, e in enumerate(errors) if e is not None]
            if bad:
                result = bad[0][1] if not job.collective else RuntimeError(
                    "; ".join(f"rank {r}: {e}" for r, e in bad) + " (no manifest uploaded: nothing partial is visible)")
            else:
                try:
                    with store.deadline(job.deadline), store.aborting(job.abort):
                        if job.deadline is not None and time.monotonic() > job.deadline:
                            raise UploadAborted("deadline passed before the manifest upload")
                        self._record(job.tier, step)
                        store.put_bytes(f"{prefix}/{MANIFEST}", manifest)
                except Exception as e:  # noqa: BLE001
                    result = e
            if job.collective and result is not None:
                result = f"{type(result).__name__}: {result}" if not isinstance(result, RuntimeError) else str(result)
        result = agree(result)
        if result is not None:
            raise result if isinstance(result, BaseException) else RuntimeError(result)

    def _record(self, t: Tier, step: int) -> None:
        """Rank 0, before the manifest of this session's first checkpoint on the remote tier ``t``:
        the run's signed record that it saved there (``trainer.checkpoint.run_record``), so that no
        visible checkpoint of the run is ever without one. Rewritten once a session: a record a
        bucket writer replaced or deleted is back with the next save. A failure fails the upload."""
        if self.key is None or self.key.run is None or t.name in self._recorded:
            return
        t.store.put_bytes(run_record.RECORD_KEY, run_record.build(self.key, step=step, writer=self.book.session),
                          overwrite=True)
        self._recorded.add(t.name)

    def _remote_plan(self, job: Upload) -> str:
        """What to do with the copy of ``job.step`` the remote tier may hold already: ``skip`` (this
        very state), ``upload`` (after removing a partial upload or other state); raises
        ``StepOccupied`` for a quarantined one."""
        store, step, src = job.tier.store, job.step, job.source
        parse = self.layout.parse_manifest
        info = check_checkpoint(store, step, parse, key=self.key)
        if info is None:
            return "upload"
        mine = None
        if src.manifest is not None:
            mine = json.loads(src.manifest).get("writer")
        elif src.folder is not None:
            mine = read_manifest(src.folder, parse, key=self.key).get("writer")
        if info.valid and (info.manifest or {}).get("writer") in self.book.same_state(step, mine):
            return "skip"
        if quarantined(info.reason):
            raise StepOccupied(f"{job.tier.name} holds a checkpoint at step {step} that is never overwritten "
                               f"({info.reason}); this tier skips step {step}")
        if info.valid:
            self.log.warning("%s step %d verifies but holds other state (written by session %s, not this one); "
                             "replacing it with this run's", job.tier.name, step,
                             (info.manifest or {}).get("writer", "unknown"))
        else:
            # A leftover partial upload of this step: its objects are create-only, so remove them
            # first; they were never visible as a checkpoint.
            self.log.info("removing partial upload of step %d on %s (%s)", step, job.tier.name, info.reason)
        delete_checkpoint(store, step)
        return "upload"

    # ------------------------------------------------------------------------------ retention
    def kept(self, t: Tier, step: int, write_s: float) -> None:
        """A periodic save of ``step`` is on ``t``: record it (``Bookkeeping.succeeded``), then
        apply retention there."""
        self.book.succeeded(t, step, write_s)
        try:
            self.retain(t, step)
        except Exception as e:  # noqa: BLE001
            self.log.warning("retention on %s failed (nothing lost): %s: %s", t.name, type(e).__name__, e)

    def retain(self, t: Tier, newest_step: int) -> None:
        """Keep the checkpoint just written plus the newest ``keep - 1`` valid older ones.

        Only checkpoints older than the one just written (and verified while writing) are ever
        deleted. Newer folders are left alone: they may be valid checkpoints a restore skipped
        because of a transient error, or corrupt ones that look valid to the quick check (which
        must not make us delete the good checkpoint we just wrote). A folder an upload is reading
        is kept until that upload ended. Across nodes the disks hold no committed checkpoints
        to prune.
        """
        if not t.remote and self.group.nodes > 1:
            return
        with self._tier_locks[t.name]:
            older = [i for i in list_checkpoints(t.store, self.layout.parse_manifest, key=self.key)
                     if i.step < newest_step]
            keep_older = {i.step for i in [x for x in older if x.valid][: t.keep - 1]}
            pinned = self._pinned(t.name)
            for i in older:
                # Quarantined ones are never deleted: an unauthenticated checkpoint may be this run's
                # own work under a lost or rotated key, and garbage in the bucket must never cost a
                # good checkpoint (retention counts only valid ones). Nor is a folder an upload reads.
                if i.step in keep_older or i.step in pinned or quarantined(i.reason):
                    continue
                self.log.info("retention: deleting %s step %d (%s)", t.name, i.step,
                              f"beyond the newest {t.keep} valid" if i.valid else f"invalid: {i.reason}")
                delete_checkpoint(t.store, i.step)
                self.book.verified.discard((t.name, i.step))

    def restoring(self) -> _Locks:
        """Every tier's retention lock, for a restore (always taken in the same order)."""
        return _Locks(list(self._tier_locks.values()))


def _folder(src: Source) -> Path:
    """The folder an upload that does not read host memory reads."""
    assert src.folder is not None, "an upload reads a folder or host memory"
    return src.folder


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


__all__ = ["Source", "Upload", "Uploader"]
