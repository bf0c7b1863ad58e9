"""Staging: a `gs://` prefix copied onto a local disk before training, verified and resumable.

``python -m trainer stage --from gs://BUCKET/PREFIX --to DIR`` mirrors every object under the
prefix into ``DIR`` (object ``PREFIX/a/b.bin`` becomes ``DIR/a/b.bin``) with the real
google-cloud-storage client:

- **verified**: each file's size and CRC32C (MD5 for an object without one) must equal the
  object's metadata from the listing, computed on the bytes as they arrive (``raw_download``: no
  decompressive transcoding, so the bytes are the stored ones);
- **atomic per file**: bytes go to a temporary file under ``DIR/.spottrain-staging/tmp/``, which
  is fsynced and renamed into place only once verified; then a line is appended (and fsynced) to
  ``DIR/.spottrain-staging/manifest.jsonl``. A partial file never has its final name, and a
  file without its manifest line never counts;
- **resumable**: a later run (a reboot, a VM recreated with the same disk) skips every file whose
  manifest line matches the object's generation, size and checksum and whose local size and
  mtime still match what was written (``--rehash`` also recomputes its CRC32C). Anything else
  (a missing, truncated or rewritten file, an object whose generation changed) is downloaded
  again; files this stager put there whose objects are gone are removed;
- **parallel**: ``--parallel`` downloads at once; objects larger than ``SLICE_BYTES`` are fetched
  as ranged slices into one file, their CRC32Cs combined;
- **bounded retries** (``trainer.retry``'s rule): 429, 5xx and connection errors are retried
  with jittered backoff for ``retry_timeout_s``; a 403 is retried within ``forbidden_retry_s``
  of the first try (default 600 s, doubling waits from 5 s to a minute): the VM's read grant on
  the data bucket can take minutes to propagate after the deploy created it. Each download is
  pinned to the listed generation; an object that changes while staging is listed and fetched
  again (a few rounds at most).

With ``--run-dir`` the run's goodput ledger gets one ``staging`` event (seconds, bytes,
downloaded bytes, files, ok), reported as ``staging_s``: staging is badput of its own. With
``--health-port`` the managed instance group's health check is answered while staging:
``ok staging`` while bytes arrive, ``starting`` before the first one, ``stalled`` once none has
arrived for ``stall_timeout_s``.

Exit status: 0 staged and verified; 1 failed (network or permission past the retries, a download
that never verified, a disk error): run it again, it resumes; 2 bad input (the source or the
directory, an object name that cannot be a file, an empty prefix, a dataset that does not fit).
"""
from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import sys
import threading
import time
import uuid
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from trainer import retry, untrusted
from trainer.checkpoint import crc32c
from trainer.checkpoint.stores import fsync_dir, is_retryable, parse_gcs_uri

log = logging.getLogger("trainer.staging")

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
#: The stager's own folder inside the destination: the manifest and the temporary files.
STATE_DIR = ".spottrain-staging"
MANIFEST = "manifest.jsonl"
#: Objects larger than this are downloaded as ranged slices of this size, in parallel.
SLICE_BYTES = 32 << 20
#: Rounds of list-then-download before giving up on a bucket that keeps changing under us.
MAX_ROUNDS = 3
#: Attempts at one object whose bytes do not verify before staging fails.
MAX_VERIFY_ATTEMPTS = 3
_CHUNK = 1 << 20


class StagingInputError(Exception):
    """Bad input (exit 2): the message says what and what is allowed."""


class StagingError(Exception):
    """Staging failed (exit 1); running it again resumes."""


class _Changed(Exception):
    """An object changed or vanished while it was being downloaded: list it again."""


# --- what is in the bucket and what is on the disk --------------------------------------------
@dataclass(frozen=True)
class Remote:
    """One object as listed."""

    key: str  # path relative to the prefix, the file's path relative to the destination
    name: str  # full object name
    generation: int
    size: int
    crc32c: str | None
    md5: str | None

    def identity(self) -> dict[str, Any]:
        return {"key": self.key, "generation": self.generation, "size": self.size,
                "crc32c": self.crc32c, "md5": self.md5}


def _check_key(key: str, name: str) -> str:
    parts = key.split("/")
    bad = (not key or any(p in ("", ".", "..") for p in parts) or parts[0] == STATE_DIR
           or any(ord(c) < 32 or c == "\x7f" for c in key) or any(len(p.encode()) > 255 for p in parts))
    if bad:
        raise StagingInputError(
            f"object {name!r} cannot be staged as a file (its name below the prefix is {key!r}); "
            f"allowed: names of /-separated parts, none empty, '.', '..' or longer than 255 bytes, "
            f"no control characters, not starting with {STATE_DIR}/")
    return key


def _conflicts(keys: list[str]) -> None:
    """A name that is both a file and a folder ("a" and "a/b") cannot be staged."""
    files = set(keys)
    for k in keys:
        parts = k.split("/")
        for i in range(1, len(parts)):
            parent = "/".join(parts[:i])
            if parent in files:
                raise StagingInputError(f"objects {parent!r} and {k!r} need {parent!r} to be both a "
                                        "file and a folder; allowed: names where no object is a "
                                        "folder of another")


class Manifest:
    """The append-only record of verified files; the last line for a key wins; a line torn by a
    kill is skipped."""

    def __init__(self, state_dir: Path, source: str) -> None:
        self.path = state_dir / MANIFEST
        self.source = source
        self.entries: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            raw = b""
        for line in raw.split(b"\n"):
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if isinstance(e, dict) and isinstance(e.get("key"), str):
                if e.get("removed"):
                    self.entries.pop(e["key"], None)
                else:
                    self.entries[e["key"]] = e
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        if raw and not raw.endswith(b"\n"):
            os.write(self._fd, b"\n")  # after a torn line, the next one starts fresh

    def _append(self, entry: dict[str, Any]) -> None:
        with self._lock:
            os.write(self._fd, (json.dumps(entry, sort_keys=True) + "\n").encode())
            os.fsync(self._fd)

    def verified(self, r: Remote, st: os.stat_result) -> None:
        entry = {"source": self.source, **r.identity(), "mtime_ns": st.st_mtime_ns, "ino": st.st_ino}
        self._append(entry)
        with self._lock:
            self.entries[r.key] = entry

    def removed(self, key: str) -> None:
        self._append({"key": key, "removed": True})
        with self._lock:
            self.entries.pop(key, None)

    def matches(self, r: Remote, path: Path, rehash: bool) -> bool:
        """Staged earlier and untouched since: the manifest line names this very object (same
        source, generation, size, checksum) and the file still has the size, mtime and inode it
        had when it was verified (and, with ``rehash``, still its CRC32C)."""
        e = self.entries.get(r.key)
        if e is None or e.get("source") != self.source:
            return False
        if any(e.get(k) != v for k, v in r.identity().items()):
            return False
        try:
            st = path.stat()
        except OSError:
            return False
        if (st.st_size, st.st_mtime_ns, st.st_ino) != (r.size, e.get("mtime_ns"), e.get("ino")):
            return False
        if rehash and r.crc32c is not None:
            return crc32c.b64(crc32c.of_file(path)) == r.crc32c
        return True

    def compact(self) -> None:
        """Rewrite the manifest with one line per current entry (atomic)."""
        tmp = self.path.with_name(f".{MANIFEST}.{uuid.uuid4().hex[:8]}")
        with open(tmp, "wb") as f:
            for key in sorted(self.entries):
                f.write((json.dumps(self.entries[key], sort_keys=True) + "\n").encode())
            f.flush()
            os.fsync(f.fileno())
        with self._lock:
            os.replace(tmp, self.path)
            os.close(self._fd)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        fsync_dir(self.path.parent)

    def close(self) -> None:
        os.close(self._fd)


# --- health while staging ----------------------------------------------------------------------
class StagingHealth:
    """What the health server answers while staging (see the module docstring)."""

    def __init__(self, stall_timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.stall_timeout_s = stall_timeout_s
        self.clock = clock
        self.last_progress: float | None = None

    def progress(self) -> None:
        self.last_progress = self.clock()

    def answer(self) -> str:
        if self.last_progress is None:
            return "starting"
        return "stalled" if self.clock() - self.last_progress > self.stall_timeout_s else "ok staging"


# --- the stager --------------------------------------------------------------------------------
@dataclass
class Result:
    files: int = 0
    bytes: int = 0
    downloaded_files: int = 0
    downloaded_bytes: int = 0
    removed_files: int = 0
    rounds: int = 0
    seconds: float = 0.0


@dataclass
class _Job:
    """One object being downloaded: its slices, their CRC32Cs, the open temporary file."""

    remote: Remote
    tmp: Path
    fd: int
    slices: list[tuple[int, int]]
    crcs: dict[int, int] = field(default_factory=dict)  # slice start -> crc32c of the slice
    md5: Any = None
    left: int = 0
    attempts: int = 1
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Writer:
    """A file-like target for ``download_to_file``: writes at an offset and checksums as it goes.

    The client hands over 8 KiB at a time; they are gathered into 1 MiB blocks, so that the
    syscall, the CRC32C and the progress count run per block (``flush()`` writes the rest)."""

    BLOCK = 1 << 20

    def __init__(self, fd: int, offset: int, md5: Any, progress: Callable[[int], None]) -> None:
        self.fd, self.offset, self.crc, self.md5, self.n = fd, offset, 0, md5, 0
        self._progress = progress
        self._buf = bytearray()

    def write(self, data: bytes) -> int:
        self._buf += data
        if len(self._buf) >= self.BLOCK:
            self.flush()
        return len(data)

    def flush(self) -> None:
        import google_crc32c

        if not self._buf:
            return
        data, self._buf = bytes(self._buf), bytearray()
        view = memoryview(data)
        while view:
            written = os.pwrite(self.fd, view, self.offset)
            self.offset += written
            view = view[written:]
        self.crc = google_crc32c.extend(self.crc, data)
        if self.md5 is not None:
            self.md5.update(data)
        self.n += len(data)
        self._progress(len(data))


class Stager:
    def __init__(self, source: str, dest: Path, *, client: Any = None, parallel: int = 16,
                 slice_bytes: int = SLICE_BYTES, rehash: bool = False,
                 forbidden_retry_s: float = retry.IAM_GRANT.grace_s,
                 forbidden_first_wait_s: float = retry.IAM_GRANT.grace_first_s,
                 retry_timeout_s: float = retry.STORAGE.deadline_s or 0.0,
                 initial_backoff_s: float = retry.STORAGE.first_s,
                 max_backoff_s: float = retry.STORAGE.cap_s, request_timeout_s: float = 120.0,
                 health: StagingHealth | None = None) -> None:
        try:
            self.bucket_name, prefix = parse_gcs_uri(source)
        except ValueError as e:
            raise StagingInputError(f"--from: {e}; allowed: gs://BUCKET/PREFIX") from None
        if parallel < 1:
            raise StagingInputError(f"--parallel: {parallel}; allowed: 1 or more")
        self.source = f"gs://{self.bucket_name}/{prefix}" if prefix else f"gs://{self.bucket_name}"
        self.prefix = prefix
        self.dest = Path(dest)
        self.parallel = parallel
        self.slice_bytes = max(1 << 20, slice_bytes)
        self.rehash = rehash
        self.forbidden_retry_s = forbidden_retry_s
        self.forbidden_first_wait_s = forbidden_first_wait_s
        self.retry_timeout_s = retry_timeout_s
        self.initial_backoff_s = initial_backoff_s
        self.max_backoff_s = max_backoff_s
        self.request_timeout_s = request_timeout_s
        self.health = health
        self._client = client
        self._abort = threading.Event()
        self._moved = 0
        self._moved_lock = threading.Lock()

    # -- the client --------------------------------------------------------------------------
    def _bucket(self) -> Any:
        if self._client is None:
            from trainer.checkpoint.stores import default_gcs_client

            self._client = default_gcs_client()
            # One pooled connection per download thread (requests keeps 10 by default and
            # discards the rest after each use).
            import requests

            adapter = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=self.parallel + 2)
            self._client._http.mount("https://", adapter)
            self._client._http.mount("http://", adapter)
        return self._client.bucket(self.bucket_name)

    def _progress(self, n: int) -> None:
        with self._moved_lock:
            self._moved += n
        if self.health is not None:
            self.health.progress()

    def _retry(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` retried by ``STORAGE``'s rule (trainer.retry): transient errors for
        ``retry_timeout_s``, a 403 (a grant still propagating) within ``forbidden_retry_s``."""
        from google.api_core import exceptions as gexc

        def said(t: retry.Try) -> None:
            if t.forbidden:
                log.warning("event=staging_retry what=%r status=403 waited_s=%.0f retry_in_s=%.1f "
                            "(the bucket grant may still be propagating)", what, t.elapsed_s, t.wait_s)
            else:
                log.warning("event=staging_retry what=%r attempt=%d error=%r retry_in_s=%.1f", what,
                            t.attempt, f"{type(t.error).__name__}: {str(t.error)[:200]}", t.wait_s)

        def gave_up(t: retry.Try) -> None:
            if isinstance(t.error, (gexc.NotFound, gexc.PreconditionFailed)):
                raise _Changed(str(t.error)) from None
            if t.why == "forbidden":
                raise StagingError(
                    f"{what}: still HTTP 403 after {t.elapsed_s:.0f} s: this VM's service account "
                    f"cannot read gs://{self.bucket_name} (a new grant takes up to ~7 minutes "
                    f"to propagate; this one did not arrive in {self.forbidden_retry_s:g} s)") from None
            if t.why == "final":
                raise StagingError(f"{what}: {type(t.error).__name__}: {t.error}") from None
            raise StagingError(f"{what}: gave up after {t.attempt} attempts in "
                               f"{t.elapsed_s:.0f} s: {type(t.error).__name__}: {t.error}") from None

        policy = dataclasses.replace(retry.STORAGE, first_s=self.initial_backoff_s, cap_s=self.max_backoff_s,
                                     deadline_s=self.retry_timeout_s, grace_s=self.forbidden_retry_s,
                                     grace_first_s=self.forbidden_first_wait_s)
        try:
            return retry.Retry(policy, transient=is_retryable, abort=self._abort, on_retry=said,
                               on_give_up=gave_up).call(fn, what)
        except retry.Aborted:
            raise StagingError(f"{what}: stopped (another download failed)") from None

    def remotes(self) -> list[Remote]:
        bucket = self._bucket()
        full = f"{self.prefix}/" if self.prefix else ""

        def listing() -> list[Any]:
            return list(self._client.list_blobs(bucket, prefix=full, retry=None,
                                                timeout=self.request_timeout_s))

        try:
            blobs = self._retry(f"list {self.source}/", listing)
        except _Changed as e:  # 404: the bucket itself does not exist
            raise StagingInputError(f"--from: gs://{self.bucket_name} does not exist ({e}); "
                                    "allowed: an existing bucket") from None
        out = []
        for b in blobs:
            if b.name.endswith("/"):
                if int(b.size or 0) == 0:
                    continue  # a folder placeholder made by the console or a tool
                raise StagingInputError(f"object {b.name!r} ends with '/' but holds {b.size} bytes; "
                                        "allowed: folder placeholders of 0 bytes only")
            key = _check_key(b.name[len(full):], b.name)
            out.append(Remote(key, b.name, int(b.generation), int(b.size or 0), b.crc32c, b.md5_hash))
        _conflicts([r.key for r in out])
        return sorted(out, key=lambda r: r.key)

    # -- staging -----------------------------------------------------------------------------
    def _prepare_dest(self) -> Path:
        if self.dest.exists() and not self.dest.is_dir():
            raise StagingInputError(f"--to: {self.dest} exists and is not a directory; allowed: a "
                                    "directory (created if missing)")
        try:
            self.dest.mkdir(parents=True, exist_ok=True)
            state = self.dest / STATE_DIR
            state.mkdir(exist_ok=True)
            tmp = state / "tmp"
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a killed run: never valid
            tmp.mkdir()
        except OSError as e:
            raise StagingInputError(f"--to: cannot use {self.dest}: {e.strerror}; allowed: a "
                                    "writable directory") from None
        return state

    def run(self) -> Result:
        t0 = time.monotonic()
        state = self._prepare_dest()
        manifest = Manifest(state, self.source)
        result = Result()
        try:
            for rnd in range(1, MAX_ROUNDS + 1):
                result.rounds = rnd
                remote = self.remotes()
                if not remote:
                    raise StagingInputError(f"--from: no objects under {self.source}/; allowed: a "
                                            "prefix holding your data")
                wanted = {r.key for r in remote}
                for key in sorted(set(manifest.entries) - wanted):  # objects gone from the bucket
                    with contextlib.suppress(FileNotFoundError):
                        (self.dest / key).unlink()
                    manifest.removed(key)
                    result.removed_files += 1
                todo = [r for r in remote if not manifest.matches(r, self.dest / r.key, self.rehash)]
                self._check_space(todo)
                log.info("event=staging_plan source=%s dest=%s objects=%d bytes=%d to_download=%d "
                         "to_download_bytes=%d round=%d", self.source, self.dest, len(remote),
                         sum(r.size for r in remote), len(todo), sum(r.size for r in todo), rnd)
                changed = self._download(todo, state / "tmp", manifest, result)
                # Done when nothing changed under us: the listing now is what we staged.
                if not changed and [(r.key, r.generation) for r in self.remotes()] == \
                        [(r.key, r.generation) for r in remote]:
                    result.files, result.bytes = len(remote), sum(r.size for r in remote)
                    manifest.compact()
                    result.seconds = time.monotonic() - t0
                    return result
                log.warning("event=staging_changed round=%d (objects changed while staging; listing "
                            "again)", rnd)
            raise StagingError(f"{self.source}/ kept changing while it was staged ({MAX_ROUNDS} "
                               "rounds); stage it again once nothing writes to it")
        finally:
            manifest.close()
            shutil.rmtree(state / "tmp", ignore_errors=True)

    def _check_space(self, todo: list[Remote]) -> None:
        need = sum(r.size for r in todo)
        st = os.statvfs(self.dest)
        free = st.f_bavail * st.f_frsize
        if need > free:
            raise StagingInputError(
                f"--to: {need / 1e9:.2f} GB to download into {self.dest}, which has {free / 1e9:.2f} "
                "GB free; allowed: a larger disk (local SSDs, or disk.checkpoint_disk_gb) or less data")

    def _download(self, todo: list[Remote], tmp_dir: Path, manifest: Manifest, result: Result) -> bool:
        """Download ``todo``; True when some object changed or vanished meanwhile."""
        if not todo:
            return False
        jobs: list[_Job] = []
        units: list[tuple[_Job, int, int]] = []
        changed = threading.Event()
        for r in todo:
            slices = [(s, min(s + self.slice_bytes, r.size)) for s in range(0, r.size, self.slice_bytes)] \
                if r.crc32c is not None and r.size > self.slice_bytes else [(0, r.size)]
            job = _Job(r, tmp_dir / uuid.uuid4().hex, -1, slices,
                       md5=hashlib.md5() if r.crc32c is None and r.md5 else None, left=len(slices))
            jobs.append(job)
            units += [(job, s, e) for s, e in slices]
        bucket = self._bucket()
        # Verifying, fsyncing and renaming a finished file runs beside the downloads, so that the
        # next object's bytes flow while the last one's reach the disk.
        finishers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="stage-finish")
        finishing: list[Any] = []

        def finish(job: _Job) -> None:
            try:
                self._finish(job, manifest, result)
            except _Changed as e:
                log.warning("event=staging_object_changed object=%s error=%s", untrusted.shown(job.remote.name),
                            untrusted.shown(str(e)[:200]))
                changed.set()

        def unit(job: _Job, start: int, end: int) -> None:
            try:
                with job.lock:  # opened when its first slice starts: a million objects, few fds
                    if job.fd < 0:
                        job.fd = os.open(job.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                self._fetch(bucket, job, start, end)
                with job.lock:
                    job.left -= 1
                    last = job.left == 0
                if last:
                    finishing.append(finishers.submit(finish, job))
            except _Changed as e:  # pinned to the listed generation: the next round lists it again
                log.warning("event=staging_object_changed object=%s error=%s", untrusted.shown(job.remote.name),
                            untrusted.shown(str(e)[:200]))
                changed.set()

        def first_failure(futures: list[Any]) -> BaseException | None:
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            failed = [f for f in done if f.exception() is not None]
            return failed[0].exception() if failed else None

        try:
            with ThreadPoolExecutor(max_workers=self.parallel, thread_name_prefix="stage") as pool:
                futures = [pool.submit(unit, *u) for u in units]
                error = first_failure(futures)
                if error is not None:
                    self._abort.set()
                    wait(futures)
            error = error or first_failure(list(finishing))
            if error is not None:
                self._abort.set()
                raise error
        finally:
            finishers.shutdown(wait=True)
            for job in jobs:
                if job.fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(job.fd)
                job.tmp.unlink(missing_ok=True)
        return changed.is_set()

    def _fetch(self, bucket: Any, job: _Job, start: int, end: int) -> None:
        r = job.remote
        if end <= start:  # an empty object
            job.crcs[start] = 0
            return
        whole = (start, end) == (0, r.size)

        def attempt() -> None:
            w = _Writer(job.fd, start, hashlib.md5() if job.md5 is not None else None, self._progress)
            blob = bucket.blob(r.name)
            kwargs: dict[str, Any] = {} if whole else {"start": start, "end": end - 1}
            blob.download_to_file(w, raw_download=True, checksum=None, if_generation_match=r.generation,
                                  retry=None, timeout=self.request_timeout_s, **kwargs)
            w.flush()
            if w.n != end - start:
                raise _ShortRead(f"{r.name} bytes {start}-{end}: got {w.n} bytes")
            job.crcs[start] = w.crc
            if w.md5 is not None:
                job.md5 = w.md5

        self._retry(f"download {r.name}" + ("" if whole else f" bytes {start}-{end}"), attempt)

    def _finish(self, job: _Job, manifest: Manifest, result: Result) -> None:
        r = job.remote
        crc = 0
        for s, e in job.slices:
            crc = crc32c.combine(crc, job.crcs[s], e - s)
        got_crc = crc32c.b64(crc)
        ok = (r.crc32c is None or got_crc == r.crc32c) and \
            (r.crc32c is not None or r.md5 is None or base64.b64encode(job.md5.digest()).decode() == r.md5)
        if not ok:
            attempts = job.attempts
            if attempts >= MAX_VERIFY_ATTEMPTS:
                raise StagingError(f"{self.source}/{r.key}: downloaded {attempts} times and never "
                                   f"verified (crc32c {got_crc}, object says {r.crc32c})")
            # The object's name and its crc32c are the data bucket's text: quoted (untrusted.shown).
            log.warning("event=staging_corrupt object=%s crc32c=%s expected=%s attempt=%d; downloading "
                        "again", untrusted.shown(r.name), got_crc, untrusted.shown(r.crc32c), attempts)
            job.attempts = attempts + 1
            bucket = self._bucket()
            for s, e in job.slices:
                self._fetch(bucket, job, s, e)
            return self._finish(job, manifest, result)
        os.ftruncate(job.fd, r.size)
        os.fsync(job.fd)
        os.close(job.fd)
        job.fd = -1
        dst = self.dest / r.key
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.replace(job.tmp, dst)
        fsync_dir(dst.parent)
        manifest.verified(r, dst.stat())
        with self._moved_lock:
            result.downloaded_files += 1
            result.downloaded_bytes += r.size


class _ShortRead(ConnectionError):
    """The connection ended before the object's bytes did: retried like any transport error."""


# --- the command -------------------------------------------------------------------------------
def record(run_dir: Path, source: str, started: float, result: Result | None, ok: bool,
           error: str | None = None) -> None:
    """The ``staging`` event in the run's goodput ledger (see trainer.observe.ledger)."""
    from trainer.observe.ledger import Ledger, node_name

    ledger = Ledger(run_dir)
    r = result or Result()
    ledger.append("staging", started=started, seconds=time.time() - started, ok=ok, source=source,
                  files=r.files, bytes=r.bytes, downloaded_files=r.downloaded_files,
                  downloaded_bytes=r.downloaded_bytes, removed_files=r.removed_files, node=node_name(),
                  **({"error": error} if error else {}))
    ledger.close()


def main(args: Any) -> int:
    """``python -m trainer stage`` (arguments from trainer.cli)."""
    from trainer.observe.progress import setup_logging

    setup_logging()
    started = time.time()
    server = None
    health = StagingHealth(args.stall_timeout_s)
    result: Result | None = None
    code, error = EXIT_FAILED, None
    try:
        stager = Stager(args.source, args.dest, parallel=args.parallel, rehash=args.rehash,
                        forbidden_retry_s=args.forbidden_retry_s, health=health)
        if args.health_port is not None:
            from trainer.observe.health import HealthServer

            server = HealthServer(health, host="0.0.0.0", port=args.health_port).start()  # type: ignore[arg-type]
        result = stager.run()
        code = EXIT_OK
        mb_s = result.downloaded_bytes / 1e6 / result.seconds if result.seconds > 0 else 0.0
        log.info("event=staging_done source=%s dest=%s files=%d bytes=%d downloaded_files=%d "
                 "downloaded_bytes=%d removed_files=%d seconds=%.2f MB_s=%.1f", stager.source, args.dest,
                 result.files, result.bytes, result.downloaded_files, result.downloaded_bytes,
                 result.removed_files, result.seconds, mb_s)
    except StagingInputError as e:
        code, error = EXIT_BAD_INPUT, str(e)
        print(f"command line: {e}", file=sys.stderr)
    except (StagingError, OSError) as e:
        code, error = EXIT_FAILED, f"{type(e).__name__}: {e}" if isinstance(e, OSError) else str(e)
        log.error("event=staging_failed error=%r (run it again: it resumes)", error)
    finally:
        if server is not None:
            server.close()
    if args.run_dir is not None:
        try:
            record(args.run_dir, args.source, started, result, code == EXIT_OK, error)
        except OSError as e:
            log.warning("event=ledger ok=0 error=%r", str(e))
    return code


def iter_files(root: Path) -> Iterator[Path]:
    """The staged files under ``root`` (the stager's own folder excluded), sorted."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not (Path(dirpath) == root and d == STATE_DIR))
        for f in sorted(filenames):
            yield Path(dirpath) / f
