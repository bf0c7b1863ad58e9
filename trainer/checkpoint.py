"""The checkpoint format: one ``step-NNNNNNNN/`` folder (or GCS prefix) per checkpoint.

A checkpoint holds three files::

    step-00001200/
        tensors.bin    every tensor's raw bytes, 64-byte aligned, back to back
        state.pt       the state's structure and plain Python objects (torch.save), with each
                       tensor replaced by a reference into tensors.bin (offset, dtype, shape)
        manifest.json  written LAST: format, step, time, torch version, world size, meta, and the
                       size and sha256 of every other file (``chunked_sha256``: the sha256 of
                       the 64 MiB chunks' sha256s, so hashing runs on several cores), plus a
                       sha256 of the manifest itself

A checkpoint is valid only if its manifest parses, its self-checksum matches and every file it
lists has the listed size and sha256. The manifest is the commit record: it is written last on
every tier, so an interrupted write or upload never produces a valid checkpoint.

On a directory tier the folder is assembled under a ``.tmp-`` name, every file and the folder are
fsynced, and the folder becomes visible by one atomic ``rename`` (then the parent is fsynced). On
GCS the payload objects are uploaded create-only, then the manifest: from a committed folder
(``upload_dir``) or, when no disk tier could take the save, from the snapshot in host memory
(``upload_snapshot``); both build the manifest the same way (``snapshot_manifest``).

Why raw tensor bytes rather than one ``torch.save``: the snapshot already sits in one contiguous
host buffer (see ``SnapshotBuffer``), so writing it is a handful of large ``os.write`` calls that
run at disk bandwidth, while the chunk hashes run on other cores over the same memory. Loading maps
every tensor as a view into one buffer read with ``readinto`` (no per-tensor allocation).

This module also owns ``tensor_digest`` (a content digest of a model state dict).
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import dataclasses
import hashlib
import io
import json
import logging
import os
import pickle
import re
import shutil
import threading
import time
import uuid
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from trainer.storage import TMP_PREFIX, DirStore, GcsStore, Store, copy_file_durable, fsync_dir

log = logging.getLogger(__name__)

FORMAT = "spottrain-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
STATE = "state.pt"
TENSORS = "tensors.bin"
PAYLOAD = (STATE, TENSORS)
ALIGN = 64
_IO_CHUNK = 32 << 20
#: Files are hashed in chunks of this size, in parallel; see ``chunked_sha256``.
HASH_CHUNK = 64 << 20
HASH_NAME = "sha256-of-64MiB-chunk-sha256s"
_STEP_RE = re.compile(r"^step-(\d{8,})$")


class CheckpointInvalid(Exception):
    """A checkpoint that must not be used; ``str(exc)`` is the reason for the log."""


#: Reason prefix of a valid-looking checkpoint of the other layout (whole-model vs sharded): never
#: deleted by retention, and a restore that meets one refuses to start afresh over it.
OTHER_LAYOUT = "other layout: "


def other_layout(reason: str) -> bool:
    return reason.startswith(OTHER_LAYOUT)


def layout_mismatch(this: str, found: list[str]) -> str:
    """The message of a run whose tiers hold checkpoints of the other layout."""
    return (f'cannot resume: this run has parallelism = "{this}", but its tiers hold checkpoints of '
            f"the other layout ({'; '.join(found[:5])}); use the original parallelism, or a new "
            "--run-dir/--gcs-uri for a new run (nothing was deleted)")


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def parse_step(name: str) -> int | None:
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


# --------------------------------------------------------------------------------------------
# Tensor references inside the pickled structure
# --------------------------------------------------------------------------------------------


class TensorRef:
    """Stands in for a tensor inside ``state.pt``: index into the tensor table."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self) -> tuple[Any, tuple[int]]:
        return (TensorRef, (self.index,))

    def __repr__(self) -> str:
        return f"TensorRef({self.index})"


# Allow TensorRef in weights_only loads (the safe unpickler refuses unknown classes).
torch.serialization.add_safe_globals([TensorRef])


def _raw_ok(t: torch.Tensor) -> bool:
    return (t.layout == torch.strided and not t.is_quantized and t.device.type != "meta"
            and not t.is_nested and type(t) in (torch.Tensor, torch.nn.Parameter))


def _replace_tensors(obj: Any, found: list[torch.Tensor], ids: dict[int, int]) -> Any:
    """Copy of the container structure with plain tensors replaced by ``TensorRef``s.

    The same tensor object appearing twice (tied weights) is stored once and restored as one
    object. Tensors inside other objects stay where they are and are pickled by torch.save.
    """
    if isinstance(obj, torch.Tensor):
        if not _raw_ok(obj):
            return obj
        i = ids.get(id(obj))
        if i is None:
            i = ids[id(obj)] = len(found)
            found.append(obj)
        return TensorRef(i)
    t = type(obj)
    if t is dict:
        return {k: _replace_tensors(v, found, ids) for k, v in obj.items()}
    if t is OrderedDict:
        return OrderedDict((k, _replace_tensors(v, found, ids)) for k, v in obj.items())
    if t is list:
        return [_replace_tensors(v, found, ids) for v in obj]
    if t is tuple:
        return tuple(_replace_tensors(v, found, ids) for v in obj)
    return obj


def _resolve(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, TensorRef):
        return tensors[obj.index]
    t = type(obj)
    if t is dict:
        return {k: _resolve(v, tensors) for k, v in obj.items()}
    if t is OrderedDict:
        return OrderedDict((k, _resolve(v, tensors)) for k, v in obj.items())
    if t is list:
        return [_resolve(v, tensors) for v in obj]
    if t is tuple:
        return tuple(_resolve(v, tensors) for v in obj)
    return obj


def _dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise CheckpointInvalid(f"unknown dtype {name!r} in tensor table")
    return dt


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _byte_view(buf: torch.Tensor, nbytes: int | None = None) -> memoryview:
    """A writable memoryview over a contiguous CPU uint8 tensor (no copy, no numpy needed)."""
    n = buf.numel() if nbytes is None else nbytes
    if n == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_ubyte * n).from_address(buf.data_ptr())).cast("B")


# --------------------------------------------------------------------------------------------
# Snapshot: the only part that blocks the training loop
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Snapshot:
    """A point-in-time copy of a state in host memory, ready to be written by any thread."""

    step: int
    structure: bytes          # state.pt bytes
    arena: torch.Tensor       # uint8 host buffer; tensors.bin is arena[:nbytes]
    nbytes: int
    meta: dict
    created_unix: float

    def tensor_bytes(self) -> memoryview:
        return _byte_view(self.arena, self.nbytes)


class SnapshotBuffer:
    """Reusable host buffer for snapshots.

    The buffer is allocated once (pinned when CUDA tensors are involved, so device-to-host copies
    are DMA and asynchronous) and reused by every later save of the same or a smaller state: a
    fresh 1 GB allocation would page-fault on every save, which costs more than the copy itself.
    The buffer is pre-touched at allocation for the same reason. Only one snapshot may use the
    buffer at a time; the checkpointer guarantees that (one save in flight).
    """

    def __init__(self) -> None:
        self.arena: torch.Tensor | None = None
        self.pinned = False
        self.allocations = 0
        #: Seconds the last ``take`` spent allocating the buffer (a one-off, not a per-save cost).
        self.last_alloc_s = 0.0
        self._lock = threading.Lock()  # reserve() may run on another thread

    def _ensure(self, nbytes: int, pinned: bool) -> torch.Tensor:
        a = self.arena
        if a is None or a.numel() < nbytes or (pinned and not self.pinned):
            t0 = time.perf_counter()
            self.arena = None  # drop the old one first: peak memory is one buffer
            cap = max(nbytes, ALIGN)
            a = torch.empty(cap, dtype=torch.uint8, pin_memory=pinned)
            a.fill_(0)  # touch every page now, not during the first copy
            self.arena, self.pinned = a, pinned
            self.allocations += 1
            self.last_alloc_s += time.perf_counter() - t0
        return a

    def reserve(self, state: Any) -> None:
        """Allocate the buffer for a state of this shape ahead of the first save (e.g. right
        after a restore, while the loop is starting anyway)."""
        found: list[torch.Tensor] = []
        _replace_tensors(state, found, {})
        total = sum((t.numel() * t.element_size() + ALIGN - 1) // ALIGN * ALIGN for t in found)
        with self._lock:
            self._ensure(total, pinned=torch.cuda.is_available())

    def take(self, step: int, state: Any, meta: dict | None = None) -> Snapshot:
        with self._lock:
            return self._take(step, state, meta)

    def _take(self, step: int, state: Any, meta: dict | None) -> Snapshot:
        self.last_alloc_s = 0.0
        found: list[torch.Tensor] = []
        structure_obj = _replace_tensors(state, found, {})
        table = []
        off = 0
        for t in found:
            nbytes = t.numel() * t.element_size()
            table.append((off, nbytes, str(t.dtype), tuple(t.shape),
                          bool(t.requires_grad), type(t) is torch.nn.Parameter))
            off += (nbytes + ALIGN - 1) // ALIGN * ALIGN
        any_cuda = any(t.device.type == "cuda" for t in found)
        arena = self._ensure(off, pinned=any_cuda and torch.cuda.is_available())
        base = arena.data_ptr()
        for t, (o, n, _, shape, _, _) in zip(found, table):
            if n == 0:
                continue
            if t.device.type == "cpu" and t.is_contiguous() and not (t.is_conj() or t.is_neg()):
                # A plain memmove is 3-4x faster than Tensor.copy_ for large CPU tensors here
                # (measured: 0.11 s vs 0.6 s per GiB) and this copy is the loop's whole cost.
                ctypes.memmove(base + o, t.data_ptr(), n)
            else:
                dst = arena[o : o + n].view(t.dtype).view(shape)
                dst.copy_(t.detach(), non_blocking=t.device.type == "cuda")
        if any_cuda:
            torch.cuda.synchronize()
        # Pickling here (while the loop waits) freezes the plain Python objects too: the loop may
        # mutate them (data position, counters) as soon as save() returns.
        buf = io.BytesIO()
        torch.save({"format": FORMAT, "version": FORMAT_VERSION, "tree": structure_obj,
                    "tensors": table}, buf)
        return Snapshot(step=step, structure=buf.getvalue(), arena=arena, nbytes=off,
                        meta=dict(meta or {}), created_unix=time.time())


# --------------------------------------------------------------------------------------------
# Manifest
# --------------------------------------------------------------------------------------------


def _canonical(obj: dict) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def build_manifest(step: int, files: dict[str, dict], meta: dict, created_unix: float) -> bytes:
    body = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "hash": HASH_NAME,
        "step": step,
        "created_unix": created_unix,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created_unix)),
        "torch_version": torch.__version__,
        "world_size": int(meta.get("world_size", 1)) if isinstance(meta.get("world_size", 1), int) else 1,
        "meta": meta,
        "files": files,
    }
    body["manifest_sha256"] = hashlib.sha256(_canonical(body)).hexdigest()
    return json.dumps(body, sort_keys=True, indent=1).encode()


def parse_manifest_header(data: bytes) -> dict:
    """The checks every layout's manifest shares: JSON, format marker, version, file hash, and
    the self-checksum; raise ``CheckpointInvalid`` with the reason."""
    try:
        m = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointInvalid(f"manifest is not valid JSON ({e})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CheckpointInvalid("manifest has no spottrain format marker")
    if m.get("version") != FORMAT_VERSION:
        raise CheckpointInvalid(f"unsupported checkpoint format version {m.get('version')!r}")
    if m.get("hash") != HASH_NAME:
        raise CheckpointInvalid(f"unsupported file hash {m.get('hash')!r}")
    want = m.pop("manifest_sha256", None)
    if want != hashlib.sha256(_canonical(m)).hexdigest():
        raise CheckpointInvalid("manifest checksum mismatch (manifest corrupted)")
    m["manifest_sha256"] = want
    return m


def check_manifest_entries(m: dict, step: int | None) -> dict:
    """Every file entry has a size and a sha256, and the manifest's step is the folder's."""
    for name, info in m["files"].items():
        if not (isinstance(info, dict) and isinstance(info.get("size"), int)
                and isinstance(info.get("sha256"), str)):
            raise CheckpointInvalid(f"manifest entry for {name} is malformed")
    if step is not None and m.get("step") != step:
        raise CheckpointInvalid(f"manifest says step {m.get('step')!r}, folder says {step}")
    return m


def parse_manifest(data: bytes, step: int | None = None) -> dict:
    """Parse and self-check a single-process manifest; raise ``CheckpointInvalid`` with the reason."""
    m = parse_manifest_header(data)
    if isinstance(m.get("meta"), dict) and m["meta"].get("sharded"):
        raise CheckpointInvalid(OTHER_LAYOUT + 'a sharded checkpoint (written with parallelism = "fsdp")')
    files = m.get("files")
    if not isinstance(files, dict) or set(files) != set(PAYLOAD):
        raise CheckpointInvalid("manifest file list is incomplete")
    return check_manifest_entries(m, step)


#: A layout's manifest parser: ``parse_manifest`` here, ``sharded.parse_sharded_manifest``.
ManifestParser = Callable[[bytes, "int | None"], dict]


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


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


def _hash_workers() -> int:
    return max(2, min(8, os.cpu_count() or 2))


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


def write_dir(snap: Snapshot, root: Path) -> tuple[Path, dict]:
    """Write ``snap`` as ``root/step-N/`` atomically; returns (folder, manifest dict).

    Raises FileExistsError if a folder of that step is already there (the caller decides).
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_name(snap.step)
    if final.exists():
        raise FileExistsError(str(final))
    stage = root / f"{TMP_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
    stage.mkdir()
    try:
        with cf.ThreadPoolExecutor(_hash_workers(), thread_name_prefix="ckpt-hash") as pool:
            files = {
                TENSORS: _write_hashed(stage / TENSORS, snap.tensor_bytes(), pool),
                STATE: _write_hashed(stage / STATE, memoryview(snap.structure), pool),
            }
        manifest = snapshot_manifest(snap, files)
        _write_hashed_plain(stage / MANIFEST, manifest)
        fsync_dir(stage)
        os.rename(stage, final)  # the commit point: the folder appears complete or not at all
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return final, json.loads(manifest)


def snapshot_manifest(snap: Snapshot, files: dict[str, dict]) -> bytes:
    """The manifest of ``snap`` whose payload files have these sizes and digests: the one place
    a whole-model manifest is built, for a disk folder and for an upload from memory alike."""
    return build_manifest(snap.step, files, snap.meta, snap.created_unix)


def snapshot_files(snap: Snapshot) -> dict[str, dict]:
    """Size and ``chunked_sha256`` of every payload file of ``snap``, hashed from host memory
    (what ``write_dir`` computes while writing), for an upload without a disk copy."""
    with cf.ThreadPoolExecutor(_hash_workers(), thread_name_prefix="ckpt-hash") as pool:
        data = {TENSORS: snap.tensor_bytes(), STATE: memoryview(snap.structure)}
        return {name: {"size": len(mv), "sha256": chunked_sha256(mv, pool)} for name, mv in data.items()}


def _write_hashed_plain(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        mv = memoryview(data)
        while mv:
            mv = mv[os.write(fd, mv):]
        os.fsync(fd)
    finally:
        os.close(fd)


def upload_dir(src: Path, store: GcsStore, step: int, *, deadline: float | None = None,
               parse: ManifestParser = parse_manifest) -> None:
    """Upload a committed checkpoint folder to GCS: every file its manifest lists (``parse``: the
    layout's manifest parser, default ``parse_manifest``) create-only, then the manifest.

    With ``deadline`` (time.monotonic), the upload gives up when it passes; the manifest is never
    uploaded after the deadline, so a late upload leaves only payload objects, which no restore
    will choose.
    """
    prefix = step_name(step)
    manifest = (Path(src) / MANIFEST).read_bytes()
    names = sorted(parse(manifest, step)["files"])
    with store.deadline(deadline):
        for name in names:
            store.put_file(Path(src) / name, f"{prefix}/{name}")
        _put_manifest(store, prefix, manifest, deadline)


def upload_snapshot(snap: Snapshot, store: GcsStore, *, deadline: float | None = None) -> None:
    """Upload ``snap`` straight from host memory (its disk copy could not be written): the payload
    create-only, then the manifest, as ``upload_dir`` does for a folder."""
    prefix = step_name(snap.step)
    files = snapshot_files(snap)
    manifest = snapshot_manifest(snap, files)
    with store.deadline(deadline):
        store.put_memory(f"{prefix}/{TENSORS}", snap.tensor_bytes())
        store.put_memory(f"{prefix}/{STATE}", snap.structure)
        _put_manifest(store, prefix, manifest, deadline)


def _put_manifest(store: GcsStore, prefix: str, manifest: bytes, deadline: float | None) -> None:
    if deadline is not None and time.monotonic() > deadline:
        from trainer.storage import UploadAborted

        raise UploadAborted("deadline passed before the manifest upload")
    store.put_bytes(f"{prefix}/{MANIFEST}", manifest)


def copy_dir(src: Path, root: Path, parse: ManifestParser = parse_manifest) -> Path:
    """Copy a checkpoint folder holding its manifest (a committed one, or a staging folder) into
    ``root/step-N/`` (another disk tier) atomically: every file the manifest lists, fsynced, the
    manifest last, then the rename."""
    src = Path(src)
    manifest = (src / MANIFEST).read_bytes()
    m = parse(manifest, parse_step(src.name))

    def fill(stage: Path) -> bytes:
        for name in m["files"]:
            copy_file_durable(src / name, stage / name)
        return manifest

    return _assemble(Path(root), step_name(m["step"]), "cp", fill)


def download_dir(store: Store, step: int, root: Path, parse: ManifestParser = parse_manifest) -> Path:
    """Copy ``step-N`` from ``store`` into ``root/step-N/`` atomically (manifest fetched last is
    irrelevant here: the folder only appears after everything arrived and was verified).
    ``parse``: the layout's manifest parser (default ``parse_manifest``), which says the files."""
    def fill(stage: Path) -> bytes:
        manifest_bytes = store.get_bytes(f"{step_name(step)}/{MANIFEST}")
        manifest = parse(manifest_bytes, step)
        for name in manifest["files"]:
            store.get_file(f"{step_name(step)}/{name}", stage / name)
        for name, info in manifest["files"].items():
            _verify_file(stage / name, info)
        return manifest_bytes

    return _assemble(Path(root), step_name(step), "dl", fill)


def _assemble(root: Path, name: str, kind: str, fill: Callable[[Path], bytes]) -> Path:
    """Make ``root/name`` appear whole: ``fill(stage)`` puts the payload into a ``.tmp-`` folder and
    returns the manifest, written last; then fsync and one atomic rename (``FileExistsError`` when
    ``root/name`` is there already)."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / name
    stage = root / f"{TMP_PREFIX}{name}-{kind}-{uuid.uuid4().hex[:8]}"
    stage.mkdir()
    try:
        _write_hashed_plain(stage / MANIFEST, fill(stage))
        fsync_dir(stage)
        if final.exists():
            raise FileExistsError(str(final))
        os.rename(stage, final)
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return final


# --------------------------------------------------------------------------------------------
# Verification and listing
# --------------------------------------------------------------------------------------------


def _hash_file(path: Path, into: torch.Tensor | None = None) -> tuple[int, str]:
    """``chunked_sha256`` of a file (chunks hashed in parallel while the next ones are read),
    optionally reading the file into ``into`` (a uint8 tensor of the expected size) on the way."""
    futures: list[cf.Future] = []
    size = 0
    workers = _hash_workers()
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


def _store_location(store: Store, step: int) -> str:
    if isinstance(store, DirStore):
        return str(store.root / step_name(step))
    if isinstance(store, GcsStore):
        return store.location(step_name(step))
    return f"{store.name}:{step_name(step)}"


def _sizes(store: Store, prefix: str) -> dict[str, int]:
    if isinstance(store, DirStore) and not store.root.is_dir():
        return {}
    return store.sizes(prefix) if hasattr(store, "sizes") else {k: -1 for k in store.list(prefix)}


def _quick_check(store: Store, step: int, files: dict[str, int], parse: ManifestParser) -> CheckpointInfo:
    loc = _store_location(store, step)
    total = sum(v for v in files.values() if v > 0)
    if MANIFEST not in files:
        return CheckpointInfo(step, False, "no manifest (incomplete write or upload)", total, loc)
    try:
        m = parse(store.get_bytes(f"{step_name(step)}/{MANIFEST}"), step)
    except KeyError:
        return CheckpointInfo(step, False, "manifest vanished while listing", total, loc)
    except CheckpointInvalid as e:
        return CheckpointInfo(step, False, str(e), total, loc)
    for name, info in m["files"].items():
        if name not in files:
            return CheckpointInfo(step, False, f"{name} is missing", total, loc, m.get("created", ""))
        if files[name] >= 0 and files[name] != info["size"]:
            return CheckpointInfo(step, False, f"{name} is {files[name]} bytes, manifest says "
                                  f"{info['size']} (truncated or partial)", total, loc, m.get("created", ""))
    return CheckpointInfo(step, True, "", total, loc, m.get("created", ""), m)


def list_checkpoints(store: Store, parse: ManifestParser = parse_manifest) -> list[CheckpointInfo]:
    """Every ``step-N`` on the store, newest first, each quick-checked (manifest self-checksum,
    every listed file present with the listed size; no hashing of payloads)."""
    by_step: dict[int, dict[str, int]] = {}
    for key, size in _sizes(store, "step-").items():
        folder, _, name = key.partition("/")
        step = parse_step(folder)
        if step is None or "/" in name:
            continue
        by_step.setdefault(step, {})[name] = size
    return [_quick_check(store, step, by_step[step], parse) for step in sorted(by_step, reverse=True)]


def check_checkpoint(store: Store, step: int, parse: ManifestParser = parse_manifest) -> CheckpointInfo | None:
    """Quick check of one step (None when nothing of it exists on the store)."""
    prefix = step_name(step) + "/"
    files = {k[len(prefix):]: v for k, v in _sizes(store, prefix).items() if "/" not in k[len(prefix):]}
    return _quick_check(store, step, files, parse) if files else None


def verify_dir(folder: Path) -> dict:
    """Full verification of a checkpoint folder (every sha256); returns the manifest."""
    folder = Path(folder)
    step = parse_step(folder.name)
    try:
        data = (folder / MANIFEST).read_bytes()
    except FileNotFoundError:
        raise CheckpointInvalid("no manifest (incomplete write)") from None
    m = parse_manifest(data, step)
    for name in PAYLOAD:
        _verify_file(folder / name, m["files"][name])
    return m


def load_dir(folder: Path, *, verified_manifest: dict | None = None) -> tuple[dict, Any]:
    """Verify every file of ``folder`` against its manifest and load the state.

    Returns (manifest, state). Tensors come back on CPU, contiguous, as views into one buffer.
    """
    folder = Path(folder)
    step = parse_step(folder.name)
    if verified_manifest is None:
        try:
            data = (folder / MANIFEST).read_bytes()
        except FileNotFoundError:
            raise CheckpointInvalid("no manifest (incomplete write)") from None
        verified_manifest = parse_manifest(data, step)
    m = verified_manifest
    tinfo = m["files"][TENSORS]
    buf = torch.empty(max(tinfo["size"], 1), dtype=torch.uint8)
    _verify_file(folder / TENSORS, tinfo, into=buf[: tinfo["size"]])
    try:
        raw = (folder / STATE).read_bytes()
    except FileNotFoundError:
        raise CheckpointInvalid(f"{STATE} is missing") from None
    if len(raw) != m["files"][STATE]["size"]:
        raise CheckpointInvalid(f"{STATE} is {len(raw)} bytes, manifest says "
                                f"{m['files'][STATE]['size']} (truncated or partial)")
    if chunked_sha256(raw) != m["files"][STATE]["sha256"]:
        raise CheckpointInvalid(f"{STATE} sha256 mismatch (corrupted)")
    obj = _load_structure(raw, folder)
    try:
        table = obj["tensors"]
        tensors = []
        for off, nbytes, dtype_name, shape, requires_grad, is_param in table:
            dtype = _dtype_from_name(dtype_name)
            if off + nbytes > tinfo["size"]:
                raise CheckpointInvalid("tensor table points past the end of tensors.bin")
            t = buf[off : off + nbytes].view(dtype).view(tuple(shape))
            if is_param:
                t = torch.nn.Parameter(t, requires_grad=requires_grad)
            elif requires_grad:
                t.requires_grad_(True)
            tensors.append(t)
        state = _resolve(obj["tree"], tensors)
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as e:
        raise CheckpointInvalid(f"{STATE} structure is inconsistent ({type(e).__name__}: {e})") from None
    return m, state


def _load_structure(raw: bytes, folder: Path) -> dict:
    # weights_only=True first: it unpickles only tensors, containers and primitive types, which is
    # what most states are (RNG states from torch/random are tuples of ints and byte tensors).
    # Some states hold plain Python objects the safe unpickler refuses (numpy's RNG state, user
    # dataclasses). For those we fall back to weights_only=False, and ONLY here, after the bytes
    # matched the sha256 in the manifest: the checksum proves they are exactly the bytes our own
    # save wrote, not corrupted or half-written data. The run dir and bucket are as trusted as the
    # code being run (whoever can write them can also change the startup script), so this does
    # not widen what an attacker with write access can already do.
    try:
        obj = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        log.info("%s: %s needs full unpickling (%s); loading with weights_only=False after its "
                 "sha256 matched the manifest", folder, STATE, str(e).splitlines()[0][:120])
        try:
            obj = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=False)
        except Exception as e2:  # noqa: BLE001 - any unpickling failure means unusable
            raise CheckpointInvalid(f"{STATE} cannot be unpickled ({type(e2).__name__}: {e2})") from None
    except Exception as e:  # noqa: BLE001
        raise CheckpointInvalid(f"{STATE} cannot be loaded ({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise CheckpointInvalid(f"{STATE} is not a spottrain structure")
    return obj


def delete_checkpoint(store: Store, step: int) -> None:
    """Delete ``step-N``: the manifest first, so an interrupted delete leaves an invalid folder
    (never a folder that looks valid but lacks payload)."""
    prefix = step_name(step)
    if isinstance(store, DirStore):
        store.delete(f"{prefix}/{MANIFEST}")
    elif isinstance(store, GcsStore):
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
