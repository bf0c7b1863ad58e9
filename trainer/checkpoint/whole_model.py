"""The whole-model layout: one process holds the whole state, and rank 0 saves it.

A checkpoint holds three files::

    step-00001200/
        tensors.bin    every tensor's raw bytes, 64-byte aligned, back to back
        state.json     the state's structure and plain Python values as JSON
                       (``trainer.checkpoint.state_codec``), each tensor a reference into the table
                       of tensors.bin (offset, size, dtype by name, shape)
        manifest.json  written LAST: the commit record every layout shares
                       (``trainer.checkpoint.manifest``), here listing exactly the two files above

Nothing in it is ever unpickled: the structure is JSON and tensors are raw bytes read by dtype and
shape. Format 1 (a pickled ``state.pt``) is recognised and never loaded.

Staging (``stage``): the state is copied into a reusable host buffer (``SnapshotBuffer``, pinned
when CUDA is involved) and its plain values are encoded: the only part that holds the loop. The
tensors of the bound optimizer (its parameters and its state), which only its step writes, are
copied beside the loop's next forward and backward (``trainer.checkpoint.background_copy``);
every reader of the buffer waits for that copy first.
Writing (``write``): every due disk tier is written straight from the buffer (``write_dir``:
temporary folder, every file fsynced, manifest last, atomic rename); an emergency save writes them
all at once, so the local SSD never delays the persistent disk. When no disk tier takes a save
that a remote tier is due for (a full or read-only disk), the upload reads the buffer itself
(``memory_file``, with the manifest hashed from memory: ``snapshot_manifest``), which it then holds.

Host memory: at most two buffers while training (``MAX_BUFFERS``). The second is allocated only
while an upload from memory holds the first; a queued upload from memory is dropped when its
buffer is needed (``stage``'s ``make_room``), and ``can_stage`` answers False when neither buffer
is free. An explicit save (final, pause, emergency) never waits for the network: it takes another
buffer if both are held by uploads.

Why raw tensor bytes rather than one ``torch.save``: the snapshot already sits in one contiguous
host buffer, so writing it is a handful of large ``os.write`` calls that run at disk bandwidth,
while the chunk hashes run on other cores over the same memory. Loading maps every tensor as a
view into one buffer read with ``readinto`` (no per-tensor allocation), verifying every chunk as
it reads (``verify_on_obtain`` False: one pass).
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import dataclasses
import json
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import torch

from trainer.checkpoint import background_copy, state_codec
from trainer.checkpoint import file_hash
from trainer.checkpoint.file_hash import byte_view, hash_workers
from trainer.checkpoint.format import (CheckpointInfo, _verify_file, _write_hashed, _write_hashed_plain,
                                       list_checkpoints, publish_dir, read_manifest)
from trainer.checkpoint.key import CheckpointKey
from trainer.checkpoint.layout import OneProcess, OnTier, Plan, Written, disk_folder
from trainer.checkpoint.manifest import (MANIFEST, OTHER_LAYOUT, CheckpointInvalid,
                                         CheckpointUnloadable, StepOccupied, build_manifest,
                                         check_manifest_entries, parse_manifest_header, step_name)
from trainer.checkpoint.stores import TMP_PREFIX, Store, fsync_dir
from trainer.checkpoint.tiers import Tier

#: Buffers a training run keeps at most (see the module docstring).
MAX_BUFFERS = 2

STATE = "state.json"
#: Format 1's pickled structure: recognised, never unpickled.
LEGACY_STATE = "state.pt"
STRUCTURE = "spottrain-state"
TENSORS = "tensors.bin"
PAYLOAD = (STATE, TENSORS)
ALIGN = 64


def _encode_structure(state: Any) -> tuple[Any, list[torch.Tensor]]:
    """(JSON-ready tree, tensors in table order). The same tensor object appearing twice (tied
    weights) is stored once and restored as one object. ``state_codec.NotPlainData`` names anything
    that is not plain data."""
    found: list[torch.Tensor] = []
    ids: dict[int, int] = {}

    def ref(t: torch.Tensor, path: tuple) -> dict:
        i = ids.get(id(t))
        if i is None:
            state_codec.check_tensor(t, path)
            i = ids[id(t)] = len(found)
            found.append(t)
        return {state_codec.TAG: "t", "i": i}

    return state_codec.encode(state, ref), found


def encode_state(state: Any) -> tuple[bytes, list[torch.Tensor], list[tuple], int]:
    """``state`` as ``state.json`` holds it and ``tensors.bin`` lays it out: (the structure's bytes,
    the tensors in table order, the table: each tensor's offset, bytes, dtype, shape, requires_grad
    and whether it is a Parameter, and tensors.bin's size, each tensor at an ``ALIGN``-byte
    offset). ``decode_state`` is its inverse. Also what a restore sends between ranks
    (``trainer.checkpoint.broadcast``)."""
    tree, found = _encode_structure(state)
    table = []
    off = 0
    for t in found:
        nbytes = t.numel() * t.element_size()
        table.append((off, nbytes, str(t.dtype), tuple(t.shape),
                      bool(t.requires_grad), type(t) is torch.nn.Parameter))
        off += (nbytes + ALIGN - 1) // ALIGN * ALIGN
    structure = json.dumps({"format": STRUCTURE, "version": 1, "tensors": table, "tree": tree},
                           separators=(",", ":"), allow_nan=False).encode()
    return structure, found, table, off


@dataclasses.dataclass
class Snapshot:
    """A point-in-time copy of a state in host memory, ready to be written by any thread."""

    step: int
    structure: bytes          # state.json bytes
    arena: torch.Tensor       # uint8 host buffer; tensors.bin is arena[:nbytes]
    nbytes: int
    meta: dict
    created_unix: float
    copy: background_copy.BackgroundCopy | None = None  # the part still being copied

    def copied(self) -> None:
        """Block until the buffer holds the whole state (raises when the copy failed)."""
        if self.copy is not None:
            self.copy.wait()

    def tensor_bytes(self) -> memoryview:
        self.copied()
        return byte_view(self.arena, self.nbytes)


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
        _, found = _encode_structure(state)
        total = sum((t.numel() * t.element_size() + ALIGN - 1) // ALIGN * ALIGN for t in found)
        with self._lock:
            self._ensure(total, pinned=torch.cuda.is_available())

    def take(self, step: int, state: Any, meta: dict | None = None, *,
             later: Callable[[torch.Tensor], bool] | None = None) -> Snapshot:
        """Copy ``state`` into the buffer. The tensors ``later`` accepts (the weights and the
        optimizer state) are copied in the background, beside the loop's next step
        (``trainer.checkpoint.background_copy``): the snapshot's ``copy``, which readers of its
        bytes wait for. Everything else is copied before this returns."""
        with self._lock:
            return self._take(step, state, meta, later)

    def _take(self, step: int, state: Any, meta: dict | None, later: Callable[[torch.Tensor], bool] | None) -> Snapshot:
        self.last_alloc_s = 0.0
        # Encoding here (while the loop waits) freezes the plain Python objects too: the loop may
        # mutate them (data position, counters) as soon as save() returns. Before any copy starts:
        # a state that cannot be encoded leaves no copy running into the buffer.
        structure, found, table, off = encode_state(state)  # NotPlainData here, in the caller's thread
        any_cuda = any(t.device.type == "cuda" for t in found)
        arena = self._ensure(off, pinned=any_cuda and torch.cuda.is_available())
        base = arena.data_ptr()
        behind: list[background_copy.Part] = []
        for t, (o, n, *_) in zip(found, table):
            pad = (n + ALIGN - 1) // ALIGN * ALIGN - n
            if pad:  # no stale bytes of an earlier snapshot between tensors
                ctypes.memset(base + o + n, 0, pad)
            if n == 0:
                continue
            if later is not None and later(t):
                behind.append((o, n, t))
            else:
                background_copy.copy_tensor(arena, o, n, t)  # the loop's cost
        copy = None
        if behind or any_cuda:
            # The CUDA copies queued here (non-blocking) are waited for with the background ones.
            devices = {t.device for t in found if t.device.type == "cuda"}
            copy = background_copy.BackgroundCopy(arena, behind, devices)
        return Snapshot(step=step, structure=structure, arena=arena, nbytes=off,
                        meta=dict(meta or {}), created_unix=time.time(), copy=copy)




def parse_manifest(data: bytes, step: int | None = None, *, key: CheckpointKey | None = None) -> dict:
    """Parse and self-check a single-process manifest (and its HMAC with a ``key``); raise
    ``CheckpointInvalid`` with the reason."""
    m = parse_manifest_header(data, key)
    if isinstance(m.get("meta"), dict) and m["meta"].get("sharded"):
        raise CheckpointInvalid(OTHER_LAYOUT + 'a sharded checkpoint (written with parallelism = "fsdp")')
    files = m.get("files")
    if not isinstance(files, dict) or set(files) != set(PAYLOAD):
        raise CheckpointInvalid("manifest file list is incomplete")
    return check_manifest_entries(m, step)




def write_dir(snap: Snapshot, root: Path, *, key: CheckpointKey | None = None, writer: str | None = None,
              replace: bool = False) -> tuple[Path, dict]:
    """Write ``snap`` as ``root/step-N/`` atomically; returns (folder, manifest dict). ``key`` signs
    the manifest; ``writer`` is the saving session's id.

    A folder of that step already there raises FileExistsError (the caller decides), unless
    ``replace``: then the new folder takes its place atomically (``publish_dir``).
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_name(snap.step)
    if final.exists() and not replace:
        raise FileExistsError(str(final))
    stage = root / f"{TMP_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
    stage.mkdir()
    try:
        fh = file_hash.for_writing()
        with cf.ThreadPoolExecutor(hash_workers(), thread_name_prefix="ckpt-hash") as pool:
            files = {
                TENSORS: _write_hashed(stage / TENSORS, snap.tensor_bytes(), pool, fh),
                STATE: _write_hashed(stage / STATE, memoryview(snap.structure), pool, fh),
            }
        manifest = snapshot_manifest(snap, files, key=key, writer=writer)
        _write_hashed_plain(stage / MANIFEST, manifest)
        fsync_dir(stage)
        publish_dir(stage, final, replace=replace)  # the commit point
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return final, json.loads(manifest)



def snapshot_manifest(snap: Snapshot, files: dict[str, dict], *, key: CheckpointKey | None = None,
                      writer: str | None = None) -> bytes:
    """The manifest of ``snap`` whose payload files have these sizes and digests: the one place
    a whole-model manifest is built, for a disk folder and for an upload from memory alike."""
    return build_manifest(snap.step, files, snap.meta, snap.created_unix, key=key, writer=writer)


def snapshot_files(snap: Snapshot) -> dict[str, dict]:
    """The manifest entry (size and digest, ``trainer.checkpoint.file_hash``) of every payload file
    of ``snap``, hashed from host memory (what ``write_dir`` computes while writing), for an upload
    without a disk copy."""
    fh = file_hash.for_writing()
    with cf.ThreadPoolExecutor(hash_workers(beside_io=False), thread_name_prefix="ckpt-hash") as pool:
        data = {TENSORS: snap.tensor_bytes(), STATE: memoryview(snap.structure)}
        return {name: fh.entry(len(mv), fh.of(mv, pool)) for name, mv in data.items()}



def verify_dir(folder: Path, *, key: CheckpointKey | None = None) -> dict:
    """Full verification of a checkpoint folder (manifest, HMAC with a key, every file's digest);
    returns the manifest."""
    m = read_manifest(folder, parse_manifest, key=key)
    fh = file_hash.of_manifest(m)
    for name in PAYLOAD:
        _verify_file(Path(folder) / name, m["files"][name], fh)
    return m


def load_dir(folder: Path, *, verified_manifest: dict | None = None,
             key: CheckpointKey | None = None) -> tuple[dict, Any]:
    """Verify every file of ``folder`` against its manifest (authenticated with ``key``) and load
    the state: ``CheckpointInvalid`` when something does not verify, ``CheckpointUnloadable``
    when everything verified but the structure cannot be decoded.

    Returns (manifest, state). Tensors come back on CPU, contiguous, as views into one buffer.
    """
    folder = Path(folder)
    m = verified_manifest if verified_manifest is not None else read_manifest(folder, parse_manifest, key=key)
    tinfo = m["files"][TENSORS]
    fh = file_hash.of_manifest(m)
    buf = torch.empty(max(tinfo["size"], 1), dtype=torch.uint8)
    _verify_file(folder / TENSORS, tinfo, fh, into=buf[: tinfo["size"]])
    try:
        raw = (folder / STATE).read_bytes()
    except FileNotFoundError:
        raise CheckpointInvalid(f"{STATE} is missing") from None
    if len(raw) != m["files"][STATE]["size"]:
        raise CheckpointInvalid(f"{STATE} is {len(raw)} bytes, manifest says "
                                f"{m['files'][STATE]['size']} (truncated or partial)")
    if fh.of(raw) != m["files"][STATE][fh.field]:
        raise CheckpointInvalid(f"{STATE} {fh.field} mismatch (corrupted)")
    try:
        return m, decode_state(raw, buf, tinfo["size"])
    except (state_codec.DecodeError, KeyError, TypeError, ValueError, RuntimeError, IndexError) as e:
        raise CheckpointUnloadable(f"{STATE} verified but cannot be decoded ({type(e).__name__}: {e})") from None


def decode_state(raw: bytes, buf: torch.Tensor, size: int) -> Any:
    """The state from ``state.json`` with its tensors as views into ``buf`` (tensors.bin, ``size``
    bytes of it): ``encode_state``'s inverse."""
    obj = json.loads(raw)
    if not isinstance(obj, dict) or obj.get("format") != STRUCTURE or obj.get("version") != 1:
        raise state_codec.DecodeError(f"{STATE} is not a spottrain structure of a known version")
    tensors = []
    for off, nbytes, dtype_name, shape, requires_grad, is_param in obj["tensors"]:
        dtype = state_codec.dtype(dtype_name)
        if not (type(off) is int and type(nbytes) is int and 0 <= off and 0 <= nbytes and off + nbytes <= size):
            raise state_codec.DecodeError("tensor table points outside tensors.bin")
        t = buf[off : off + nbytes].view(dtype).view(tuple(int(x) for x in shape))
        if is_param:
            t = torch.nn.Parameter(t, requires_grad=bool(requires_grad))
        elif requires_grad:
            t.requires_grad_(True)
        tensors.append(t)

    def ref(d: dict) -> torch.Tensor:
        return tensors[int(d["i"])]

    return state_codec.decode(obj["tree"], ref)



def list_whole(store: Store, *, key: CheckpointKey | None = None) -> list[CheckpointInfo]:
    """Every ``step-N`` on the store, newest first, quick-checked as whole-model checkpoints."""
    return list_checkpoints(store, parse_manifest, key=key)


# --------------------------------------------------------------------------------------------
# The layout
# --------------------------------------------------------------------------------------------


class _Buffers:
    """The host buffers saves stage into, and which uploads from memory hold them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.first = SnapshotBuffer()  # the one reserved after a restore
        self.all: list[SnapshotBuffer] = [self.first]
        self.held: dict[int, int] = {}  # id(buffer) -> uploads from memory holding it

    def free(self, droppable: bool) -> bool:
        with self._lock:
            return any(id(b) not in self.held for b in self.all) or len(self.all) < MAX_BUFFERS or droppable

    def acquire(self, make_room: Callable[[], bool]) -> SnapshotBuffer:
        """A buffer no upload holds (the disk writer is idle when this is called)."""
        for attempt in range(2):
            with self._lock:
                free = [b for b in self.all if id(b) not in self.held]
                if free:
                    return free[0]
            if attempt == 0 and not make_room():
                break
        with self._lock:
            free = [b for b in self.all if id(b) not in self.held]
            if free:
                return free[0]
            # A second buffer while an upload from memory holds the first; a third only for an
            # explicit save while both are held (it is dropped again when released).
            buf = SnapshotBuffer()
            self.all.append(buf)
            return buf

    def hold(self, buf: SnapshotBuffer) -> None:
        with self._lock:
            self.held[id(buf)] = self.held.get(id(buf), 0) + 1

    def release(self, buf: SnapshotBuffer) -> None:
        with self._lock:
            n = self.held.get(id(buf), 0) - 1
            if n > 0:
                self.held[id(buf)] = n
                return
            self.held.pop(id(buf), None)
            if len(self.all) > MAX_BUFFERS and buf is not self.first:
                self.all = [b for b in self.all if b is not buf]


@dataclasses.dataclass(eq=False)
class _Staged:
    snap: Snapshot
    buffer: SnapshotBuffer
    pool: _Buffers
    alloc_s: float

    @property
    def step(self) -> int:
        return self.snap.step

    @property
    def meta(self) -> dict:
        return self.snap.meta

    def hold(self) -> None:
        self.pool.hold(self.buffer)

    def release(self) -> None:
        self.pool.release(self.buffer)

    def before_update(self, timeout: float | None = None) -> bool:
        return self.snap.copy is None or self.snap.copy.before_update(timeout)

    def copied(self) -> None:
        self.snap.copied()


class WholeModel:
    """The whole-model layout (see the module docstring); its group is this process alone."""

    name = "whole-model"
    parallelism = "ddp"
    in_place = False
    verify_on_obtain = False
    needs_key = None

    def __init__(self) -> None:
        self.group = OneProcess()
        self._buffers = _Buffers()
        self._optimizer: Any = None

    parse_manifest = staticmethod(parse_manifest)

    @property
    def buffers(self) -> list[SnapshotBuffer]:
        return list(self._buffers.all)

    def bind(self, model: Any, optimizer: Any, *, named: dict[str, Any] | None = None) -> None:
        """The state passed to each save holds the model and the optimizer; the tensors the
        optimizer writes (its parameters and its state) are copied beside the loop's next step."""
        self._optimizer = optimizer

    def _updated_by_optimizer(self) -> Callable[[torch.Tensor], bool] | None:
        """Whether a tensor shares its memory with what only the bound optimizer's step writes."""
        opt = self._optimizer
        if opt is None:
            return None
        ptrs = {p.untyped_storage().data_ptr() for g in opt.param_groups for p in g["params"]}
        ptrs.update(v.untyped_storage().data_ptr() for s in opt.state.values() for v in s.values()
                    if torch.is_tensor(v))
        ptrs.discard(0)  # empty tensors
        return lambda t: t.untyped_storage().data_ptr() in ptrs

    def can_stage(self, droppable: bool) -> bool:
        return self._buffers.free(droppable)

    def stage(self, step: int, state: Any, meta: dict, *, make_room: Callable[[], bool]) -> _Staged:
        buffer = self._buffers.acquire(make_room)
        # NotPlainData here, in the caller's thread
        snap = buffer.take(step, state, meta, later=self._updated_by_optimizer())
        return _Staged(snap, buffer, self._buffers, buffer.last_alloc_s)

    def reserve(self, state: Any) -> None:
        self._buffers.first.reserve(state)

    def write(self, staged: _Staged, disks: list[Tier], plan: Plan, *, for_upload: bool, parallel: bool,
              on_tier: OnTier, key: Any, writer: str) -> Written:
        """Every disk tier straight from the buffer (at once with ``parallel``), each on its own."""
        out = Written()
        lock = threading.Lock()

        def one(t: Tier) -> None:
            t0 = time.monotonic()
            error: BaseException | None = None
            folder: Path | None = disk_folder(t, step_name(staged.step))
            try:
                how = plan.get(t.name, "write")
                if how.startswith("occupied: "):
                    raise StepOccupied(how[len("occupied: "):])
                if how != "keep":
                    folder, _ = write_dir(staged.snap, disk_folder(t), key=key, writer=writer,
                                          replace=how == "replace")
            except Exception as e:  # noqa: BLE001 - each tier fails on its own
                error, folder = e, None
            seconds = time.monotonic() - t0
            with lock:
                out.errors[t.name], out.seconds[t.name] = error, seconds
                if error is None and folder is not None:  # it is: written or kept
                    out.folders[t.name] = folder
            on_tier(t, error, seconds, folder)

        if parallel:
            threads = [threading.Thread(target=one, args=(t,), name=f"checkpoint-emergency-{t.name}", daemon=True)
                       for t in disks]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
        else:
            for t in disks:
                one(t)
        if for_upload and not out.folders:
            staged.hold()
            out.memory = staged
        return out

    def memory_manifest(self, staged: _Staged, *, key: Any, writer: str) -> bytes:
        return snapshot_manifest(staged.snap, snapshot_files(staged.snap), key=key, writer=writer)

    def memory_file(self, staged: _Staged, name: str) -> memoryview:
        return {TENSORS: staged.snap.tensor_bytes(), STATE: memoryview(staged.snap.structure)}[name]

    def uploads(self, files: list[str], *, collective: bool) -> list[str]:
        return files  # this process alone uploads, the payload in the manifest's order

    def verify(self, folder: Path, *, key: Any) -> dict:
        return verify_dir(folder, key=key)

    def load(self, folder: Path, *, key: Any) -> Any:
        try:
            _, state = load_dir(folder, key=key)
        except CheckpointUnloadable as e:
            raise CheckpointUnloadable(f"{e}; use the spottrain version that wrote it, or a new "
                                       "--run-dir/--gcs-uri for a new run (nothing was deleted)") from None
        return state

    def look(self, folder: Path, *, key: Any) -> tuple[dict, Any]:
        state = self.load(folder, key=key)
        return state["model"], state

    def close(self) -> None:
        self._buffers.reset()
