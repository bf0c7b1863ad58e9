"""The emergency save, on a preemption notice: every tier it can reach before a deadline, never
waiting on the network.

1. The queued uploads are dropped and the one in flight aborted, left to its thread
   (``Uploader.stop``).
2. A disk writer still running is awaited (disk I/O only), and with it its snapshot's copy: the
   emergency save reuses the host buffer, never half-copied bytes.
3. The layout stages the state and writes every disk tier at once (``DiskWriter.write``).
4. Every remote tier gets it from the home tier's copy (else another disk's, the staging folder,
   host memory) until the deadline: across nodes together, in order (a collective cannot be left
   behind on one rank); else each on a thread of its own, one still running at the deadline
   abandoned there (its manifest is never uploaded, so nothing partial is visible).

*Saved* (``EmergencyReport.saved``) means on a tier that outlives the VM: a save only the local
SSD got serves a restart of the trainer on this VM (systemd, a reboot) but is lost with the VM.
The save runs on a thread of its own and a second signal (Ctrl-C) does not break it off midway; a
save that raises is reported as failed, never raised.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Callable

from trainer.checkpoint.bookkeeping import Bookkeeping
from trainer.checkpoint.disk_writer import DiskWriter
from trainer.checkpoint.layout import Group, Layout, Written
from trainer.checkpoint.manifest import step_name
from trainer.checkpoint.tiers import Tier, Tiers
from trainer.checkpoint.uploader import Source, Upload, Uploader


@dataclasses.dataclass
class EmergencyReport:
    """What an emergency save got: ``ok[tier]`` True/False for each tier of the run."""

    step: int
    ok: dict[str, bool]
    seconds: float        # notice -> durable
    detail: str           # one human line: what was saved and what was not
    saved: bool = False   # on a tier that outlives the VM (see the module docstring)
    complete: bool = False  # on every durable tier this run has (a final checkpoint then counts)

    def __getattr__(self, name: str) -> Any:
        # ``report.gcs_ok``: the tier's ``ok``, None where the run has no such tier (the log line's
        # and the ledger's fields).
        if name.endswith("_ok") and not name.startswith("_"):
            return self.__dict__.get("ok", {}).get(name[:-3])
        raise AttributeError(name)

    def fields(self, order: list[str]) -> dict[str, bool | None]:
        """``{tier}_ok`` for each tier in ``order`` (the ledger's and the log line's fields)."""
        return {f"{n}_ok": self.ok.get(n) for n in order}


@dataclasses.dataclass
class _Running:
    """An emergency upload on its own thread (rank 0, one process's uploads)."""

    thread: threading.Thread
    job: Upload
    result: list[BaseException | None]  # empty while it runs
    remaining: float                    # seconds left to the deadline when it started


class Emergency:
    """The emergency save of one checkpointer; see the module docstring."""

    def __init__(self, tiers: Tiers, layout: Layout, group: Group, book: Bookkeeping, writer: DiskWriter,
                 uploader: Uploader, *, log: logging.Logger) -> None:
        self.tiers, self.layout, self.group, self.book, self.log = tiers, layout, group, book, log
        self.writer, self.uploader = writer, uploader

    def save(self, step: int, state: Any, *, deadline: float, meta: dict, copying: bool) -> EmergencyReport:
        """Save ``step`` now: the disk tiers (they always complete), then every remote tier until
        ``deadline`` (time.monotonic). ``copying``: the previous save's copy into host memory may
        still run (it is waited for)."""
        t0 = time.monotonic()
        report = self._uninterrupted(step, t0, lambda: self._save(step, state, deadline, meta, t0, copying))
        if self.group.rank == 0:
            (self.log.info if report.saved else self.log.error)("emergency save: %s", report.detail)
        return report

    def _uninterrupted(self, step: int, t0: float, save: Callable[[], EmergencyReport]) -> EmergencyReport:
        """Run an emergency ``save`` in a thread and wait for it, ignoring Ctrl-C meanwhile: a
        second signal must not break off the save (or a collective) midway. A save that raises is
        reported as failed, never raised."""
        result: list[EmergencyReport] = []
        done = threading.Event()

        def work() -> None:
            try:
                result.append(save())
            except BaseException as e:  # noqa: BLE001
                result.append(EmergencyReport(step, {t.name: False for t in self.tiers}, time.monotonic() - t0,
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

    def _save(self, step: int, state: Any, deadline: float, meta: dict, t0: float, copying: bool) -> EmergencyReport:
        # Nothing on the network is waited for: older uploads are dropped or left behind (across
        # nodes that one runs on the uploader's own group). Then every tier, disks first.
        self.uploader.stop(f"emergency save of step {step}")
        if self.writer.busy():
            if copying:
                self.log.info("emergency save of step %d: waiting for the previous save's copy into host memory "
                              "and its disk write", step)
            self.writer.join()  # the disk writer (its copy first): disk I/O only
        staged = self.layout.stage(step, state, meta, make_room=self.uploader.drop_memory_upload)
        written = self.writer.write(staged, list(self.tiers), emergency=True)
        ok: dict[str, bool] = {}
        parts: list[str] = list(written.detail)
        for t in self.tiers.disks:
            error = written.errors.get(t.name)
            ok[t.name] = t.name in written.errors and error is None
            if ok[t.name]:
                folder = written.folders.get(t.name)
                parts.append(f"{t.name} saved" + (f" ({folder}, {written.seconds.get(t.name, 0.0):.1f}s)"
                                                    if folder is not None else ""))
            elif self.group.nodes > 1:
                parts.append(f"{t.name} not complete")
            else:
                parts.append(f"{t.name} FAILED ({type(error).__name__}: {error})")
        remotes = self.tiers.remotes
        up = self.uploader
        source = up.source(staged, written, remotes) if remotes and up.uploads_here(written) else None
        if source is None:
            up.discard(written)
        if remotes:
            ok.update(self._uploads(remotes, source, written, deadline, parts))
        if source is not None:
            source.refs.release()
        cache = [t.name for t in self.tiers if not t.durable and ok.get(t.name)]
        if cache and not any(ok.get(t.name) for t in self.tiers if t.durable):
            parts.append(f"step {step} is only on {', '.join(cache)}, lost with the VM: a restart of the trainer on "
                         "this VM resumes from it, but it does not count as saved")
        complete = self.tiers.complete(self.group.nodes)
        return EmergencyReport(step=step, ok=ok, seconds=time.monotonic() - t0,
                               detail=f"step {step}: " + "; ".join(parts),
                               saved=any(ok.get(t.name) for t in self.tiers if t.durable),
                               complete=bool(complete) and all(ok.get(t.name) for t in complete))

    def _uploads(self, remotes: list[Tier], source: Source | None, written: Written, deadline: float,
                 parts: list[str]) -> dict[str, bool]:
        """Upload to every remote tier until ``deadline``: across nodes together, in order (a
        collective cannot be left behind on one rank); else on rank 0, each on a thread of its own,
        a request still running at the deadline abandoned there. Rank 0's outcome on every rank."""
        g = self.group
        out: dict[str, bool] = {}
        if source is None:
            if g.rank == 0 or written.collective:
                for t in remotes:
                    out[t.name] = False
                    parts.append(f"{t.name} not done ({written.failure or 'nothing to upload from'})")
            if not written.collective and g.size > 1:
                out, more = g.bcast((out, parts))
                parts[:] = more
            return out
        if written.collective:
            for t in remotes:
                t1 = time.monotonic()
                job = Upload(t, source, collective=True, deadline=deadline)
                try:
                    self.uploader.upload(job, lane="save")
                except Exception as e:  # noqa: BLE001
                    out[t.name] = False
                    parts.append(f"{t.name} not done ({e})")
                    if g.rank == 0:
                        self.book.failed(t.name, source.step, e)
                else:
                    out[t.name] = True
                    parts.append(f"{t.name} uploaded ({t.store.location(step_name(source.step))})")
                    if g.rank == 0:
                        self.uploader.kept(t, source.step, time.monotonic() - t1)
            return out
        if g.rank == 0:
            running = {}
            for t in remotes:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    out[t.name] = False
                    parts.append(f"{t.name} not done (no time left before the deadline)")
                    continue
                running[t.name] = self._start(t, source, deadline)
            for t in remotes:
                if t.name in running:
                    out[t.name] = self._joined(t, source, running[t.name], deadline, parts)
        if g.size > 1:
            out, more = g.bcast((out, parts))
            parts[:] = more
        return out

    def _start(self, t: Tier, source: Source, deadline: float) -> _Running:
        job = Upload(t, source, deadline=deadline)
        result: list[BaseException | None] = []

        def upload() -> None:
            try:
                with t.store.aborting(job.abort):
                    self.uploader.upload(job, lane="save")
                result.append(None)
            except BaseException as e:  # noqa: BLE001
                result.append(e)

        th = threading.Thread(target=upload, name=f"checkpoint-emergency-upload-{t.name}", daemon=True)
        th.start()
        return _Running(th, job, result, deadline - time.monotonic())

    def _joined(self, t: Tier, source: Source, running: _Running, deadline: float, parts: list[str]) -> bool:
        running.thread.join(max(0.0, deadline - time.monotonic()))
        if running.thread.is_alive():
            running.job.abort.set()
            parts.append(f"{t.name} not done by the deadline ({running.remaining:.1f}s were left; the manifest will "
                         "not be uploaded, so nothing partial is visible)")
            self.book.note(t.name, "the emergency upload did not finish by the deadline")
            return False
        result = running.result
        if result and result[0] is None:
            parts.append(f"{t.name} uploaded ({t.store.location(step_name(source.step))})"
                         + ("" if source.memory is None else " from host memory"))
            self.book.saved([t], source.step)
            self.book.note(t.name, None)
            return True
        e = result[0] if result else None
        parts.append(f"{t.name} not done ({type(e).__name__}: {e})")
        self.book.note(t.name, f"{type(e).__name__}: {e}"[:300])
        return False


__all__ = ["Emergency", "EmergencyReport"]
