"""Blob stores for the checkpoint tiers: a directory on a local/persistent disk and a GCS prefix.

This module owns the durability primitives every tier relies on:

* ``DirStore``: keys are relative paths under a root directory. Every write goes to a temporary
  name in the same directory, is fsynced, and becomes visible by an atomic ``link``/``rename``,
  after which the directory itself is fsynced, so a crash leaves either the old state or the
  complete new file, never a torn one. Temporary names start with ``.tmp-`` and are never listed.
* ``GcsStore``: keys are object names under ``gs://bucket/prefix/``. Objects are immutable:
  uploads are create-only (``if_generation_match=0``). Calls are retried with exponential backoff
  and jitter on 429, 5xx and connection errors. A 412 on a create-only upload means the object
  already exists (typically our own earlier attempt whose response was lost): it counts as done
  when the existing object is identical (size and CRC32C), otherwise it is an error. Every write
  and delete first asks the store's ``guard`` (the job's writer lease, ``trainer.checkpoint.lease``), which
  raises when this process may not write the prefix; the lease's own object is written through
  the generation-conditional calls, which the guard does not cover. An object of
  ``PARALLEL_MIN_BYTES`` or more moves over ``streams`` connections at once (a sliced download,
  a composite upload: ``trainer.checkpoint.gcs_streams``) with the same rules; the parts of a
  composite upload wait under ``.tmp-parts/``, which listings never show and
  ``clean_temporaries`` empties.

Both implement the small ``Store`` protocol the checkpointer and the goodput ledger use.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import random
import re
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any, BinaryIO, Callable, ContextManager, Iterator, Protocol, TypeVar, runtime_checkable

from trainer import retry
from trainer.checkpoint import crc32c, gcs_streams
from trainer.checkpoint.objects import ObjectInfo, UploadAborted

log = logging.getLogger(__name__)

T = TypeVar("T")

TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
_COPY_CHUNK = 16 << 20


#: Modules of the GCS client stack that draw from the global `random` (multipart boundaries,
#: backoff jitter). Uploads run on background threads at moments that differ between runs, so
#: each draw would shift the training process's Python RNG and break exact resume for any task
#: that uses `random`.
_GLOBAL_RANDOM_USERS = (
    "google.cloud.storage._media._upload",
    "google.resumable_media._upload",
    "google.resumable_media._helpers",
    "google.api_core.retry.retry_base",
    "google.auth._exponential_backoff",
    "urllib3.util.retry",
)


def _isolate_client_randomness() -> None:
    """Give each of those modules a private generator in place of the global one."""
    import importlib

    for name in _GLOBAL_RANDOM_USERS:
        try:
            module: Any = importlib.import_module(name)  # its attribute ``random`` is replaced
        except ImportError:
            continue
        if getattr(module, "random", None) is random:
            module.random = random.Random()  # same methods: randrange, randint, uniform, random


@runtime_checkable
class Store(Protocol):
    """One tier's blob store. Keys use ``/`` separators and never start with ``/``.

    Whatever a tier asks of its store goes through this interface, never through the store's
    type: where a key is (``location``), whether keys are files on this machine (``folder``: a
    directory store's path, None for a bucket), how long calls may take in this block of this
    thread (``deadline``) and when they stop (``aborting``), and what an interrupted write left
    behind (``clean_temporaries``: temporary files, or the parts of a composite upload)."""

    name: str

    def location(self, key: str = "") -> str: ...
    def folder(self, key: str = "") -> Path | None: ...
    def put_file(self, src: Path, key: str) -> None: ...
    def put_memory(self, key: str, data: memoryview | bytes) -> None: ...
    def put_bytes(self, key: str, data: bytes, *, overwrite: bool = False) -> None: ...
    def get_bytes(self, key: str) -> bytes: ...
    def get_file(self, key: str, dst: Path) -> None: ...
    def names(self, prefix: str) -> list[str]: ...
    def sizes(self, prefix: str) -> dict[str, int]: ...
    def delete(self, key: str) -> None: ...
    def delete_prefix(self, prefix: str) -> None: ...
    def deadline(self, deadline: float | None) -> ContextManager[None]: ...
    def aborting(self, event: threading.Event | None) -> ContextManager[None]: ...
    def clean_temporaries(self) -> list[str]: ...


def is_unreachable(exc: BaseException) -> bool:
    """The store did not answer what it holds (a refused, failed or unauthorised request), as
    opposed to an answer about the data: a tier in this state is unknown, not empty."""
    if isinstance(exc, (KeyError, UploadAborted)):
        return False
    try:
        from google.api_core import exceptions as gexc

        if isinstance(exc, gexc.GoogleAPIError) and not isinstance(exc, gexc.NotFound):
            return True
    except ImportError:  # pragma: no cover
        pass
    return is_retryable(exc)


def _check_key(key: str) -> str:
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in key.split("/")):
        raise ValueError(f"invalid store key {key!r}")
    return key


def fsync_dir(path: Path) -> None:
    """fsync a directory so that a rename/link/unlink inside it is durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        n = os.write(fd, data)
        data = data[n:]


# --------------------------------------------------------------------------------------------
# Directory store
# --------------------------------------------------------------------------------------------


class DirStore:
    """A directory on a local or persistent disk (``name`` is ``"local"`` or ``"persistent"``)."""

    def __init__(self, root: Path, name: str) -> None:
        self.root = Path(root)
        self.name = name

    def __repr__(self) -> str:
        return f"DirStore({str(self.root)!r}, name={self.name!r})"

    def path(self, key: str) -> Path:
        return self.root / _check_key(key)

    def folder(self, key: str = "") -> Path:
        """Where ``key`` is on this machine (the root for "")."""
        return self.root / _check_key(key) if key else self.root

    def location(self, key: str = "") -> str:
        return str(self.folder(key))

    @contextlib.contextmanager
    def deadline(self, deadline: float | None) -> Iterator[None]:
        """Disk calls are not bounded here (a disk that hangs hangs the process anyway)."""
        yield

    @contextlib.contextmanager
    def aborting(self, event: threading.Event | None) -> Iterator[None]:
        yield

    def put_memory(self, key: str, data: memoryview | bytes) -> None:
        """``put_file`` from host memory (create-only, fsynced, atomic)."""
        dst = self.path(key)
        dst.parent.mkdir(parents=True, exist_ok=True)
        if dst.exists():
            raise FileExistsError(f"{dst} exists")
        tmp = self._tmp_sibling(dst)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _write_all(fd, memoryview(data).cast("B"))
            os.fsync(fd)
        finally:
            os.close(fd)
        self._publish(tmp, dst, overwrite=False)

    def _tmp_sibling(self, dst: Path) -> Path:
        return dst.parent / f"{TMP_PREFIX}{dst.name}-{uuid.uuid4().hex[:8]}"

    def _publish(self, tmp: Path, dst: Path, *, overwrite: bool) -> None:
        """Make the fsynced ``tmp`` visible as ``dst`` atomically (create-only unless overwrite)."""
        if overwrite:
            os.replace(tmp, dst)
        else:
            try:
                # link() fails if dst exists: an atomic create-only publish.
                os.link(tmp, dst)
            except FileExistsError:
                os.unlink(tmp)
                raise
            os.unlink(tmp)
        fsync_dir(dst.parent)

    def put_bytes(self, key: str, data: bytes, *, overwrite: bool = False) -> None:
        dst = self.path(key)
        dst.parent.mkdir(parents=True, exist_ok=True)
        if not overwrite and dst.exists():
            if dst.read_bytes() == data:
                return
            raise FileExistsError(f"{dst} exists with different content")
        tmp = self._tmp_sibling(dst)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _write_all(fd, memoryview(data))
            os.fsync(fd)
        finally:
            os.close(fd)
        self._publish(tmp, dst, overwrite=overwrite)

    def put_file(self, src: Path, key: str) -> None:
        dst = self.path(key)
        dst.parent.mkdir(parents=True, exist_ok=True)
        if dst.exists():
            if _same_file_content(Path(src), dst):
                return
            raise FileExistsError(f"{dst} exists with different content")
        tmp = self._tmp_sibling(dst)
        copy_file_durable(Path(src), tmp)
        self._publish(tmp, dst, overwrite=False)

    def get_bytes(self, key: str) -> bytes:
        try:
            return self.path(key).read_bytes()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise KeyError(key) from None

    def get_file(self, key: str, dst: Path) -> None:
        src = self.path(key)
        if not src.is_file():
            raise KeyError(key)
        dst = Path(dst)
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.parent / f"{TMP_PREFIX}{dst.name}-{uuid.uuid4().hex[:8]}"
        copy_file_durable(src, tmp)
        os.replace(tmp, dst)
        fsync_dir(dst.parent)

    def names(self, prefix: str) -> list[str]:
        """Keys starting with ``prefix`` (string prefix, as on GCS); temporary files excluded."""
        base = self.root
        head, _, _ = prefix.rpartition("/")
        start = base / head if head else base
        if not start.is_dir():
            return []
        out: list[str] = []
        for dirpath, dirnames, filenames in os.walk(start):
            dirnames[:] = [d for d in dirnames if not d.startswith((TMP_PREFIX, TRASH_PREFIX))]
            rel = Path(dirpath).relative_to(base)
            for f in filenames:
                if f.startswith((TMP_PREFIX, TRASH_PREFIX)):
                    continue
                key = f if str(rel) == "." else f"{rel.as_posix()}/{f}"
                if key.startswith(prefix):
                    out.append(key)
        return sorted(out)

    def sizes(self, prefix: str) -> dict[str, int]:
        """Key -> size for every key under ``prefix``."""
        out = {}
        for k in self.names(prefix):
            with contextlib.suppress(FileNotFoundError):
                out[k] = self.path(k).stat().st_size
        return out

    def delete_prefix(self, prefix: str) -> None:
        """Delete every key under ``prefix``; a prefix naming a folder (``a/b/``) removes it whole.

        A folder is first renamed to a ``.trash-`` name (atomic, durable), so a crash midway never
        leaves a half-deleted folder under its real name.
        """
        if prefix.endswith("/"):
            d = self.root / _check_key(prefix.rstrip("/"))
            if d.is_dir():
                trash = d.parent / f"{TRASH_PREFIX}{d.name}-{uuid.uuid4().hex[:8]}"
                os.rename(d, trash)
                fsync_dir(d.parent)
                shutil.rmtree(trash, ignore_errors=True)
                return
        for k in self.names(prefix):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path(k))

    def delete(self, key: str) -> None:
        """Delete one key (durably); absent keys are fine."""
        p = self.path(key)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)
            fsync_dir(p.parent)

    def clean_temporaries(self) -> list[str]:
        """Remove leftovers of interrupted writes/deletes in the root (never visible, never valid).
        Best effort: on a disk that takes no writes (full, read-only) they stay, harmless."""
        removed: list[str] = []
        if not self.root.is_dir():
            return removed
        for p in self.root.iterdir():
            if p.name.startswith((TMP_PREFIX, TRASH_PREFIX)):
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                    if p.exists():
                        continue
                else:
                    try:
                        p.unlink()
                    except FileNotFoundError:
                        pass
                    except OSError:
                        continue
                removed.append(p.name)
        return removed


def copy_file_durable(src: Path, dst: Path) -> None:
    """Copy ``src`` to a new file ``dst`` and fsync it (the caller publishes it)."""
    with open(src, "rb") as fin:
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            buf = bytearray(_COPY_CHUNK)
            mv = memoryview(buf)
            while True:
                n = fin.readinto(buf)
                if not n:
                    break
                _write_all(fd, mv[:n])
            os.fsync(fd)
        finally:
            os.close(fd)


def _same_file_content(a: Path, b: Path) -> bool:
    if a.stat().st_size != b.stat().st_size:
        return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(_COPY_CHUNK), fb.read(_COPY_CHUNK)
            if x != y:
                return False
            if not x:
                return True


# --------------------------------------------------------------------------------------------
# GCS store
# --------------------------------------------------------------------------------------------


#: Bucket naming rules (simplified): 3-222 ASCII lowercase letters, digits, - _ . (Cloud Storage
#: refuses any other letter), starting and ending with a letter or digit.
_BUCKET = re.compile(r"[a-z0-9][-_.a-z0-9]{1,220}[a-z0-9]")


def parse_gcs_uri(uri: str) -> tuple[str, str]:
    """``gs://bucket/some/prefix`` -> ``("bucket", "some/prefix")`` (prefix may be empty)."""
    if not isinstance(uri, str) or not uri.startswith("gs://"):
        raise ValueError(f"not a gs:// URI: {uri!r}")
    rest = uri[len("gs://") :]
    bucket, _, prefix = rest.partition("/")
    prefix = prefix.strip("/")
    if not _BUCKET.fullmatch(bucket):
        raise ValueError(f"invalid bucket name in {uri!r}")
    if any(p in (".", "..") for p in prefix.split("/")) or "//" in prefix:
        raise ValueError(f"invalid object prefix in {uri!r}")
    return bucket, prefix


def default_gcs_client() -> Any:
    """A real client; against the emulator when ``STORAGE_EMULATOR_HOST`` is set."""
    import importlib

    storage: Any = importlib.import_module("google.cloud.storage")  # the client ships no types

    if os.environ.get("STORAGE_EMULATOR_HOST"):
        from google.auth.credentials import AnonymousCredentials

        project = os.environ.get("GOOGLE_CLOUD_PROJECT", "spottrain-emulator")
        return storage.Client(project=project, credentials=AnonymousCredentials())
    return storage.Client()


def is_retryable(exc: BaseException) -> bool:
    """``trainer.retry``'s rule (408, 429, 5xx, connection errors and timeouts are transient),
    with the GCS client's own transport errors."""
    import requests
    from google.auth import exceptions as auth_exc

    extra: tuple[type[BaseException], ...] = (requests.ConnectionError, requests.Timeout, auth_exc.TransportError)
    try:
        import urllib3.exceptions as u3

        extra = extra + (u3.HTTPError,)
    except ImportError:  # pragma: no cover
        pass
    return retry.transient(exc, extra)


class _MemoryReader:
    """A read-only file over a bytes-like object (no copy), for uploads from host memory."""

    def __init__(self, data: memoryview) -> None:
        self._mv, self._pos = data, 0

    def read(self, n: int = -1) -> bytes:
        end = len(self._mv) if n is None or n < 0 else min(len(self._mv), self._pos + n)
        out = bytes(self._mv[self._pos:end])
        self._pos = end
        return out

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: len(self._mv)}[whence]
        self._pos = max(0, min(len(self._mv), base + offset))
        return self._pos

    def tell(self) -> int:
        return self._pos

    def close(self) -> None:
        pass


class _AbortableReader:
    """File wrapper that stops an upload at a deadline or on abort (checked per read)."""

    def __init__(self, f: BinaryIO, deadline: float | None, aborted: Callable[[], bool]):
        self._f, self._deadline, self._aborted = f, deadline, aborted

    def _check(self) -> None:
        if self._aborted():
            raise UploadAborted("upload aborted")
        if self._deadline is not None and time.monotonic() > self._deadline:
            raise UploadAborted("deadline passed during upload")

    def read(self, n: int = -1) -> bytes:
        self._check()
        return self._f.read(n)

    def seek(self, *a: Any) -> int:
        return self._f.seek(*a)

    def tell(self) -> int:
        return self._f.tell()


class GcsStore:
    """Objects under ``gs://bucket/prefix/``; create-only uploads with retries (see module doc)."""

    #: Resumable uploads are sent in chunks of this size, so an abort/deadline is noticed quickly.
    #: 32 MiB: big enough that per-request latency is small against transfer time, small enough
    #: that an aborted upload stops within a fraction of a second.
    CHUNK_SIZE = 32 << 20  # a multiple of 256 KiB, as GCS requires
    #: Objects of this size or more move over ``streams`` connections at once; smaller ones over
    #: one (a few requests more per object would cost more than a second stream gains).
    PARALLEL_MIN_BYTES = 64 << 20
    #: The most streams of one object: a compose takes at most 32 source objects.
    MAX_STREAMS = 32
    #: The streams of one large object unless the caller says (``RunConfig.gcs_streams``).
    STREAMS = 8

    def __init__(self, uri: str, *, client: Any = None, name: str = "gcs",
                 retry_timeout_s: float = retry.STORAGE.deadline_s or 0.0,
                 initial_backoff_s: float = retry.STORAGE.first_s,
                 max_backoff_s: float = retry.STORAGE.cap_s, request_timeout_s: float = 60.0,
                 streams: int = STREAMS) -> None:
        self.uri = uri.rstrip("/")
        self.bucket_name, self.prefix = parse_gcs_uri(uri)
        self.name = name
        if not 1 <= streams <= self.MAX_STREAMS:
            raise ValueError(f"streams {streams}; allowed: 1 to {self.MAX_STREAMS}")
        #: Connections one object of ``PARALLEL_MIN_BYTES`` or more uses at once (1: one stream).
        self.streams = streams
        _isolate_client_randomness()
        if client is None:
            client = default_gcs_client()
            # A pooled connection for every stream (requests keeps 10 and drops the rest after
            # each use), beside the lease's and the mirror's.
            import requests

            adapter = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=streams + 4)
            client._http.mount("https://", adapter)
            client._http.mount("http://", adapter)
        self._client = client
        self._bucket = self._client.bucket(self.bucket_name)
        #: Give up on one call after this many seconds of retrying (unless a deadline is sooner).
        self.retry_timeout_s = retry_timeout_s
        self.initial_backoff_s = initial_backoff_s
        self.max_backoff_s = max_backoff_s
        self.request_timeout_s = request_timeout_s
        self._local = threading.local()
        #: Set to make every call of this store stop (shutdown). To stop only some calls (one
        #: upload, not the ledger mirror sharing the store) use ``aborting(event)`` instead.
        self.abort = threading.Event()
        #: Called before every write and delete; raises when this process may not write the
        #: prefix (``trainer.checkpoint.lease.Lease.check``). None: no lease (tests, ``status``).
        self.guard: Callable[[], None] | None = None

    def __repr__(self) -> str:
        return f"GcsStore({self.uri!r})"

    # -- deadline scoping ------------------------------------------------------------------
    @contextlib.contextmanager
    def deadline(self, deadline: float | None) -> Iterator[None]:
        """Within this block (this thread), calls give up at ``deadline`` (time.monotonic)."""
        old = getattr(self._local, "deadline", None)
        self._local.deadline = deadline
        try:
            yield
        finally:
            self._local.deadline = old

    def _deadline(self) -> float | None:
        return getattr(self._local, "deadline", None)

    @contextlib.contextmanager
    def aborting(self, event: threading.Event | None) -> Iterator[None]:
        """Within this block (this thread), calls stop with ``UploadAborted`` once ``event`` is
        set: between retries and between the chunks of an upload."""
        old = getattr(self._local, "abort", None)
        self._local.abort = event
        try:
            yield
        finally:
            self._local.abort = old

    def _aborted(self) -> bool:
        ev = getattr(self._local, "abort", None)
        return self.abort.is_set() or (ev is not None and ev.is_set())

    def _check_stop(self, what: str) -> None:
        """``UploadAborted`` once this block is aborted or past its deadline (between chunks)."""
        if self._aborted():
            raise UploadAborted(f"{what}: aborted")
        dl = self._deadline()
        if dl is not None and time.monotonic() > dl:
            raise UploadAborted(f"{what}: deadline passed")

    def _abort_wait(self, seconds: float) -> bool:
        ev = getattr(self._local, "abort", None)
        end = time.monotonic() + seconds
        while True:
            if self._aborted():
                return True
            left = end - time.monotonic()
            if left <= 0:
                return False
            (ev or self.abort).wait(min(left, 0.1))

    def _object(self, key: str) -> str:
        _check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def location(self, key: str = "") -> str:
        return f"gs://{self.bucket_name}/{self._object(key)}" if key else self.uri

    def folder(self, key: str = "") -> None:
        """Objects are not files on this machine: a restore downloads them."""
        return None

    #: Seconds clean_temporaries may take (a restore runs it before it looks at the tiers).
    CLEAN_S = 10.0

    def clean_temporaries(self) -> list[str]:
        """Delete the parts of composite uploads that never got composed (an upload aborted, cut
        by its deadline or by the end of its process), each at its generation; their keys. A
        restore runs it, under the writer lease, before this job uploads anything. Best effort
        within ``CLEAN_S``, its listing tried once (a bucket that does not answer is the
        restore's to wait for): what stays is removed by the next one, and is never listed."""
        removed: list[str] = []
        try:
            self._may_write()
            dl, until = self._deadline(), time.monotonic() + self.CLEAN_S
            with self.deadline(until if dl is None else min(dl, until)):
                parts = list(self._client.list_blobs(self._bucket, prefix=self._object(gcs_streams.PARTS_DIR) + "/",
                                                     retry=None, timeout=self._timeout()))
                for b in parts:
                    self._delete_at(self._key_of(b.name), int(b.generation))
                    removed.append(self._key_of(b.name))
        except Exception as e:  # noqa: BLE001 - leftovers cost storage, not correctness
            log.warning("gcs: could not remove every leftover part under %s/ (%s: %s); the next start tries again",
                        self.location(gcs_streams.PARTS_DIR), type(e).__name__, str(e)[:200])
        return removed

    def _delete_at(self, key: str, generation: int) -> None:
        """Delete ``key`` at exactly ``generation`` (guarded; gone is fine): on a versioned bucket
        no old version of it stays."""
        from google.api_core import exceptions as gexc

        self._may_write()

        def delete() -> None:
            with contextlib.suppress(gexc.NotFound):
                self._bucket.blob(self._object(key), generation=generation).delete(retry=None, timeout=self._timeout())

        self._retry(f"delete {key}", delete)

    def _streams_for(self, size: int) -> int:
        return self.streams if size >= self.PARALLEL_MIN_BYTES else 1

    def _timeout(self) -> float:
        dl = self._deadline()
        t = self.request_timeout_s
        if dl is not None:
            t = max(0.5, min(t, dl - time.monotonic()))
        return t

    def _retry(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()`` retried by ``STORAGE``'s rule (trainer.retry) until ``retry_timeout_s`` or
        this block's deadline; a 403 is final (start-up already waited for the grant)."""
        def said(t: retry.Try) -> None:
            log.warning("gcs %s failed (attempt %d: %s: %s); retrying in %.1fs",
                        what, t.attempt, type(t.error).__name__, str(t.error)[:200], t.wait_s)

        policy = dataclasses.replace(retry.STORAGE, first_s=self.initial_backoff_s, cap_s=self.max_backoff_s,
                                     deadline_s=self.retry_timeout_s)
        return retry.Retry(policy, transient=is_retryable, abort=self._aborted, deadline=self._deadline(),
                           sleep=self._abort_wait, aborted=UploadAborted, on_retry=said).call(fn, what)

    def _may_write(self) -> None:
        if self.guard is not None:
            self.guard()

    # -- Store protocol ----------------------------------------------------------------------
    def _blob(self, key: str) -> Any:
        b = self._bucket.blob(self._object(key))
        b.chunk_size = self.CHUNK_SIZE
        return b

    def put_file(self, src: Path, key: str, *, generation: int = 0) -> None:
        """Upload ``src`` to ``key``: create-only, or with ``generation`` only while the object is
        still at that generation (replacing exactly what was seen). The precondition makes the
        retries safe. A 412 whose object already holds exactly this content (our own write whose
        answer was lost) counts as done; otherwise ``FileExistsError``."""
        src = Path(src)
        size = src.stat().st_size
        if self._streams_for(size) > 1:
            self._may_write()
            gcs_streams.upload(self, key, gcs_streams.range_of_file(src), size, generation=generation,
                               streams=self._streams_for(size))
            return
        self._put_stream(key, lambda: open(src, "rb"), size, lambda: _crc32c_file(src), generation=generation)

    def put_memory(self, key: str, data: memoryview | bytes) -> None:
        """``put_file`` from host memory (a snapshot whose disk copy could not be written)."""
        mv = memoryview(data).cast("B")
        if self._streams_for(len(mv)) > 1:
            self._may_write()
            gcs_streams.upload(self, key, lambda s, e: contextlib.closing(_MemoryReader(mv[s:e])), len(mv),
                               generation=0, streams=self._streams_for(len(mv)))
            return
        self._put_stream(key, lambda: contextlib.closing(_MemoryReader(mv)), len(mv), lambda: _crc32c_bytes(mv))

    def _put_stream(self, key: str, opener: Callable[[], Any], size: int, crc: Callable[[], str], *,
                    generation: int = 0) -> ObjectInfo:
        """Chunked upload of what ``opener`` opens (create-only, or at ``generation``, see
        ``put_file``); the deadline and the abort are checked before every chunk, and every
        request is bounded by ``_timeout()``. The guard (the writer lease) is asked first.
        The object as stored."""
        self._may_write()

        def upload() -> ObjectInfo:
            blob = self._blob(key)
            with opener() as f:
                blob.upload_from_file(_AbortableReader(f, self._deadline(), self._aborted), size=size,
                                      if_generation_match=generation, retry=None, timeout=self._timeout())
            return ObjectInfo(int(blob.size or size), blob.crc32c or "", int(blob.generation or 0))

        return self._create_only(key, upload, lambda: (size, crc()))

    def _compose(self, key: str, parts: list[tuple[str, int]], size: int, crc: str, *, generation: int) -> None:
        """Compose ``parts`` (key, generation) into ``key``: create-only, or only over
        ``generation``; a lost answer's 412 is judged by ``size`` and ``crc`` (the parts'
        CRC32Cs combined), as an upload's is. A composed object that is not those parts (one
        changed before the compose) is deleted and ``CompositeMismatch`` raised."""

        def compose() -> ObjectInfo:
            self._may_write()
            self._check_stop(f"compose {key}")  # a request's timeout is never shorter than 0.5 s
            dest = self._blob(key)
            sources = [self._bucket.blob(self._object(p), generation=g) for p, g in parts]
            dest.compose(sources, if_generation_match=generation, retry=None, timeout=self._timeout())
            got = ObjectInfo(int(dest.size or 0), dest.crc32c or "", int(dest.generation or 0))
            if (got.size, got.crc32c) != (size, crc):
                with contextlib.suppress(Exception):
                    self._delete_at(key, got.generation)
                raise gcs_streams.CompositeMismatch(
                    f"{self.location(key)}: composed {got.size} bytes with crc32c {got.crc32c}; the parts uploaded "
                    f"were {size} bytes with crc32c {crc}")
            return got

        self._create_only(key, compose, lambda: (size, crc))

    def put_bytes(self, key: str, data: bytes, *, overwrite: bool = False) -> None:
        self._may_write()

        def upload() -> None:
            self._blob(key).upload_from_string(
                data, if_generation_match=None if overwrite else 0, retry=None,
                timeout=self._timeout())

        if overwrite:
            self._retry(f"upload {key}", upload)
        else:
            self._create_only(key, upload, lambda: (len(data), _crc32c_bytes(data)))

    def _create_only(self, key: str, upload: Callable[[], T],
                     identity: Callable[[], tuple[int, str]]) -> T | ObjectInfo:
        """``upload()``'s result; when the object exists already (a 412: our own upload whose
        answer was lost), the object there if it has ``identity()`` (size, CRC32C), else
        ``FileExistsError``."""
        from google.api_core import exceptions as gexc

        try:
            return self._retry(f"upload {key}", upload)
        except gexc.PreconditionFailed:
            size, crc = identity()
            blob = self._retry(f"stat {key}", lambda: self._bucket.get_blob(
                self._object(key), retry=None, timeout=self._timeout()))
            if blob is not None and blob.size == size and blob.crc32c == crc:
                log.info("gcs upload %s: object already exists with identical content; done", key)
                return ObjectInfo(int(blob.size), blob.crc32c, int(blob.generation or 0))
            raise FileExistsError(
                f"{self.location(key)} already exists with different content (create-only upload)")

    def get_bytes(self, key: str) -> bytes:
        from google.api_core import exceptions as gexc

        try:
            return self._retry(f"download {key}", lambda: self._blob(key).download_as_bytes(
                retry=None, timeout=self._timeout()))
        except gexc.NotFound:
            raise KeyError(key) from None

    def get_file(self, key: str, dst: Path) -> None:
        """Download to ``dst`` atomically (temporary sibling, fsync, rename), pinned to the
        generation its metadata showed first (an object replaced meanwhile: 412, never a mix);
        an object of ``PARALLEL_MIN_BYTES`` or more in ``streams`` slices at once."""
        from google.api_core import exceptions as gexc

        dst = Path(dst)
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.parent / f"{TMP_PREFIX}{dst.name}-{uuid.uuid4().hex[:8]}"

        def stat() -> ObjectInfo:
            blob = self._bucket.get_blob(self._object(key), retry=None, timeout=self._timeout())
            if blob is None:
                raise KeyError(key)
            return ObjectInfo(int(blob.size or 0), blob.crc32c or "", int(blob.generation or 0))

        def download() -> None:
            with open(tmp, "wb") as f:
                self._blob(key).download_to_file(f, if_generation_match=info.generation, retry=None,
                                                 timeout=self._timeout())
                f.flush()
                os.fsync(f.fileno())

        try:
            info = self._retry(f"stat {key}", stat)
            streams = self._streams_for(info.size) if info.crc32c else 1
            if streams > 1:
                gcs_streams.download(self, key, tmp, info, streams)
            else:
                self._retry(f"download {key}", download)
        except gexc.NotFound:
            tmp.unlink(missing_ok=True)
            raise KeyError(key) from None
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, dst)
        fsync_dir(dst.parent)

    def _list_blobs(self, prefix: str) -> list[Any]:
        if prefix.startswith("/") or ".." in prefix.split("/"):
            raise ValueError(f"invalid store prefix {prefix!r}")
        full = (f"{self.prefix}/" if self.prefix else "") + prefix
        return self._retry(f"list {prefix or '/'}", lambda: list(
            self._client.list_blobs(self._bucket, prefix=full, retry=None, timeout=self._timeout())))

    def _key_of(self, name: str) -> str:
        return name[len(self.prefix) + 1 :] if self.prefix else name

    def _visible(self, prefix: str) -> list[Any]:
        """The objects under ``prefix`` but the temporary ones (a key with a ``.tmp-`` part)."""
        return [b for b in self._list_blobs(prefix)
                if not any(p.startswith(TMP_PREFIX) for p in self._key_of(b.name).split("/"))]

    def names(self, prefix: str) -> list[str]:
        return sorted(self._key_of(b.name) for b in self._visible(prefix))

    def sizes(self, prefix: str) -> dict[str, int]:
        return {self._key_of(b.name): int(b.size or 0) for b in self._visible(prefix)}

    def objects(self, prefix: str) -> dict[str, ObjectInfo]:
        """Key -> size, CRC32C and generation of every object under ``prefix`` (one listing)."""
        return {self._key_of(b.name): ObjectInfo(int(b.size or 0), b.crc32c or "", int(b.generation or 0))
                for b in self._visible(prefix)}

    def delete_prefix(self, prefix: str) -> None:
        from google.api_core import exceptions as gexc

        self._may_write()
        for key in self.names(prefix):
            self._may_write()

            def delete(key: str = key) -> None:
                with contextlib.suppress(gexc.NotFound):
                    self._blob(key).delete(retry=None, timeout=self._timeout())

            self._retry(f"delete {key}", delete)

    def delete(self, key: str) -> None:
        from google.api_core import exceptions as gexc

        self._may_write()

        def delete() -> None:
            with contextlib.suppress(gexc.NotFound):
                self._blob(key).delete(retry=None, timeout=self._timeout())

        self._retry(f"delete {key}", delete)

    # -- generation-conditional calls (the writer lease; not guarded) ------------------------
    def read_versioned(self, key: str) -> tuple[bytes, int, float | None] | None:
        """``(content, generation, updated)`` of one object (``updated``: Cloud Storage's own
        clock, Unix seconds), or None when it does not exist."""
        def read() -> tuple[bytes, int, float | None] | None:
            blob = self._bucket.get_blob(self._object(key), retry=None, timeout=self._timeout())
            if blob is None:
                return None
            # Read before the download: it resets them from the answer's headers (which may lack them).
            generation, updated = int(blob.generation), blob.updated
            data = blob.download_as_bytes(retry=None, timeout=self._timeout())  # pinned to that generation
            return data, generation, updated.timestamp() if updated is not None else None

        from google.api_core import exceptions as gexc

        try:
            return self._retry(f"read {key}", read)
        except gexc.NotFound:  # deleted between the metadata and the content
            return None

    def stamp(self, key: str, data: bytes) -> float | None:
        """Cloud Storage's clock now (Unix seconds): the ``updated`` it gives ``key`` as this call
        overwrites it with ``data``, or None when its answer has none. The writer lease judges a
        lease's age by this clock (the one that stamped the lease), never by this VM's."""
        def write() -> float | None:
            blob = self._bucket.blob(self._object(key))
            blob.upload_from_string(data, content_type="application/json", retry=None, timeout=self._timeout())
            return blob.updated.timestamp() if blob.updated is not None else None

        return self._retry(f"write {key}", write)

    def write_if_generation(self, key: str, data: bytes, generation: int) -> int:
        """Write ``key`` only if it is at ``generation`` (0: only if it does not exist); the new
        generation. Raises ``google.api_core.exceptions.PreconditionFailed`` otherwise (also
        when a retry follows our own write whose answer was lost: the caller re-reads)."""
        def write() -> int:
            blob = self._bucket.blob(self._object(key))
            blob.upload_from_string(data, content_type="application/json", if_generation_match=generation,
                                    retry=None, timeout=self._timeout())
            return int(blob.generation)

        return self._retry(f"write {key}", write)

    def delete_if_generation(self, key: str, generation: int) -> bool:
        """Delete ``key`` only if it is at ``generation``; False when it was not (or was gone)."""
        from google.api_core import exceptions as gexc

        def delete() -> bool:
            try:
                self._bucket.blob(self._object(key)).delete(if_generation_match=generation, retry=None,
                                                            timeout=self._timeout())
            except (gexc.PreconditionFailed, gexc.NotFound):
                return False
            return True

        return self._retry(f"delete {key}", delete)


def _crc32c_bytes(data: bytes | memoryview) -> str:
    return crc32c.b64(crc32c.of_bytes(data))


def _crc32c_file(path: Path) -> str:
    return crc32c.b64(crc32c.of_file(path))
