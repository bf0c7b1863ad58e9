"""The folder format every checkpoint layout shares: files, hashes, atomic folders, listings.

A checkpoint is one ``step-NNNNNNNN/`` folder (or remote prefix) holding its layout's files and,
written last, its manifest (``trainer.checkpoint.manifest``). This module owns what is the same
for every layout:

* writing a file while its digest is computed (``_write_hashed``) and verifying one while it is
  read (``_verify_file``), with the hash its manifest names (``trainer.checkpoint.file_hash``:
  BLAKE3 for new checkpoints, SHA-256 for older ones), chunks hashed on several cores;
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
from trainer.checkpoint.file_hash import FileHash, byte_view, hash_file, of_manifest
from trainer.checkpoint.key import CheckpointKey
from trainer.checkpoint.manifest import (MANIFEST, CheckpointInvalid, ManifestParser, parse_step, step_name)
from trainer.checkpoint.stores import TMP_PREFIX, Store, copy_file_durable, fsync_dir

_IO_CHUNK = 32 << 20


def _write_hashed(path: Path, data: memoryview, pool: cf.ThreadPoolExecutor, fh: FileHash) -> dict:
    """Write ``data`` to a new file with fsync; the chunk hashes run on ``pool`` meanwhile
    (the hashes and os.write all release the GIL, so they use separate cores). Returns the
    file's manifest entry."""
    futures = [pool.submit(fh.chunk_digest, data[i : i + fh.chunk]) for i in range(0, len(data), fh.chunk)]
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
    return fh.entry(len(data), fh.combine([f.result() for f in futures]))



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
        fh = of_manifest(manifest)
        for name, info in manifest["files"].items():
            _verify_file(stage / name, info, fh)
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



def _verify_file(path: Path, info: dict, fh: FileHash, into: torch.Tensor | None = None) -> None:
    """``path`` has the size and digest of its manifest ``info`` under ``fh`` (the hash the
    manifest names), or ``CheckpointInvalid``; with ``into`` the file is read into that tensor on
    the way (one pass: each chunk is hashed while the next is read)."""
    try:
        actual = path.stat().st_size
    except FileNotFoundError:
        raise CheckpointInvalid(f"{path.name} is missing") from None
    if actual != info["size"]:
        raise CheckpointInvalid(f"{path.name} is {actual} bytes, manifest says {info['size']} (truncated or partial)")
    size, digest = hash_file(path, fh, into)
    if size != info["size"]:
        raise CheckpointInvalid(f"{path.name} changed size while reading")
    if digest != info[fh.field]:
        raise CheckpointInvalid(f"{path.name} {fh.field} mismatch (corrupted)")


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
            h.update(byte_view(t.reshape(-1).view(torch.uint8)))
        h.update(b"\1")
    return h.hexdigest()



def state_digest(state: object) -> str:
    """sha256 over a whole state (nested containers of plain values and tensors, as a checkpoint
    holds it): its structure, and each tensor's dtype, shape and bytes (``tensor_digest``). Equal
    digests mean bitwise-equal states (the multi-rank restore's tests and bench compare ranks)."""
    from trainer.checkpoint import state_codec

    tree = state_codec.encode(state, lambda t, path: f"{type(t).__name__}:{tensor_digest({'': t})}")
    return hashlib.sha256(json.dumps(tree, sort_keys=True).encode()).hexdigest()
