"""A run's artifacts directory (``ctx.artifacts_dir``) and its copy in GCS.

A task keeps what is not a checkpoint here: samples, a best-validation copy of the model,
tokenizer files. The directory is ``RUN_DIR/artifacts/`` (on the persistent disk, so it survives a
restart of the trainer and a preemption with the same disk); with ``gcs_uri`` it is copied to
``<gcs_uri>/artifacts/`` (same relative names), and a fresh disk gets the files back at start-up.

When (rank 0 only; the other ranks' writes are not copied):

* after every periodic checkpoint save, in the background and only once that checkpoint's own
  writes and upload are done, so a checkpoint never waits for artifacts;
* at the end of the run and at a pause (``stop_at_step``), waiting for it;
* after an emergency save, only with the time left before the preemption deadline (best effort:
  a copy cut short by the power-off leaves no object at all, GCS objects appear whole or not).

How: one listing of ``artifacts/``; a file is uploaded only when it is new or its content
(CRC32C) differs from its object. Before uploading, the file is copied into a private staging
file while its CRC32C is computed, and its size, mtime and inode are compared before and after:
a file that changed meanwhile (the task is writing it) is skipped this time and picked up by the
next copy, so a torn file never becomes an object. A new object is created only if none exists
(``ifGenerationMatch=0``) and a changed one replaces exactly the generation that was listed, so
a concurrent writer is never overwritten blindly (such a conflict is logged and skipped). Objects
are never deleted: removing a file locally keeps its last copy in GCS.

Names starting with ``.tmp-`` are never copied: write ``.tmp-NAME`` and rename it to ``NAME``,
or use :func:`atomic` (``with artifacts.atomic(ctx.artifacts_dir / "best.pt") as tmp:
torch.save(model.state_dict(), tmp)``), so that a file appears complete or not at all, also on
the local disk. At start-up, objects missing locally are downloaded (atomically); a local file
that differs from its object is kept (it is newer: the disk outlived the last copy). Artifacts
are not rolled back with a checkpoint: after a resume they are the latest ones copied.

Artifacts never stop a run: a GCS failure and a run dir that is full or read-only (the directory
cannot even be created) are logged, and the run goes on.
"""
from __future__ import annotations

import base64
import contextlib
import dataclasses
import logging
import os
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

from trainer.checkpoint.stores import TMP_PREFIX, GcsStore, fsync_dir

DIR = "artifacts"
PREFIX = DIR + "/"
#: Seconds the start-up listing of the bucket may take (GCS down must not hold the start long).
RESTORE_LIST_TIMEOUT_S = 60.0
_CHUNK = 8 << 20


@contextlib.contextmanager
def atomic(path: Path | str) -> Iterator[Path]:
    """Yield a temporary path next to ``path`` to write to; on success it is fsynced and renamed
    to ``path`` (replacing it), on an exception removed. The sync never copies the temporary."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f"{TMP_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}"
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


@dataclasses.dataclass
class SyncReport:
    uploaded: list[str] = dataclasses.field(default_factory=list)
    unchanged: int = 0
    busy: list[str] = dataclasses.field(default_factory=list)  # changed while being read: next time
    failed: list[str] = dataclasses.field(default_factory=list)  # "name: reason"
    seconds: float = 0.0

    def line(self) -> str:
        return (f"uploaded={len(self.uploaded)} unchanged={self.unchanged} busy={len(self.busy)} "
                f"failed={len(self.failed)} seconds={self.seconds:.2f}"
                + (f" detail={'; '.join(self.failed)[:500]!r}" if self.failed else ""))


def _stat_key(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)


class Artifacts:
    """``root`` (the run's artifacts directory) and its copy on ``store`` (None: local only)."""

    def __init__(self, root: Path, store: GcsStore | None, *, staging: Path,
                 log: logging.Logger | None = None) -> None:
        self.root = Path(root)
        self.store = store
        self.staging = Path(staging)  # on the same disk as root, never listed as an artifact
        self.log = log or logging.getLogger("trainer.artifacts")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a full or read-only run dir: the task finds no directory, the run goes on
            self.log.warning("event=artifacts_dir ok=0 path=%s error=%r (the run goes on; the task cannot keep "
                             "files there until the disk takes writes again)", self.root, e)
        self._lock = threading.Lock()  # one copy at a time
        self._thread: threading.Thread | None = None
        self._wanted = threading.Event()
        self._abort = threading.Event()  # stops a copy in flight (an emergency save goes first)
        self._paused = False  # after abort(): no more background copies
        self._closed = False
        self._crc: dict[str, tuple[tuple[int, int, int, int], str]] = {}  # name -> (stat key, crc)

    # ------------------------------------------------------------------------------ restore
    def restore(self) -> int:
        """Download the objects this directory lacks (a fresh disk); the number downloaded.
        A GCS failure is logged, never raised: artifacts never stop a run from starting."""
        if self.store is None:
            return 0
        got = 0
        try:
            with self.store.deadline(time.monotonic() + RESTORE_LIST_TIMEOUT_S):
                remote = self.store.objects(PREFIX)
            for key in sorted(remote):
                name = key[len(PREFIX):]
                if not _plain(name):
                    continue
                dst = self.root / name
                if dst.exists():
                    continue
                self.store.get_file(key, dst)
                got += 1
        except Exception as e:  # noqa: BLE001
            self.log.warning("event=artifacts_restore ok=0 downloaded=%d error=%s: %s", got, type(e).__name__, e)
            return got
        if got:
            self.log.info("event=artifacts_restore ok=1 downloaded=%d from=%s", got, self.store.location(DIR))
        return got

    # ------------------------------------------------------------------------------ sync
    def sync(self, deadline: float | None = None, *, background: bool = False) -> SyncReport:
        """Copy new and changed files now (see the module docstring); ``deadline``
        (time.monotonic) bounds the GCS calls. Never raises."""
        report = SyncReport()
        if self.store is None:
            return report
        t0 = time.monotonic()
        if not self._lock.acquire(timeout=-1 if deadline is None else max(0.0, deadline - t0)):
            report.failed.append("another copy was still running at the deadline")
            return report
        try:
            if background and self._paused:
                return report
            if not background:
                self._abort.clear()  # the aborted copy has let go of the lock: it is over
            stage = self.staging / f"{TMP_PREFIX}artifacts-{uuid.uuid4().hex[:8]}"
            try:
                with self.store.deadline(deadline), self.store.aborting(self._abort):
                    remote = self.store.objects(PREFIX)
                    for name in self._files():
                        if deadline is not None and time.monotonic() > deadline:
                            report.failed.append(f"{name}: no time left")
                            continue
                        self._one(name, remote.get(PREFIX + name), stage, report)
            except Exception as e:  # noqa: BLE001 - the listing failed: nothing copied this time
                report.failed.append(f"listing {self.store.location(DIR)}: {type(e).__name__}: {e}")
            finally:
                shutil.rmtree(stage, ignore_errors=True)
        finally:
            self._lock.release()
        report.seconds = time.monotonic() - t0
        if report.uploaded or report.failed or report.busy:
            (self.log.warning if report.failed else self.log.info)("event=artifacts_sync %s", report.line())
        return report

    def _files(self) -> list[str]:
        out = []
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith(TMP_PREFIX))
            rel = Path(dirpath).relative_to(self.root)
            for f in sorted(filenames):
                name = f if str(rel) == "." else f"{rel.as_posix()}/{f}"
                if _plain(name) and os.path.isfile(os.path.join(dirpath, f)):
                    out.append(name)
        return out

    def _one(self, name: str, remote: Any, stage: Path, report: SyncReport) -> None:
        path = self.root / name
        try:
            before = _stat_key(path.stat())
            cached = self._crc.get(name)
            if cached is not None and cached[0] == before and remote is not None and remote.crc32c == cached[1]:
                report.unchanged += 1
                return
            stage.mkdir(parents=True, exist_ok=True)
            copy = stage / uuid.uuid4().hex
            crc = _copy_with_crc(path, copy)
            if _stat_key(path.stat()) != before:
                report.busy.append(name)  # written while we read it: a torn copy, thrown away
                return
            self._crc[name] = (before, crc)
            if remote is not None and remote.crc32c == crc:
                report.unchanged += 1
                return
            assert self.store is not None
            self.store.put_file(copy, PREFIX + name, generation=remote.generation if remote else 0)
            report.uploaded.append(name)
        except FileNotFoundError:
            pass  # removed (or renamed) since the walk: nothing to copy
        except FileExistsError:
            report.failed.append(f"{name}: the object changed since it was listed (another writer); not replaced")
        except Exception as e:  # noqa: BLE001
            report.failed.append(f"{name}: {type(e).__name__}: {e}")

    # ------------------------------------------------------------------------------ background
    def sync_soon(self, after: Callable[[], None] | None = None) -> None:
        """Ask for a copy in the background; ``after`` runs first (waiting for the checkpoint
        save in flight). A request while one runs makes it run once more."""
        if self.store is None or self._closed or self._paused:
            return
        self._wanted.set()
        if self._thread is not None and self._thread.is_alive():
            return

        def loop() -> None:
            while self._wanted.is_set() and not self._closed:
                self._wanted.clear()
                if after is not None:
                    with contextlib.suppress(Exception):
                        after()
                self.sync(background=True)

        self._thread = threading.Thread(target=loop, name="artifacts-sync", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the background copy; True when none is running any more."""
        th = self._thread
        if th is not None:
            th.join(timeout)
        return not self.busy

    def abort(self) -> None:
        """The process is about to stop (a preemption notice): the background copy in flight stops
        at its next chunk or retry (an unfinished upload creates no object) and none starts again.
        Returns at once; a later ``sync()`` (with what time is left) waits for the lock."""
        self._paused = True
        self._wanted.clear()
        self._abort.set()

    def close(self) -> None:
        """No new background copies; one in flight is left to finish (or to die with the
        process: an unfinished upload creates no object)."""
        self._closed = True


def _plain(name: str) -> bool:
    return not any(part.startswith(TMP_PREFIX) for part in name.split("/"))


def _copy_with_crc(src: Path, dst: Path) -> str:
    import google_crc32c

    c = google_crc32c.Checksum()
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        while chunk := fin.read(_CHUNK):
            c.update(chunk)
            fout.write(chunk)
    return base64.b64encode(c.digest()).decode()
