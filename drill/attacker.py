"""The attacker of the checkpoint bucket, for `make chaos` and the tests: someone who can write the
bucket (or a copy of a run dir) but does not hold the run's checkpoint key.

Written against the checkpoint format as anyone reading a bucket sees it (a ``step-N/`` folder, a
JSON ``manifest.json`` listing each file's size and digest under the hash it names, a self-checksum
of the manifest), not with the trainer's code: what it forges is what a real attacker could forge.

- ``code_running_pickle(marker)``: bytes that create ``marker`` when unpickled (a ``__reduce__``
  payload), so that a test can tell whether anything ran it;
- ``forge(manifest, step, replace)``: a manifest for ``step`` with the replaced files' sizes and
  digests and the self-checksum recomputed; its HMAC (which needs the key) dropped, or kept as it
  was (``keep_hmac``: a signature of other content, which must not verify); ``legacy`` rewrites it
  as checkpoint format 1, whose ``state.pt`` older trainers unpickled;
- ``forge_in_bucket(...)``: a whole forged checkpoint planted in the bucket, manifest last.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import shlex
from pathlib import Path
from typing import Any

__all__ = ["bucket_names", "code_running_pickle", "forge", "forge_in_bucket", "state_file"]


def _blake3(data: bytes) -> bytes:
    import blake3  # the hash the trainer writes with where it is installed

    return blake3.blake3(data).digest()


#: The manifest's per-file digests, by the name in its "hash": (entry field, chunk size, function);
#: the digest is the function over the concatenated digests of the chunks.
_HASHES = {
    "sha256-of-64MiB-chunk-sha256s": ("sha256", 64 << 20, lambda b: hashlib.sha256(b).digest()),
    "blake3-of-16MiB-chunk-blake3s": ("blake3", 16 << 20, _blake3),
}


class _RunsCode:
    """Unpickling this runs `touch MARKER` (pickle calls os.system with the argument)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {shlex.quote(self.marker)}",))


def code_running_pickle(marker: Path, *, torch_save: bool = True) -> bytes:
    """Bytes that create ``marker`` when unpickled: a torch.save file (what `state.pt` and
    `extras.pt` were) or a bare pickle (what DCP's `.metadata` is)."""
    if not torch_save:
        return pickle.dumps(_RunsCode(str(marker)))
    import torch

    buf = io.BytesIO()
    torch.save({"format": "spottrain-checkpoint", "version": 1, "tree": _RunsCode(str(marker)),
                "tensors": []}, buf)
    return buf.getvalue()


def _digest(hash_name: str, data: bytes) -> dict:
    """A manifest entry for ``data``: its size and digest."""
    field, chunk, fn = _HASHES[hash_name]
    parts = [data[i : i + chunk] for i in range(0, len(data), chunk)]
    return {"size": len(data), field: fn(b"".join(fn(p) for p in parts)).hex()}


def state_file(manifest: bytes) -> str:
    """The name of the checkpoint's structure file (whatever is not the tensor bytes)."""
    names = [n for n in json.loads(manifest)["files"] if n != "tensors.bin"]
    assert len(names) == 1, names
    return names[0]


def forge(manifest: bytes, step: int, replace: dict[str, bytes], *, legacy: bool = False,
          keep_hmac: bool = False) -> bytes:
    """An attacker's manifest for ``step`` (see the module docstring)."""
    m = json.loads(manifest)
    m["step"] = step
    if legacy:
        m["version"] = 1
        m.pop("writer", None)
        m.pop("auth", None)
        m["files"] = {k: v for k, v in m["files"].items() if k == "tensors.bin"}
    for name, data in replace.items():
        m["files"][name] = _digest(m["hash"], data)
    mac = m.pop("hmac", None)
    m.pop("manifest_sha256", None)
    m["manifest_sha256"] = hashlib.sha256(json.dumps(m, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    if keep_hmac and mac is not None and not legacy:
        m["hmac"] = mac
    return json.dumps(m, sort_keys=True, indent=1).encode()


def _split(uri: str) -> tuple[str, str]:
    bucket, _, prefix = uri.removeprefix("gs://").partition("/")
    return bucket, prefix


def forge_in_bucket(client: Any, uri: str, src_step: int, step: int, replace: dict[str, bytes], *,
                    legacy: bool = False, keep_hmac: bool = False) -> None:
    """Copy ``step-<src_step>/`` of the bucket prefix ``uri`` to ``step-<step>/`` with the files in
    ``replace`` swapped for (or added as) the attacker's and a forged manifest (uploaded last, as a
    writer would)."""
    bucket_name, prefix = _split(uri)
    bucket = client.bucket(bucket_name)
    src, dst = f"{prefix}/step-{src_step:08d}/", f"{prefix}/step-{step:08d}/"
    manifest = None
    for blob in client.list_blobs(bucket_name, prefix=src):
        name = blob.name[len(src):]
        data = blob.download_as_bytes()
        if name == "manifest.json":
            manifest = data
            continue
        if name not in replace:
            bucket.blob(dst + name).upload_from_string(data)
    for name, data in replace.items():
        bucket.blob(dst + name).upload_from_string(data)
    assert manifest is not None, f"no manifest under {src}"
    bucket.blob(dst + "manifest.json").upload_from_string(
        forge(manifest, step, replace, legacy=legacy, keep_hmac=keep_hmac))


def read_manifest(client: Any, uri: str, step: int) -> bytes:
    bucket_name, prefix = _split(uri)
    return client.bucket(bucket_name).blob(f"{prefix}/step-{step:08d}/manifest.json").download_as_bytes()


def bucket_names(client: Any, uri: str) -> set[str]:
    bucket_name, prefix = _split(uri)
    return {b.name[len(prefix) + 1:] for b in client.list_blobs(bucket_name, prefix=prefix + "/step-")}
