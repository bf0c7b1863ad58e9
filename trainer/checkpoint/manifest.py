"""The manifest: the commit record every checkpoint layout shares, and what a reason means.

A checkpoint is a ``step-NNNNNNNN/`` folder (or remote prefix) whose ``manifest.json`` is written
LAST on every tier: format, step, time, torch version, world size, meta (the layout's own, e.g.
``meta.sharded``), the writer's session id, and the size and digest of every other file under the
file hash it names (``trainer.checkpoint.file_hash``: BLAKE3, or SHA-256 in older checkpoints),
plus a sha256 of the manifest itself and, with a checkpoint key (``trainer.checkpoint.key``), the
run it belongs to and an HMAC-SHA256 over it. So an interrupted write or upload never produces a
valid checkpoint, and whoever can write a bucket but does not hold the key cannot make a reader use
a checkpoint of their making (docs/security.md). Each layout adds its file list to
``parse_manifest_header`` (``trainer.checkpoint.whole_model``, ``trainer.checkpoint.sharded``).

Some checkpoints are *quarantined*: never loaded, overwritten or deleted (``quarantined``): one
of the other layout (whole-model vs sharded), one of another format version (format 1: a pickled
``state.pt``, recognised and never loaded) or with a file hash this Python cannot compute (BLAKE3
without the ``blake3`` package), and an unauthenticated one (no HMAC, or one that does
not verify with this key: forged, or written with a lost or rotated key), and one signed for
another run (an authentic checkpoint of a run under the same key, copied here). A restore that
meets them with nothing authentic left refuses to start afresh beside them (``ResumeMismatch``),
except unauthenticated and other-run ones that are only in the bucket, which a bucket writer may
have planted: those are set aside (``trainer.checkpoint.survey``, ``trainer.checkpoint.run_record``).
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from typing import Any, Callable

import torch

from trainer import untrusted
from trainer.checkpoint import file_hash
from trainer.checkpoint.key import CheckpointKey
from trainer.manifest_auth import ALG, canonical as _canonical, named_key as _key_id, other_run as _other_run, \
    signed_body as _signed_body

FORMAT = "spottrain-checkpoint"
#: 2: JSON structure (``state.json``) and, with a key, an HMAC. 1: a pickled ``state.pt``.
FORMAT_VERSION = 2
MANIFEST = "manifest.json"
_STEP_RE = re.compile(r"^step-(\d{8,})$")


class ResumeMismatch(Exception):
    """The checkpoint was written with other settings, another layout or format, or cannot be
    loaded into this run; resuming would not continue that run (bad input: exit 2, nothing is
    deleted, no fallback to an older checkpoint or a fresh start)."""


class CheckpointInvalid(Exception):
    """A checkpoint that must not be used; ``str(exc)`` is the reason for the log."""


class CheckpointUnloadable(Exception):
    """A checkpoint that verified (every file's digest, and the HMAC with a key) but that this version
    cannot decode: a resume mismatch, never corruption (nothing is deleted, no fallback)."""


class CheckpointUnreadable(Exception):
    """A checkpoint that verified but could not be loaded just now: an I/O error, memory running
    out, a peer rank or the process group failing (``unreadable``). It says nothing about the
    checkpoint: unknown, not bad. The restore is tried again (start-up's wait for a tier, then exit
    69), never a fallback to an older checkpoint, never bad input."""


#: What a gloo collective raises when a peer died, hung or closed its socket: a plain
#: ``RuntimeError`` whose message names gloo's transport (NCCL's are ``DistError``s).
_GLOO_TRANSPORT = re.compile(r"gloo/transport/")


def unreadable(exc: BaseException) -> bool:
    """Whether a load failed for a reason outside the checkpoint (see ``CheckpointUnreadable``):
    ``OSError``, ``MemoryError``, torch's out-of-memory, ``torch.distributed.DistError``, gloo's
    transport errors, also as the cause of another error. DCP's ``CheckpointException`` carries
    each failing rank's error: unreadable only when every one of them is (a rank that found the
    checkpoint does not fit has the answer)."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(exc, CheckpointException):
        failures = [e for e, _ in exc.failures.values()]
        return bool(failures) and all(unreadable(e) for e in failures)
    if isinstance(exc, (CheckpointUnreadable, OSError, MemoryError, torch.OutOfMemoryError,
                        torch.distributed.DistError)):
        return True
    if isinstance(exc, RuntimeError) and _GLOO_TRANSPORT.search(str(exc)):
        return True
    cause = exc.__cause__
    return cause is not None and cause is not exc and unreadable(cause)


class StepOccupied(Exception):
    """A quarantined checkpoint (see ``quarantined``) occupies the step a save would write on a tier: the save
    skips that tier rather than overwrite it."""


#: Reason prefix of a valid-looking checkpoint of the other layout (whole-model vs sharded): never
#: deleted by retention, and a restore that meets one refuses to start afresh over it.
OTHER_LAYOUT = "other layout: "
#: Reason prefix of a checkpoint of another format version (an older spottrain's pickled
#: ``state.pt``, or a newer one's), or whose file hash cannot be computed here: quarantined, like
#: the other layout.
OTHER_FORMAT = "other format: "
#: Reason prefix of a manifest without a valid HMAC under this run's key: never loaded, never
#: deleted or overwritten (it may be the run's own work under a lost or rotated key).
UNAUTHENTICATED = "unauthenticated: "
#: Reason prefix of an authentic manifest signed for another run (``CheckpointKey.run``): copied
#: here from a run under the same key, or this run was moved; never loaded, deleted or overwritten.
OTHER_RUN = "another run's: "
QUARANTINED = (OTHER_LAYOUT, OTHER_FORMAT, UNAUTHENTICATED, OTHER_RUN)


def other_layout(reason: str) -> bool:
    return reason.startswith(OTHER_LAYOUT)


def quarantined(reason: str) -> bool:
    """A checkpoint that is never loaded, overwritten or deleted (see the module docstring)."""
    return reason.startswith(QUARANTINED)


def layout_mismatch(this: str, found: list[str]) -> str:
    """The message of a run whose tiers hold checkpoints of the other layout."""
    return (f'cannot resume: this run has parallelism = "{this}", but its tiers hold checkpoints of '
            f"the other layout ({'; '.join(found[:5])}); use the original parallelism, or a new "
            "--run-dir/--gcs-uri for a new run (nothing was deleted)")


def quarantine_mismatch(lines: list[str], key: CheckpointKey | None) -> str:
    """The message of a run whose tiers hold quarantined checkpoints it must not start afresh beside:
    other format versions (``key`` None) or unauthenticated ones with nothing authentic left."""
    found = "; ".join(lines[:5]) + (f"; and {len(lines) - 5} more" if len(lines) > 5 else "")
    if key is None:
        return (f"cannot resume: the tiers hold checkpoints of another format ({found}); they are never "
                "loaded; use the spottrain version that wrote them, or a new --run-dir/--gcs-uri for a new "
                "run (nothing was deleted)")
    return (f"cannot resume: no checkpoint on any tier is authentic under this run's checkpoint key {key.id} "
            f"({key.source}), and the tiers hold checkpoints that are not ({found}). They are never loaded and "
            "never deleted. If they are this run's own (its key was lost or rotated), run with the key that "
            "wrote them (--checkpoint-key-file); otherwise someone without the key wrote them: remove them, "
            "or use a new --run-dir/--gcs-uri for a new run. See docs/security.md")


def other_run_mismatch(lines: list[str], run: str | None) -> str:
    """The message of a run whose tiers hold only checkpoints signed for another run."""
    found = "; ".join(lines[:5]) + (f"; and {len(lines) - 5} more" if len(lines) > 5 else "")
    return (f"cannot resume: no checkpoint on any tier belongs to this run ({run}), and the tiers hold checkpoints "
            f"signed for another run ({found}). They are never loaded and never deleted. If this run was moved "
            "here from that location, run it there (--gcs-uri), or start a new run from them with --init-from; "
            "otherwise someone who can write the bucket copied them here: remove them. See docs/security.md")


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def parse_step(name: str) -> int | None:
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def build_manifest(step: int, files: dict[str, dict], meta: dict, created_unix: float, *,
                   key: CheckpointKey | None = None, writer: str | None = None) -> bytes:
    """The manifest's bytes. ``files``: each file's entry (``FileHash.entry``; the manifest names
    the hash they were computed with). ``writer``: the writing session's id (a save id: two saves
    of one step by one session hold the same state). ``key``: sign it (an HMAC over the canonical
    body, everything but the self-checksum and the HMAC itself)."""
    body: dict[str, Any] = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "hash": file_hash.from_entries(files).name,
        "step": step,
        "created_unix": created_unix,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created_unix)),
        "torch_version": torch.__version__,
        "world_size": int(meta.get("world_size", 1)) if isinstance(meta.get("world_size", 1), int) else 1,
        "meta": meta,
        "files": files,
    }
    if writer is not None:
        body["writer"] = writer
    if key is not None:
        body["auth"] = {"alg": ALG, "key_id": key.id}
        if key.run is not None:
            body["run"] = key.run
    canonical = _canonical(body)
    body["manifest_sha256"] = hashlib.sha256(canonical).hexdigest()
    if key is not None:
        body["hmac"] = key.sign(canonical)
    return json.dumps(body, sort_keys=True, indent=1).encode()


def parse_manifest_header(data: bytes, key: CheckpointKey | None = None) -> dict:
    """The checks every layout's manifest shares: JSON, format marker, version, file hash, the
    self-checksum and, with a ``key``, the HMAC; raise ``CheckpointInvalid`` with the reason
    (prefixed ``OTHER_FORMAT`` or ``UNAUTHENTICATED`` for checkpoints that are quarantined)."""
    try:
        m = untrusted.loads(data, limit=untrusted.MANIFEST_MAX_BYTES, what="manifest")
    except untrusted.Garbage as e:
        raise CheckpointInvalid(str(e)) from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CheckpointInvalid("manifest has no spottrain format marker")
    version = m.get("version")
    if version != FORMAT_VERSION:
        if not isinstance(version, int) or isinstance(version, bool):
            raise CheckpointInvalid(f"unsupported checkpoint format version {version!r}")
        if version < FORMAT_VERSION:
            what = (f"checkpoint format {version}, written by an older spottrain: its state is a pickled "
                    "state.pt, which this version never unpickles")
        else:
            what = f"checkpoint format {version}, written by a newer spottrain"
        if key is not None and not (version > FORMAT_VERSION and key.verify(_signed_body(m), m.get("hmac"))):
            raise CheckpointInvalid(UNAUTHENTICATED + what + " (and it carries no HMAC under this run's "
                                    f"key {key.id}); never loaded, never deleted")
        raise CheckpointInvalid(OTHER_FORMAT + what + "; use the spottrain version that wrote it, or a new "
                                "--run-dir/--gcs-uri for a new run")
    if not isinstance(m.get("hash"), str) or m["hash"] not in file_hash.HASHES:
        raise CheckpointInvalid(f"unsupported file hash {untrusted.shown(m.get('hash'))}")
    if m.get("manifest_sha256") != hashlib.sha256(_signed_body(m)).hexdigest():
        raise CheckpointInvalid("manifest checksum mismatch (manifest corrupted)")
    if key is not None:
        if "hmac" not in m:
            raise CheckpointInvalid(UNAUTHENTICATED + "its manifest carries no HMAC (written without a "
                                    "checkpoint key, or forged); never loaded, never deleted")
        if _key_id(m) != key.id:
            raise CheckpointInvalid(UNAUTHENTICATED + f"its manifest names checkpoint key {untrusted.shown(_key_id(m))}, this "
                                    f"run's key is {key.id} (a lost or rotated key, another run's, or forged); "
                                    "never loaded, never deleted")
        if not key.verify(_signed_body(m), m.get("hmac")):
            raise CheckpointInvalid(UNAUTHENTICATED + "its manifest's HMAC does not verify with this run's "
                                    f"checkpoint key {key.id} (altered or forged by someone without the key); "
                                    "never loaded, never deleted")
        # Bound only under a key: the HMAC is what makes the run name the writer's word.
        why = _other_run(m, key.run)
        if why is not None:
            raise CheckpointInvalid(OTHER_RUN + why + " (copied here from another run under the same key, or "
                                    "this run was moved); never loaded, never deleted")
    if file_hash.HASHES[m["hash"]] is None:  # after the HMAC: a forged one reads as unauthenticated
        raise CheckpointInvalid(OTHER_FORMAT + f"its files are hashed with {untrusted.shown(m['hash'])}, which cannot be checked "
                                f"here: {file_hash.MISSING[m['hash']]}; never loaded, never deleted")
    return m


def check_manifest_entries(m: dict, step: int | None) -> dict:
    """Every file entry has a size and a digest (under the field of the manifest's file hash), and
    the manifest's step is the folder's."""
    field = file_hash.FIELDS[m["hash"]]
    for name, info in m["files"].items():
        if not (isinstance(info, dict) and isinstance(info.get("size"), int)
                and isinstance(info.get(field), str)):
            raise CheckpointInvalid(f"manifest entry for {untrusted.shown(name)} is malformed")
    if step is not None and m.get("step") != step:
        raise CheckpointInvalid(f"manifest says step {untrusted.shown(m.get('step'))}, folder says {step}")
    return m


#: A layout's manifest parser, called as ``parse(data, step, key=key)``: the whole-model layout's
#: ``parse_manifest``, the sharded one's ``parse_sharded_manifest``.
ManifestParser = Callable[..., dict]

