"""TensorBoard scalars of the run: written under the run dir, mirrored to the durable tier.

Each session (rank 0) writes its event file, ``RUN_DIR/tensorboard/events.out.tfevents.<time>.
<host>.<session>.<part>``, in TensorBoard's own format (TFRecord framing with masked CRC32C around
``tensorflow.Event`` protobufs, encoded here by hand: the ``tensorboard`` package pulls in grpcio
and more, which a training VM does not need). A part grows to ``PART_BYTES``, then the next one
starts (TensorBoard reads a run's files in name order as one stream). The growing part is
uploaded to ``GCS_URI/tensorboard/`` every ``metrics_upload_every_s`` and when the session ends,
replacing its object, so ``tensorboard --logdir GCS_URI/tensorboard`` (or a Vertex AI
TensorBoard) shows the whole job; a finished part is uploaded once more and never again. The
bucket's soft delete keeps what an upload replaces, so parts bound that to ``PART_BYTES`` an
upload instead of the whole session's file.

A resumed run continues the curves without duplicated or orphaned points. A session restored at
step S supersedes every point past S (they came from steps whose results were lost), so at start
it (1) rewrites the earlier sessions' files without those points, locally and in the bucket
(fetching first any file only the bucket has: a lost disk), and (2) writes a
``SessionLog.START`` event at step S + 1, TensorBoard's own purge marker (readers that load
files written before the rewrite drop the superseded points on it too).

The metrics never stop a run: a write to the run dir that fails (a full or read-only disk) is
logged and counted (``event=metrics_error``, at the 1st, 2nd, 4th, 8th ... failure), its point is
dropped (a partial record is cut off, so that no torn record hides the points after it), and the
file is written again once the disk takes writes.

Steps are optimizer steps completed; scalars: ``train/loss`` (mean over the logging interval),
``lr``, ``throughput/steps_per_s``, ``throughput/tokens_per_s`` (or ``samples_per_s``),
``eval/loss``, ``goodput/goodput`` and ``goodput/cost_usd``.
"""
from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import google_crc32c

from trainer.checkpoint.stores import DirStore

TB_DIR = "tensorboard"
_PREFIX = "events.out.tfevents."
PART_BYTES = 1 << 20


# ---------------------------------------------------------------------------------- encoding
def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64 on the wire: negative values as two's complement
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _field(num: int, wire: int, payload: bytes) -> bytes:
    key = _varint(num << 3 | wire)
    return key + (_varint(len(payload)) + payload if wire == 2 else payload)


def event(wall_time: float, step: int = 0, *, file_version: str | None = None,
          scalars: dict[str, float] | None = None, session_start: bool = False) -> bytes:
    """A serialized ``tensorflow.Event``."""
    out = _field(1, 1, struct.pack("<d", wall_time))
    if step:
        out += _field(2, 0, _varint(step))
    if file_version is not None:
        out += _field(3, 2, file_version.encode())
    if scalars:
        values = b"".join(_field(1, 2, _field(1, 2, tag.encode()) + _field(2, 5, struct.pack("<f", float(v))))
                          for tag, v in scalars.items())
        out += _field(5, 2, values)  # Summary { repeated Value value = 1 }
    if session_start:
        out += _field(6, 2, _field(1, 0, _varint(1)))  # SessionLog { status = START }
    return out


def _masked_crc(data: bytes) -> int:
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def record(data: bytes) -> bytes:
    """TFRecord framing: length, its masked CRC32C, the data, its masked CRC32C."""
    head = struct.pack("<Q", len(data))
    return head + struct.pack("<I", _masked_crc(head)) + data + struct.pack("<I", _masked_crc(data))


def records(raw: bytes) -> Iterator[bytes]:
    """The intact records of an event file; stops at a torn or corrupt tail (a kill mid-write)."""
    pos = 0
    while pos + 12 <= len(raw):
        head = raw[pos:pos + 8]
        (n,) = struct.unpack("<Q", head)
        if struct.unpack("<I", raw[pos + 8:pos + 12])[0] != _masked_crc(head) or pos + 16 + n > len(raw):
            return
        data = raw[pos + 12:pos + 12 + n]
        if struct.unpack("<I", raw[pos + 12 + n:pos + 16 + n])[0] != _masked_crc(data):
            return
        yield data
        pos += 16 + n


def step_of(data: bytes) -> int:
    """The ``step`` field of a serialized Event (0 when absent)."""
    pos = 0
    while pos < len(data):
        key, pos = _read_varint(data, pos)
        num, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _read_varint(data, pos)
            if num == 2:
                return value - (1 << 64) if value >= 1 << 63 else value
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == 2:
            n, pos = _read_varint(data, pos)
            pos += n
        else:
            return 0
    return 0


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        b = data[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7


def without_steps_after(raw: bytes, step: int) -> bytes:
    """``raw`` less the records past ``step`` (and any torn tail)."""
    return b"".join(record(r) for r in records(raw) if step_of(r) <= step)


# ---------------------------------------------------------------------------------- writer
class Metrics:
    """This session's scalars (rank 0 only); see the module docstring."""

    def __init__(self, run_dir: Path, *, start_step: int, store: Any | None = None, session: str = "",
                 upload_every_s: float = 60.0, log: logging.Logger | None = None):
        self.log = log or logging.getLogger("trainer.metrics")
        self.errors = 0  # writes to the run dir that failed
        self.dir = DirStore(Path(run_dir) / TB_DIR, "tensorboard")
        self.store, self.upload_every_s = store, upload_every_s
        self.base = f"{_PREFIX}{int(time.time()):010d}.{socket.gethostname()}.{session or os.getpid()}"
        try:
            self.dir.root.mkdir(parents=True, exist_ok=True)
            self.dir.clean_temporaries()  # a rewrite cut short: TensorBoard would read it as a run file
        except OSError as e:
            self._failed(e)
        self._supersede(start_step)
        self._lock = threading.Lock()
        self._written: dict[str, int] = {}  # part -> bytes written (the last part is the open one)
        self._uploaded: dict[str, int] = {}
        self._fd: int | None = None
        self.name = f"{self.base}.0000"
        self._written[self.name] = 0
        self._open()
        self._write(event(time.time(), file_version="brain.Event:2"))
        self._write(event(time.time(), start_step + 1, session_start=True))
        self._wake = threading.Event()
        self._closing = self._final_ok = False
        self._thread: threading.Thread | None = None
        if store is not None:
            self._thread = threading.Thread(target=self._upload_loop, name="metrics-upload", daemon=True)
            self._thread.start()

    def _supersede(self, step: int) -> None:
        """Earlier sessions' points past ``step`` go, here and in the bucket (see the docstring)."""
        remote: list[str] = []
        if self.store is not None:
            try:
                remote = [k.rsplit("/", 1)[1] for k in self.store.names(TB_DIR + "/") if _PREFIX in k]
                for name in remote:
                    if not self.dir.path(name).exists():
                        self.dir.put_bytes(name, self.store.get_bytes(f"{TB_DIR}/{name}"), overwrite=True)
            except Exception as e:  # noqa: BLE001 - metrics never stop training
                self.log.warning("event=metrics_recover ok=0 error=%r", e)
        for path in sorted(self.dir.root.glob(_PREFIX + "*")):
            raw = path.read_bytes()
            kept = without_steps_after(raw, step)
            if kept != raw:
                try:
                    self.dir.put_bytes(path.name, kept, overwrite=True)
                    self.log.info("event=metrics_superseded file=%s after_step=%d", path.name, step)
                except OSError as e:  # the bucket's copy is still rewritten
                    self._failed(e)
            if self.store is not None and (kept != raw or path.name not in remote):
                self._put(path.name, kept)

    def _put(self, name: str, data: bytes) -> bool:
        try:
            self.store.put_bytes(f"{TB_DIR}/{name}", data, overwrite=True)  # type: ignore[union-attr]
            return True
        except Exception as e:  # noqa: BLE001
            self.log.warning("event=metrics_upload ok=0 file=%s error=%r", name, e)
            return False

    def _failed(self, e: OSError) -> None:
        """Count a failed write to the run dir; log it at counts 1, 2, 4, ... (never raises)."""
        self.errors += 1
        if self.errors & (self.errors - 1) == 0:
            self.log.warning("event=metrics_error where=local count=%d error=%r (training goes on; these "
                             "points are dropped)", self.errors, e)

    def _open(self) -> bool:
        """Open the current part (again, after a failed write: cut back to its whole records)."""
        if self._fd is not None:
            return True
        try:
            self._fd = os.open(self.dir.path(self.name), os.O_WRONLY | os.O_CREAT, 0o644)
            os.ftruncate(self._fd, self._written[self.name])
            os.lseek(self._fd, 0, os.SEEK_END)
            return True
        except OSError as e:
            self._close_fd()
            self._failed(e)
            return False

    def _close_fd(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

    def _write(self, data: bytes) -> None:
        with self._lock:
            if self._fd is None and not self._open():
                return
            rec = record(data)
            try:
                if os.write(self._fd, rec) != len(rec):  # type: ignore[arg-type]
                    raise OSError("short write (the disk is full)")
            except OSError as e:
                self._close_fd()  # reopened, cut back to the last whole record, by the next write
                self._failed(e)
                return
            self._written[self.name] += len(rec)
            if self._written[self.name] >= PART_BYTES:
                self._close_fd()
                self.name = f"{self.base}.{len(self._written):04d}"
                self._written[self.name] = 0
                self._open()

    def scalars(self, step: int, values: dict[str, float] | None) -> None:
        """Points at ``step`` (None or empty: nothing)."""
        if values:
            self._write(event(time.time(), step, scalars=values))

    def _upload_loop(self) -> None:
        while True:
            self._wake.wait(self.upload_every_s)
            closing = self._closing
            ok = self._upload()
            if closing:
                self._final_ok = ok
                return

    def _upload(self) -> bool:
        with self._lock:
            written = dict(self._written)
        ok = True
        for name, n in written.items():
            if self._uploaded.get(name) == n:
                continue
            try:
                data = self.dir.path(name).read_bytes()[:n]  # whole records only, even while one is appended
            except OSError:  # never created (the run dir could not take it): nothing of it to upload
                ok = n == 0 and ok
                continue
            if self._put(name, data):
                self._uploaded[name] = n
            else:
                ok = False
        return ok

    def close(self, timeout: float = 30.0) -> bool:
        """fsync the file and make the last upload, waiting at most ``timeout`` s for it; True
        if the bucket then has every point the run dir has."""
        with self._lock:
            if self._fd is not None:
                try:
                    os.fsync(self._fd)
                except OSError as e:
                    self._failed(e)
                self._close_fd()
        if self._thread is None:
            return True
        self._closing = True
        self._wake.set()
        self._thread.join(max(0.0, timeout))
        return not self._thread.is_alive() and self._final_ok
