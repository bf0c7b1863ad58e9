"""The disk writer: a thread per save that waits for the save's copy into host memory, has the
layout write the due disk tiers (temporary folder, fsync, manifest last, atomic rename) and hands
what the remote tiers are due for to the uploader (``trainer.checkpoint.uploader``). It never
touches the network and never raises: a failure is the tier's (``Bookkeeping.failed``).

A periodic save of one process writes at the lowest CPU priority where the time between saves
leaves room for it, lifted back when it has yielded long enough, the next save is due, or anyone
waits for it (``trainer.checkpoint.yielding``). The emergency save has the layout write every disk
tier at once through ``write`` on its own thread.

Same step twice (``same_step``): a folder of the step already on a disk tier is kept when it holds
this process's state (``Bookkeeping.same_state``), replaced atomically when it holds other state
or is invalid, and never touched when quarantined (that tier then skips the step).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from trainer.checkpoint.bookkeeping import Bookkeeping
from trainer.checkpoint.key import CheckpointKey
from trainer.checkpoint.layout import Group, Layout, Staged, Written
from trainer.checkpoint.manifest import CheckpointInvalid, quarantined, step_name
from trainer.checkpoint.tiers import Tier
from trainer.checkpoint.uploader import Upload, Uploader
from trainer.checkpoint.yielding import YieldingWrites


class DiskWriter:
    """The disk writer of the newest save; see the module docstring."""

    def __init__(self, layout: Layout, group: Group, book: Bookkeeping, uploader: Uploader, *,
                 key: CheckpointKey | None, log: logging.Logger) -> None:
        self.layout, self.group, self.book, self.uploader, self.key, self.log = layout, group, book, uploader, key, log
        self.thread: threading.Thread | None = None
        self.yielding = YieldingWrites(time.monotonic)

    def busy(self) -> bool:
        """A disk writer is running (the uploader is not counted: it never holds saves back)."""
        return self.thread is not None and self.thread.is_alive()

    def start(self, staged: Staged, tiers: list[Tier], *, yielding: bool) -> None:
        """Write ``staged`` to the disk tiers of ``tiers`` on a thread of its own, then queue its
        uploads to the remote ones. ``yielding``: at the lowest CPU priority while it may."""
        self.yielding.started(yielding=yielding)
        self.book.stats["writes_yielded"] = self.yielding.yielded
        self.thread = threading.Thread(target=self._persist, args=(staged, tiers), name=f"checkpoint-{staged.step}",
                                       daemon=True)
        self.thread.start()

    def check(self, *, next_due: bool) -> None:
        """Called at each step while it runs: lift it once it yielded long enough or ``next_due``."""
        self.yielding.check(next_due=next_due)
        self.book.stats["writes_lifted"] = self.yielding.lifted

    def lift(self) -> None:
        """Back to normal priority: someone waits for it."""
        self.yielding.release()
        self.book.stats["writes_lifted"] = self.yielding.lifted

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the disk writer (and its copy), lifted to this thread's priority first: whoever
        waits for a write must not wait for a starved one. False while it still runs."""
        if self.thread is None:
            return True
        self.lift()
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def _persist(self, staged: Staged, tiers: list[Tier]) -> None:
        """The thread: the due disk tiers, then hand the uploads over; never raises, never
        touches the network."""
        try:
            try:
                staged.copied()  # the first thing: a save after this thread ended reuses the buffer
            except Exception as e:  # noqa: BLE001 - every tier of this save failed
                for t in tiers:
                    self.book.failed(t.name, staged.step, e)
                return
            try:
                written = self.yielding.run(lambda: self.write(staged, tiers, emergency=False))
            finally:
                self.yielding.finished()
            if self.group.rank == 0:
                for line in written.detail:
                    self.log.warning("checkpoint step %d: %s", staged.step, line)
            remotes = [t for t in tiers if t.remote]
            up = self.uploader
            source = up.source(staged, written, remotes) if remotes and up.uploads_here(written) else None
            if source is not None:
                for t in remotes:
                    up.enqueue(Upload(t, source, collective=written.collective), hold=True)
                source.refs.release()
            else:
                up.discard(written)
                if remotes and self.group.rank == 0:
                    for t in remotes:
                        self.book.failed(t.name, staged.step, RuntimeError(written.failure or "nothing to upload from"))
        except BaseException as e:  # noqa: BLE001 - a background thread must not die silently
            self.book.failed("?", staged.step, e)

    def write(self, staged: Staged, tiers: list[Tier], *, emergency: bool) -> Written:
        """Have the layout write the disk tiers of ``tiers`` (a collective): a periodic save
        records each tier's success (retention, the ledger), an emergency save only its health."""
        disks = [t for t in tiers if not t.remote]
        plan = {t.name: self.same_step(t, staged.step) for t in disks} if self.group.is_leader else {}

        def on_tier(t: Tier, error: BaseException | None, seconds: float, folder: Path | None) -> None:
            if error is None:
                self.book.verified.add((t.name, staged.step))
                if emergency:
                    self.book.saved([t], staged.step)
                    self.book.note(t.name, None)
                else:
                    self.uploader.kept(t, staged.step, seconds)
            elif self.group.nodes > 1:
                self.log.info("checkpoint step %d: no complete copy on %s (%d nodes, each disk holds its own "
                              "files)", staged.step, t.name, self.group.nodes)
            elif emergency:
                self.book.note(t.name, f"{type(error).__name__}: {error}"[:300])
            else:
                self.book.failed(t.name, staged.step, error)

        return self.layout.write(staged, disks, plan, for_upload=any(t.remote for t in tiers), parallel=emergency,
                                 on_tier=on_tier, key=self.key, writer=self.book.session)

    def same_step(self, t: Tier, step: int) -> str:
        """The plan for a disk tier that may hold a folder of this step already (a save right after
        another of the same step, e.g. an emergency save of a step just saved, the final save of a
        re-run): ``write`` (none there), ``keep`` (this state, see ``Bookkeeping.same_state``),
        ``replace`` (other state, or invalid) or ``occupied: why`` (quarantined: never overwritten)."""
        folder = t.store.folder(step_name(step))
        if folder is None or not folder.exists():
            return "write"
        if (t.name, step) in self.book.verified:
            return "keep"
        try:
            m = self.layout.verify(folder, key=self.key)
        except CheckpointInvalid as e:
            if quarantined(str(e)):
                return (f"occupied: {folder} holds a checkpoint that is never overwritten ({e}); this tier "
                        f"skips step {step}")
            self.log.warning("replacing invalid %s (%s)", folder, e)
            return "replace"
        if m.get("writer") in self.book.same_state(step):
            return "keep"
        self.log.warning("%s step %d at %s verifies but holds other state (written by session %s, not this "
                         "one: an abandoned trajectory); replacing it atomically with this run's step %d",
                         t.name, step, folder, m.get("writer", "unknown"), step)
        return "replace"


__all__ = ["DiskWriter"]
