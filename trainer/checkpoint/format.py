"""The folder format every checkpoint layout shares: files, hashes, atomic folders, listings.

A checkpoint is one ``step-NNNNNNNN/`` folder (or remote prefix) holding its layout's files and,
written last, its manifest (``trainer.checkpoint.manifest``). This module owns what is the same
for every layout:

* the per-file digest, ``chunked_sha256``: the sha256 of the 64 MiB chunks' sha256s, so hashing
  runs on several cores, while a file is written and while it is read back;
* atomic folders: on a directory tier a folder is assembled under a ``.tmp-`` name, every file and
  the folder are fsynced, and the folder becomes visible by one atomic ``rename`` (a swap with
  ``replace``; then the parent is fsynced): ``publish_dir``, ``copy_dir``, ``download_dir``;
* listing and the quick check (``list_checkpoints``, ``check_checkpoint``: manifest self-check and
  HMAC, every listed file present with the listed size; no hashing of payloads), full
  verification of a file (``_verify_file``), and ``delete_checkpoint`` (manifest first);
* ``tensor_digest``: a content digest of a model state dict (``status``'s ``model_digest``).

Every function takes the layout's manifest parser (``ManifestParser``), which says which files a
checkpoint of that layout has; stores are asked through their interface only
(``trainer.checkpoint.stores``).
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import dataclasses
import errno
import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Callable, Iterable

import torch

from trainer import untrusted
from trainer.checkpoint.key import CheckpointKey
from trainer.checkpoint.manifest import (MANIFEST, CheckpointInvalid, ManifestParser, parse_step, step_name)
from trainer.checkpoint.stores import TMP_PREFIX, Store, copy_file_durable, fsync_dir

_IO_CHUNK = 32 << 20
#: Files are hashed in chunks of this size, in parallel; see ``chunked_sha256``.
HASH_CHUNK = 64 << 20


def _byte_view(buf: torch.Tensor, nbytes: int | None = None) -> memoryview:
    """A writable memoryview over a contiguous CPU uint8 tensor (no copy, no numpy needed)."""
    n = buf.numel() if nbytes is None else nbytes
    if n == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_ubyte * n).from_address(buf.data_ptr())).cast("B")



def _chunk_digest(data: memoryview | bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _combine(digests: list[bytes]) -> str:
    return hashlib.sha256(b"".join(digests)).hexdigest()


def chunked_sha256(data: memoryview | bytes, pool: cf.ThreadPoolExecutor | None = None) -> str:
    """The manifest's per-file digest: sha256 over the concatenated sha256 digests of the file's
    64 MiB chunks (like a one-level Merkle tree).

    Why not one sha256 over the whole file: one sha256 stream runs at about 1-2 GB/s, slower than
    a local NVMe/page-cache write and than a warm read, so it would cap checkpoint write and
    restore throughput. Chunks hash independently on several cores (hashlib releases the GIL) and
    the result is as strong a content check.
    """
    mv = memoryview(data).cast("B") if not isinstance(data, memoryview) else data
    spans = [mv[i : i + HASH_CHUNK] for i in range(0, len(mv), HASH_CHUNK)]
    if pool is None or len(spans) <= 1:
        return _combine([_chunk_digest(x) for x in spans])
    return _combine(list(pool.map(_chunk_digest, spans)))


def _hash_workers(beside_io: bool = True) -> int:
    """Threads hashing a checkpoint's chunks. Beside the thread writing the same
    bytes one core is left to that thread: on 2 cores, hashing on both starved the writer
    (measured side by side: write throughput 0.80 of the disk's with 2 hash threads, 0.94 with
    1; BENCHMARKS.md). Hashing from memory (an upload without a disk copy) or beside a read (a
    restore's verification) takes every core."""
    cores = os.cpu_count() or 2
    return max(1, min(8, cores - 1 if beside_io else cores))


def _write_hashed(path: Path, data: memoryview, pool: cf.ThreadPoolExecutor) -> dict:
    """Write ``data`` to a new file with fsync; the chunk hashes run on ``pool`` meanwhile
    (hashlib and os.write both release the GIL, so they use separate cores)."""
    futures = [pool.submit(_chunk_digest, data[i : i + HASH_CHUNK]) for i in range(0, len(data), HASH_CHUNK)]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for i in range(0, len(data), _IO_CHUNK):
            chunk = data[i : i + _IO_CHUNK]
            while chunk:
                n = os.write(fd, chunk)
                chunk = chunk[n:]
        os.fsync(fd)
    finally:
        os.close(fd)
    return {"size": len(data), "sha256": _combine([f.result() for f in futures])}



_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where the
    system or filesystem cannot."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(str(a)), _AT_FDCWD, os.fsencode(str(b)), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def publish_dir(stage: Path, final: Path, *, replace: bool = False) -> None:
    """Make the complete, fsynced folder ``stage`` visible as ``final`` by one atomic rename,
    then fsync the parent. With ``replace``, a folder already at ``final`` is swapped out in the
    same step and removed afterwards: at every moment ``final`` is the old checkpoint or the new
    one. (Where the atomic swap is unavailable the old folder is renamed aside first, leaving a
    moment without ``final``; the new one is then still complete under its staging name.)"""
    if replace and final.exists():
        if _exchange(stage, final):
            fsync_dir(final.parent)
            shutil.rmtree(stage, ignore_errors=True)  # now the old folder
            return
        old = final.with_name(f"{TMP_PREFIX}{final.name}-old-{uuid.uuid4().hex[:8]}")
        os.rename(final, old)
        os.rename(stage, final)
        fsync_dir(final.parent)
        shutil.rmtree(old, ignore_errors=True)
        return
    os.rename(stage, final)  # the folder appears complete or not at all
    fsync_dir(final.parent)



def _write_hashed_plain(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        mv = memoryview(data)
        while mv:
            mv = mv[os.write(fd, mv):]
        os.fsync(fd)
    finally:
        os.close(fd)



def copy_dir(src: Path, root: Path, parse: ManifestParser, *,
             key: CheckpointKey | None = None, replace: bool = False) -> Path:
    """Copy a checkpoint folder holding its manifest (a committed one, or a staging folder) into
    ``root/step-N/`` (another disk tier) atomically: every file the manifest lists, fsynced, the
    manifest last, then the rename (a swap with a folder already there, with ``replace``)."""
    src = Path(src)
    manifest = (src / MANIFEST).read_bytes()
    m = parse(manifest, parse_step(src.name), key=key)

    def fill(stage: Path) -> bytes:
        for name in m["files"]:
            copy_file_durable(src / name, stage / name)
        return manifest

    return _assemble(Path(root), step_name(m["step"]), "cp", fill, replace=replace)


def download_dir(store: Store, step: int, root: Path, parse: ManifestParser, *,
                 key: CheckpointKey | None = None) -> Path:
    """Copy ``step-N`` from ``store`` into ``root/step-N/`` atomically (manifest fetched last is
    irrelevant here: the folder only appears after everything arrived and was verified).
    ``parse``: the layout's manifest parser, which says the files;
    ``key``: the manifest must carry a valid HMAC under it."""
    def fill(stage: Path) -> bytes:
        manifest_bytes = store.get_bytes(f"{step_name(step)}/{MANIFEST}")
        manifest = parse(manifest_bytes, step, key=key)
        for name in manifest["files"]:
            store.get_file(f"{step_name(step)}/{name}", stage / name)
        for name, info in manifest["files"].items():
            _verify_file(stage / name, info)
        return manifest_bytes

    return _assemble(Path(root), step_name(step), "dl", fill)


def _assemble(root: Path, name: str, kind: str, fill: Callable[[Path], bytes], *, replace: bool = False) -> Path:
    """Make ``root/name`` appear whole: ``fill(stage)`` puts the payload into a ``.tmp-`` folder and
    returns the manifest, written last; then fsync and one atomic rename (``FileExistsError`` when
    ``root/name`` is there already, unless ``replace``: then an atomic swap, see ``publish_dir``)."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / name
    stage = root / f"{TMP_PREFIX}{name}-{kind}-{uuid.uuid4().hex[:8]}"
    stage.mkdir()
    try:
        _write_hashed_plain(stage / MANIFEST, fill(stage))
        fsync_dir(stage)
        if final.exists() and not replace:
            raise FileExistsError(str(final))
        publish_dir(stage, final, replace=replace)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return final



def _hash_file(path: Path, into: torch.Tensor | None = None) -> tuple[int, str]:
    """``chunked_sha256`` of a file (chunks hashed in parallel while the next ones are read),
    optionally reading the file into ``into`` (a uint8 tensor of the expected size) on the way."""
    futures: list[cf.Future] = []
    size = 0
    workers = _hash_workers(beside_io=False)  # reading is cheap next to writing: measured 0.50 s vs 0.55 s a GiB
    with open(path, "rb", buffering=0) as f, cf.ThreadPoolExecutor(workers, thread_name_prefix="ckpt-hash") as pool:
        if into is not None:
            mv = _byte_view(into)
            while size < len(mv):
                n = f.readinto(mv[size : size + HASH_CHUNK])
                if not n:
                    break
                if n < min(HASH_CHUNK, len(mv) - size):
                    # Short read: complete the chunk so chunk boundaries match the writer's.
                    while n < min(HASH_CHUNK, len(mv) - size):
                        m = f.readinto(mv[size + n : size + min(HASH_CHUNK, len(mv) - size)])
                        if not m:
                            break
                        n += m
                futures.append(pool.submit(_chunk_digest, mv[size : size + n]))
                size += n
            if f.read(1):
                size += 1  # longer than the manifest says
        else:
            while True:
                chunk = f.read(HASH_CHUNK)
                if not chunk:
                    break
                # Bound the memory in flight to one chunk per worker.
                if len(futures) >= workers:
                    futures[-workers].result()
                futures.append(pool.submit(_chunk_digest, chunk))
                size += len(chunk)
        digest = _combine([x.result() for x in futures])
    return size, digest


def _verify_file(path: Path, info: dict, into: torch.Tensor | None = None) -> None:
    try:
        actual = path.stat().st_size
    except FileNotFoundError:
        raise CheckpointInvalid(f"{path.name} is missing") from None
    if actual != info["size"]:
        raise CheckpointInvalid(f"{path.name} is {actual} bytes, manifest says {info['size']} (truncated or partial)")
    size, digest = _hash_file(path, into)
    if size != info["size"]:
        raise CheckpointInvalid(f"{path.name} changed size while reading")
    if digest != info["sha256"]:
        raise CheckpointInvalid(f"{path.name} sha256 mismatch (corrupted)")


@dataclasses.dataclass
class CheckpointInfo:
    """One checkpoint as seen on one tier by a quick check (manifest + sizes, no hashing)."""

    step: int
    valid: bool
    reason: str           # "" when valid
    bytes: int
    location: str
    created: str = ""
    manifest: dict | None = None


#: Reads of a copy before a verification failure is the copy's and not the transfer's (bits
#: flipped in transit are not a bad checkpoint; a copy corrupt in the store fails every read).
VERIFY_READS = 3


def _quick_check(store: Store, step: int, files: dict[str, int], parse: ManifestParser,
                 key: CheckpointKey | None = None) -> CheckpointInfo:
    loc = store.location(step_name(step))
    total = sum(v for v in files.values() if v > 0)
    if MANIFEST not in files:
        return CheckpointInfo(step, False, "no manifest (incomplete write or upload)", total, loc)
    if files[MANIFEST] > untrusted.MANIFEST_MAX_BYTES:  # not even downloaded
        return CheckpointInfo(step, False, f"manifest is {files[MANIFEST]} bytes, more than the "
                              f"{untrusted.MANIFEST_MAX_BYTES} it may be", total, loc)
    # A manifest that does not check may have been corrupted on the way: read it again before
    # calling the checkpoint invalid (a bad verdict here makes the restore give up this step).
    for read in range(1, VERIFY_READS + 1):
        try:
            data = store.get_bytes(f"{step_name(step)}/{MANIFEST}")
        except KeyError:
            return CheckpointInfo(step, False, "manifest vanished while listing", total, loc)
        try:
            m = parse(data, step, key=key)
            break
        except CheckpointInvalid as e:
            bad = str(e)
        except Exception as e:  # noqa: BLE001 - whatever its bytes are, they are no checkpoint (never a tier unknown)
            bad = f"manifest is malformed ({type(e).__name__}: {e})"[:300]
        if read == VERIFY_READS:
            return CheckpointInfo(step, False, bad, total, loc)
    for name, info in m["files"].items():
        if name not in files:
            return CheckpointInfo(step, False, f"{name} is missing", total, loc, m.get("created", ""))
        if files[name] >= 0 and files[name] != info["size"]:
            return CheckpointInfo(step, False, f"{name} is {files[name]} bytes, manifest says "
                                  f"{info['size']} (truncated or partial)", total, loc, m.get("created", ""))
    return CheckpointInfo(step, True, "", total, loc, m.get("created", ""), m)


def list_checkpoints(store: Store, parse: ManifestParser, *,
                     key: CheckpointKey | None = None) -> list[CheckpointInfo]:
    """Every ``step-N`` on the store, newest first, each quick-checked (manifest self-checksum and
    HMAC, every listed file present with the listed size; no hashing of payloads)."""
    by_step: dict[int, dict[str, int]] = {}
    for name_, size in store.sizes("step-").items():
        folder, _, name = name_.partition("/")
        step = parse_step(folder)
        if step is None or "/" in name:
            continue
        by_step.setdefault(step, {})[name] = size
    return [_quick_check(store, step, by_step[step], parse, key) for step in sorted(by_step, reverse=True)]


def check_checkpoint(store: Store, step: int, parse: ManifestParser, *,
                     key: CheckpointKey | None = None) -> CheckpointInfo | None:
    """Quick check of one step (None when nothing of it exists on the store)."""
    prefix = step_name(step) + "/"
    files = {k[len(prefix):]: v for k, v in store.sizes(prefix).items() if "/" not in k[len(prefix):]}
    return _quick_check(store, step, files, parse, key) if files else None


def read_manifest(folder: Path, parse: ManifestParser, *,
                  key: CheckpointKey | None = None) -> dict:
    """The parsed (self-checked, and with a key authenticated) manifest of a checkpoint folder."""
    folder = Path(folder)
    try:
        data = (folder / MANIFEST).read_bytes()
    except FileNotFoundError:
        raise CheckpointInvalid("no manifest (incomplete write)") from None
    return parse(data, parse_step(folder.name), key=key)



def delete_checkpoint(store: Store, step: int) -> None:
    """Delete ``step-N``: the manifest first, so an interrupted delete leaves an invalid folder
    (never a folder that looks valid but lacks payload)."""
    prefix = step_name(step)
    store.delete(f"{prefix}/{MANIFEST}")
    store.delete_prefix(prefix + "/")


# --------------------------------------------------------------------------------------------
# Digest
# --------------------------------------------------------------------------------------------


def tensor_digest(state_dict: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over tensors in sorted key order: for each, the name, dtype, shape and raw bytes.

    Equal digests mean bitwise-equal weights (used by ``python -m trainer status`` as
    ``model_digest`` and by the resume tests).
    """
    items = state_dict.items() if isinstance(state_dict, dict) else state_dict
    h = hashlib.sha256()
    for name, t in sorted(items, key=lambda kv: kv[0]):
        t = t.detach().to("cpu").contiguous()
        h.update(name.encode() + b"\0")
        h.update(str(t.dtype).encode() + b"\0")
        h.update(json.dumps(list(t.shape)).encode() + b"\0")
        if t.numel():
            h.update(_byte_view(t.reshape(-1).view(torch.uint8)))
        h.update(b"\1")
    return h.hexdigest()

