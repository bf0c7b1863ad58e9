"""The per-file digest a manifest lists, and hashing at the speed of reading and writing.

Every file of a checkpoint is listed in its manifest with its size and a digest; the manifest's
``hash`` names the function, and each file's entry holds the digest under that function's
``field``:

* ``blake3-of-16MiB-chunk-blake3s`` (``BLAKE3``, field ``blake3``): BLAKE3 over the concatenated
  32-byte BLAKE3 digests of the file's 16 MiB chunks (an empty file: BLAKE3 of nothing). What
  checkpoints are written with.
* ``sha256-of-64MiB-chunk-sha256s`` (``SHA256``, field ``sha256``): the same construction with
  SHA-256 and 64 MiB chunks. What older versions wrote; still read, and written when the ``blake3``
  package cannot be imported (``for_writing`` says so once in the log).

Why chunks: the chunks hash independently, on several cores (both hashes release the GIL), each
chunk as soon as it is in memory: while a file is written from the snapshot buffer, and while a
restore reads it, the next chunk is read as the last one is hashed (``hash_file``). The digest is
as strong a content check as one hash over the whole file (a one-level Merkle tree).

Why BLAKE3: verification is what makes a restore trustworthy, and it is CPU work that a plain
``torch.load`` does not do. On a 2-core AMD EPYC with SHA-NI and AVX2, hashing while reading cost
about 0.4 CPU-seconds a GiB with BLAKE3 against 0.7 with SHA-256 (which SHA-NI already speeds up);
on CPUs with AVX-512 the gap is larger. The chunk is smaller than SHA-256's so that less hashing is
left when the last bytes arrive (16 MiB: a few milliseconds).

The manifest itself stays under SHA-256 (its self-checksum) and HMAC-SHA256
(``trainer.checkpoint.key``): it is a few KiB.
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import dataclasses
import hashlib
import logging
import os
import threading
import types
from pathlib import Path
from typing import Callable, Union

import torch

_blake3: types.ModuleType | None
try:
    import blake3 as _blake3
except ImportError:  # an image without it: checkpoints are written with SHA-256 (for_writing)
    _blake3 = None

log = logging.getLogger(__name__)

Buffer = Union[memoryview, bytes, bytearray]


@dataclasses.dataclass(frozen=True)
class FileHash:
    """One per-file digest: its name in the manifest, the entry field, its chunk size and the
    function over one chunk (the same function is taken over the concatenated chunk digests)."""

    name: str
    field: str
    chunk: int
    fn: Callable[[Buffer], bytes]

    def chunk_digest(self, data: Buffer) -> bytes:
        return self.fn(data)

    def combine(self, digests: list[bytes]) -> str:
        return self.fn(b"".join(digests)).hex()

    def of(self, data: Buffer, pool: cf.ThreadPoolExecutor | None = None) -> str:
        """The digest of bytes in memory (chunks hashed on ``pool`` when there is more than one)."""
        mv = data if isinstance(data, memoryview) else memoryview(data)
        mv = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
        spans = [mv[i : i + self.chunk] for i in range(0, len(mv), self.chunk)]
        if pool is None or len(spans) <= 1:
            return self.combine([self.fn(x) for x in spans])
        return self.combine(list(pool.map(self.fn, spans)))

    def entry(self, size: int, digest: str) -> dict:
        """A manifest's file entry."""
        return {"size": size, self.field: digest}


def _sha256(data: Buffer) -> bytes:
    return hashlib.sha256(data).digest()


def _blake3_digest(data: Buffer) -> bytes:
    assert _blake3 is not None, "BLAKE3 exists only where blake3 imports"
    return _blake3.blake3(data).digest()


SHA256 = FileHash("sha256-of-64MiB-chunk-sha256s", "sha256", 64 << 20, _sha256)
BLAKE3_NAME = "blake3-of-16MiB-chunk-blake3s"
BLAKE3: FileHash | None = FileHash(BLAKE3_NAME, "blake3", 16 << 20, _blake3_digest) if _blake3 else None

#: Every hash a manifest may name, and what computes it here (None: the ``blake3`` package is
#: not installed; such checkpoints are quarantined, never read or deleted: see the manifest).
HASHES: dict[str, FileHash | None] = {SHA256.name: SHA256, BLAKE3_NAME: BLAKE3}
#: The entry field of each hash name.
FIELDS = {SHA256.name: "sha256", BLAKE3_NAME: "blake3"}
#: Why a hash is not available here, by name.
MISSING = {BLAKE3_NAME: "the blake3 package is not installed here (pip install blake3; a VM's locked wheels "
                        "include it)"}

_warned = threading.Event()


def for_writing() -> FileHash:
    """The hash new checkpoints are written with: BLAKE3, or SHA-256 where ``blake3`` cannot be
    imported (said once in the log)."""
    if BLAKE3 is not None:
        return BLAKE3
    if not _warned.is_set():
        _warned.set()
        log.warning("the blake3 package is not installed: checkpoints are written with %s (SHA-256 verifies at "
                    "about half the speed); pip install blake3", SHA256.name)
    return SHA256


def of_manifest(m: dict) -> FileHash:
    """The hash a parsed manifest names (its parser made sure it is known and available here)."""
    fh = HASHES.get(m.get("hash", ""))
    if fh is None:
        raise ValueError(f"no file hash {m.get('hash')!r} here")
    return fh


def from_entries(files: dict[str, dict]) -> FileHash:
    """The hash a set of manifest entries was computed with (they must agree)."""
    names = {n for n, f in FIELDS.items() for e in files.values() if f in e}
    if len(names) != 1:
        raise ValueError(f"the files were hashed with {sorted(names) or 'nothing'}: one hash per manifest")
    fh = HASHES[names.pop()]
    assert fh is not None
    return fh


def hash_workers(beside_io: bool = True) -> int:
    """Threads hashing a checkpoint's chunks. Beside the thread writing the same
    bytes one core is left to that thread: on 2 cores, hashing on both starved the writer
    (measured side by side: write throughput 0.80 of the disk's with 2 hash threads, 0.94 with
    1; BENCHMARKS.md). Hashing from memory (an upload without a disk copy) or beside a read (a
    restore's verification) takes every core."""
    cores = os.cpu_count() or 2
    return max(1, min(8, cores - 1 if beside_io else cores))


def byte_view(buf: torch.Tensor, nbytes: int | None = None) -> memoryview:
    """A writable memoryview over a contiguous CPU uint8 tensor (no copy, no numpy needed)."""
    n = buf.numel() if nbytes is None else nbytes
    if n == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_ubyte * n).from_address(buf.data_ptr())).cast("B")


def _read_full(f, mv: memoryview) -> int:
    """Read into all of ``mv`` unless the file ends first; the bytes read."""
    n = 0
    while n < len(mv):
        m = f.readinto(mv[n:])
        if not m:
            break
        n += m
    return n


def hash_file(path: Path, fh: FileHash, into: torch.Tensor | None = None) -> tuple[int, str]:
    """(bytes read, digest) of a file, reading it once: each chunk is hashed on a pool thread
    as soon as it is read, while the next is read. With ``into`` (a uint8 tensor of the size the
    manifest says) the file is read into it on the way; otherwise into a few reused chunk buffers.
    A file longer than ``into`` reads as one byte longer."""
    workers = hash_workers(beside_io=False)  # reading is cheap next to writing: measured 0.50 s vs 0.55 s a GiB
    futures: list[cf.Future] = []
    size = 0
    with open(path, "rb", buffering=0) as f, cf.ThreadPoolExecutor(workers, thread_name_prefix="ckpt-hash") as pool:
        if into is not None:
            mv = byte_view(into)
            while size < len(mv):
                n = _read_full(f, mv[size : size + fh.chunk])
                if n:
                    futures.append(pool.submit(fh.chunk_digest, mv[size : size + n]))
                size += n
                if n < fh.chunk:
                    break
            if size == len(mv) and f.read(1):
                size += 1  # longer than the manifest says
        else:
            # One chunk buffer per worker and one being read: memory stays bounded, and no fresh
            # allocation is faulted in per chunk.
            ring = [memoryview(bytearray(fh.chunk)) for _ in range(workers + 1)]
            while True:
                i = len(futures) % len(ring)
                if len(futures) >= len(ring):
                    futures[-len(ring)].result()  # that buffer's chunk is hashed: reuse it
                n = _read_full(f, ring[i])
                if not n:
                    break
                futures.append(pool.submit(fh.chunk_digest, ring[i][:n]))
                size += n
                if n < fh.chunk:
                    break
        digest = fh.combine([x.result() for x in futures])
    return size, digest
