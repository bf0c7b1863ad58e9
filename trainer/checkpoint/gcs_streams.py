"""Every stream Cloud Storage allows for one large object: ``GcsStore`` moves an object of
``GcsStore.PARALLEL_MIN_BYTES`` or more over ``GcsStore.streams`` connections at once, since
Cloud Storage limits what one stream carries (and a VM's network carries many streams).

- **Sliced download** (``download``): with the object's size, generation and CRC32C known
  (one metadata request), one ranged GET per slice, all at once, each pinned to that generation
  (``ifGenerationMatch``: an object replaced meanwhile fails its slice with 412, never a file of
  two objects), written at its offset into the caller's temporary file. A slice is retried on
  its own by the store's rule, from the byte it had reached. The slices' CRC32Cs, combined, must
  be the object's, or the download raises the client's ``DataCorruption`` (a restore reads such
  a copy again before it judges the checkpoint).
- **Composite upload** (``upload``): the source cut into equal parts (at most 32, what one
  compose takes), each uploaded as a temporary object under ``.tmp-parts/`` of the store's
  prefix with the single upload's rules (the guard, create-only, retries, a lost answer's 412
  judged by size and CRC32C), all at once; then one ``compose`` of the parts, each named at the
  generation uploaded, into the object: create-only (or only over the generation asked for),
  and a lost answer judged the same way, by the size and the parts' CRC32Cs combined (a
  composite object has a CRC32C and no MD5). The composed object's CRC32C must be the parts'
  combined: a part changed under the upload is caught, and the object it made is deleted. Then
  the parts are deleted, each at its generation (a versioned bucket keeps no old version).
- Every stream runs under the caller's deadline and abort (``GcsStore.deadline``, ``aborting``);
  one that fails stops the others at their next chunk, and the call raises that first failure
  once all have stopped. An upload that fails deletes its parts when there is time for it; one
  aborted or cut by its deadline leaves them to ``GcsStore.clean_temporaries`` (the next
  restore runs it), since the time left belongs to what still has to be saved.

What it costs on Cloud Storage: one Class A operation per part and one per compose; until they
are deleted the parts are a second copy of the object, and a bucket with soft delete keeps the
deleted parts, billed, for its retention (docs/durability.md).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, ContextManager, Protocol, TypeVar

from trainer.checkpoint import crc32c
from trainer.checkpoint.objects import ObjectInfo, Readable, UploadAborted

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Where the parts of composite uploads wait for their compose (a key prefix of the store).
PARTS_DIR = ".tmp-parts"
#: Seconds the deletion of an upload's parts may take (beyond them: clean_temporaries' job).
DISCARD_S = 10.0
_BLOCK = 1 << 20


class GcsStore(Protocol):
    """What the bucket store (``trainer.checkpoint.stores.GcsStore``, which imports this module)
    lends its streams: its per-thread deadline and abort, and the single requests each stream
    makes by the store's own rules (create-only, retries, the guard)."""

    _local: threading.local  # this thread's ``deadline`` and ``abort``
    _bucket: Any             # the client's bucket

    def deadline(self, deadline: float | None) -> ContextManager[None]: ...
    def aborting(self, event: Any) -> ContextManager[None]: ...  # an Event, or what is_set() and wait()
    def location(self, key: str = "") -> str: ...
    def _deadline(self) -> float | None: ...
    def _aborted(self) -> bool: ...
    def _check_stop(self, what: str) -> None: ...
    def _object(self, key: str) -> str: ...
    def _timeout(self) -> float: ...
    def _retry(self, what: str, fn: Callable[[], T]) -> T: ...
    def _put_stream(self, key: str, opener: Callable[[], Any], size: int, crc: Callable[[], str], *,
                    generation: int = 0) -> ObjectInfo: ...
    def _compose(self, key: str, parts: list[tuple[str, int]], size: int, crc: str, *, generation: int) -> None: ...
    def _delete_at(self, key: str, generation: int) -> None: ...


class ShortRead(ConnectionError):
    """A slice's connection ended before its bytes did: retried like any transport error."""


class CompositeMismatch(Exception):
    """The composed object is not the parts that were uploaded (one changed before the compose)."""


def split(size: int, streams: int) -> list[tuple[int, int]]:
    """``[start, end)`` of at most ``streams`` equal slices of ``size`` bytes (one for 0)."""
    step = max(1, math.ceil(size / max(1, streams)))
    return [(s, min(size, s + step)) for s in range(0, size, step)] or [(0, 0)]


class _Either:
    """Set once the caller's abort or the streams' own stop is (``GcsStore.aborting`` takes it)."""

    def __init__(self, outer: Any, stop: threading.Event) -> None:
        self._outer, self._stop = outer, stop

    def is_set(self) -> bool:
        return self._stop.is_set() or (self._outer is not None and self._outer.is_set())

    def wait(self, timeout: float | None = None) -> bool:
        self._stop.wait(timeout)  # the store looks again ten times a second
        return self.is_set()


def _run(store: GcsStore, tasks: list[Callable[[], T]]) -> list[T]:
    """``tasks`` on threads of their own, each under the caller's deadline and abort; their
    results in order. The first failure stops the others (at their next chunk or request) and
    is raised once every task has ended. The threads are daemons, as every thread of an upload
    is: one stuck in a request never holds the process at its exit (an executor's would)."""
    if len(tasks) == 1:
        return [tasks[0]()]
    deadline, stop = store._deadline(), threading.Event()
    abort = _Either(getattr(store._local, "abort", None), stop)
    results: list[Any] = [None] * len(tasks)
    errors: list[BaseException | None] = [None] * len(tasks)

    def run(i: int) -> None:
        try:
            with store.deadline(deadline), store.aborting(abort):
                results[i] = tasks[i]()
        except BaseException as e:  # noqa: BLE001 - raised by the caller, below
            errors[i] = e
            stop.set()

    threads = [threading.Thread(target=run, args=(i,), name=f"gcs-stream-{i}", daemon=True)
               for i in range(len(tasks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = [e for e in errors if e is not None]
    if failed:  # the failure, not the aborts it caused in the other streams
        raise next((e for e in failed if not isinstance(e, UploadAborted)), failed[0])
    return results


# --- sliced download ---------------------------------------------------------------------------
class _SliceWriter:
    """A file-like target for ``download_to_file``: writes one slice at its offset, checksums as
    it goes and stops at the deadline or on abort. The client hands over 8 KiB at a time; they
    are gathered into 1 MiB blocks, so that the syscall and the CRC32C run per block."""

    def __init__(self, fd: int, offset: int, end: int, check: Callable[[], None]) -> None:
        self.fd, self.offset, self.end, self._check = fd, offset, end, check
        self.crc, self.n = 0, 0
        self._buf = bytearray()

    def write(self, data: bytes) -> int:
        self._buf += data
        if len(self._buf) >= _BLOCK:
            self.flush()
        return len(data)

    def flush(self) -> None:
        import google_crc32c

        self._check()
        if not self._buf:
            return
        data, self._buf = bytes(self._buf), bytearray()
        if self.offset + len(data) > self.end:
            raise ValueError(f"the server sent more than the range asked for (up to byte {self.end})")
        view = memoryview(data)
        while view:
            view = view[os.pwrite(self.fd, view, self.offset + (len(data) - len(view))):]
        self.crc = google_crc32c.extend(self.crc, data)
        self.offset += len(data)
        self.n += len(data)


def download(store: GcsStore, key: str, tmp: Path, info: ObjectInfo, streams: int) -> None:
    """Object ``key`` (as ``info`` describes it) into the new file ``tmp``, in ``streams``
    slices at once, fsynced (see the module docstring); the caller renames it."""
    import importlib

    # The client ships no types: its exception is Any here.
    DataCorruption: Any = importlib.import_module("google.cloud.storage.exceptions").DataCorruption

    ranges = split(info.size, streams)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        crcs = _run(store, [functools.partial(_slice, store, key, fd, s, e, info.generation) for s, e in ranges])
        whole = 0
        for (s, e), c in zip(ranges, crcs):
            whole = crc32c.combine(whole, c, e - s)
        if crc32c.b64(whole) != info.crc32c:
            raise DataCorruption(None, f"{store.location(key)}: the slices' crc32c {crc32c.b64(whole)} is not "
                                       f"the object's {info.crc32c}")
        os.fsync(fd)
    finally:
        os.close(fd)


def _slice(store: GcsStore, key: str, fd: int, start: int, end: int, generation: int) -> int:
    """Bytes ``[start, end)`` of ``key`` at ``generation`` into ``fd``; their CRC32C."""
    done, crc = 0, 0

    def attempt() -> None:
        nonlocal done, crc
        w = _SliceWriter(fd, start + done, end, lambda: store._check_stop(f"download {key}"))
        try:
            store._bucket.blob(store._object(key)).download_to_file(
                w, start=start + done, end=end - 1, raw_download=True, checksum=None,
                if_generation_match=generation, retry=None, timeout=store._timeout())
            w.flush()
        finally:  # what arrived whole counts: a retry asks for the rest
            crc, done = crc32c.combine(crc, w.crc, w.n), done + w.n
        if start + done < end:
            raise ShortRead(f"{key} bytes {start}-{end}: the answer ended at byte {start + done}")

    store._retry(f"download {key} bytes {start}-{end}", attempt)
    return crc


# --- composite upload --------------------------------------------------------------------------
def upload(store: GcsStore, key: str, opener: Callable[[int, int], ContextManager[Readable]], size: int, *,
           generation: int, streams: int) -> None:
    """``size`` bytes (``opener(start, end)`` opens a range of them) to ``key`` as a composite
    of ``streams`` parts uploaded at once (see the module docstring)."""
    ranges = split(size, streams)
    run = uuid.uuid4().hex[:12]
    names = [f"{PARTS_DIR}/{key}.{run}/{i:02d}" for i in range(len(ranges))]
    parts: dict[int, ObjectInfo] = {}

    def part(i: int, start: int, end: int) -> None:
        def identity() -> str:
            with opener(start, end) as f:
                return crc32c.b64(crc32c.of_stream(f))

        info = store._put_stream(names[i], lambda: opener(start, end), end - start, identity)
        parts[i] = info

    composed = False
    try:
        _run(store, [functools.partial(part, i, s, e) for i, (s, e) in enumerate(ranges)])
        whole = 0
        for i, (s, e) in enumerate(ranges):
            whole = crc32c.combine(whole, crc32c.parse(parts[i].crc32c), e - s)
        store._compose(key, [(names[i], parts[i].generation) for i in range(len(ranges))], size,
                       crc32c.b64(whole), generation=generation)
        composed = True
    finally:
        discard(store, key, {names[i]: info.generation for i, info in parts.items()}, composed=composed)


def discard(store: GcsStore, key: str, parts: dict[str, int], *, composed: bool) -> None:
    """Delete the uploaded ``parts`` (name -> generation) of ``key``'s upload, all at once, within
    ``DISCARD_S``; never raises. After an abort or past the deadline nothing is tried: they are
    left to ``clean_temporaries``."""
    if not parts:
        return
    dl = store._deadline()
    if store._aborted() or (dl is not None and time.monotonic() >= dl):
        log.info("gcs upload %s: %d part(s) left under %s/ for the next clean-up (aborted)", key, len(parts), PARTS_DIR)
        return
    until = time.monotonic() + DISCARD_S
    try:
        with store.deadline(until if dl is None else min(dl, until)):
            _run(store, [functools.partial(store._delete_at, name, gen) for name, gen in parts.items()])
    except Exception as e:  # noqa: BLE001 - the object (or the failure) is what the caller gets
        log.warning("gcs upload %s: %d part(s) under %s/ not deleted%s (%s: %s); the next clean-up removes them",
                    key, len(parts), PARTS_DIR, "" if composed else " after the upload failed",
                    type(e).__name__, str(e)[:200])


def range_of_file(path: Path) -> Callable[[int, int], ContextManager[Readable]]:
    """``opener(start, end)`` of byte ranges of a file."""
    @contextlib.contextmanager
    def opener(start: int, end: int) -> Any:
        with open(path, "rb") as f:
            yield _Range(f, start, end)

    return opener


class _Range:
    """Bytes ``[start, end)`` of a seekable file as a file of their own (positions from 0)."""

    def __init__(self, f: Any, start: int, end: int) -> None:
        self._f, self._start, self._len, self._pos = f, start, end - start, 0
        f.seek(start)

    def read(self, n: int | None = -1) -> bytes:
        left = self._len - self._pos
        n = left if n is None or n < 0 else min(n, left)
        out = self._f.read(n) if n > 0 else b""
        self._pos += len(out)
        return out

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._len}[whence]
        self._pos = max(0, min(self._len, base + offset))
        self._f.seek(self._start + self._pos)
        return self._pos

    def tell(self) -> int:
        return self._pos
