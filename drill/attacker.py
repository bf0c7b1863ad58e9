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
  as checkpoint format 1, whose ``state.pt`` older trainers unpickled; ``edit`` plants any other
  field (a key id, a hash name: text that reaches the trainer's log lines);
- ``forge_in_bucket(...)``: a whole forged checkpoint planted in the bucket, manifest last;
- ``copy_step(...)``: another run's authentic checkpoint copied into a run's prefix, object by
  object (a replay: its signature is genuine);
- ``plant(...)`` and ``delete_step(...)``: any bytes as any object of a run's prefix, and a
  checkpoint's every object deleted.

``intact(...)`` is the other side, for the harness: whether a checkpoint in the bucket still
holds what its manifest lists (sizes and digests), read the way anyone can.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import shlex
from pathlib import Path
from typing import Any, Callable

__all__ = ["bucket_names", "code_running_pickle", "copy_step", "delete_step", "digest", "forge",
           "forge_in_bucket", "intact", "plant", "state_file"]


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


def digest(hash_name: str, data: bytes) -> dict:
    """A manifest entry for ``data``: its size and digest."""
    field, chunk, fn = _HASHES[hash_name]
    parts = [data[i : i + chunk] for i in range(0, len(data), chunk)]
    return {"size": len(data), field: fn(b"".join(fn(p) for p in parts)).hex()}


def _hash_of(entry: dict) -> str:
    """The hash a manifest entry's digest was taken with, by the field it is under."""
    names = [n for n, (field, _, _) in _HASHES.items() if field in entry]
    if len(names) != 1:
        raise ValueError(f"a manifest entry with no known digest: {sorted(entry)}")
    return names[0]


def state_file(manifest: bytes) -> str:
    """The name of the checkpoint's structure file (whatever is not the tensor bytes)."""
    names = [n for n in json.loads(manifest)["files"] if n != "tensors.bin"]
    assert len(names) == 1, names
    return names[0]


def forge(manifest: bytes, step: int, replace: dict[str, bytes], *, legacy: bool = False,
          keep_hmac: bool = False, edit: Callable[[dict], None] | None = None) -> bytes:
    """An attacker's manifest for ``step`` (see the module docstring); ``edit`` changes any other
    field before the self-checksum is recomputed (a planted key id or hash name)."""
    m = json.loads(manifest)
    m["step"] = step
    if legacy:
        m["version"] = 1
        m.pop("writer", None)
        m.pop("auth", None)
        m["files"] = {k: v for k, v in m["files"].items() if k == "tensors.bin"}
    for name, data in replace.items():
        m["files"][name] = digest(m["hash"], data)
    if edit is not None:
        edit(m)
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
                    legacy: bool = False, keep_hmac: bool = False, edit: Callable[[dict], None] | None = None) -> None:
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
        forge(manifest, step, replace, legacy=legacy, keep_hmac=keep_hmac, edit=edit))


def read_manifest(client: Any, uri: str, step: int) -> bytes:
    bucket_name, prefix = _split(uri)
    return client.bucket(bucket_name).blob(f"{prefix}/step-{step:08d}/manifest.json").download_as_bytes()


def bucket_names(client: Any, uri: str) -> set[str]:
    bucket_name, prefix = _split(uri)
    return {b.name[len(prefix) + 1:] for b in client.list_blobs(bucket_name, prefix=prefix + "/step-")}


def copy_step(client: Any, src_uri: str, dst_uri: str, step: int) -> None:
    """Copy ``step-<step>/`` of the prefix ``src_uri`` into the prefix ``dst_uri``, object by object
    and manifest last, as anyone who can write both can: nothing in it changes."""
    src_bucket, src_prefix = _split(src_uri)
    dst_bucket, dst_prefix = _split(dst_uri)
    folder = f"step-{step:08d}/"
    source, target = client.bucket(src_bucket), client.bucket(dst_bucket)
    blobs = sorted(client.list_blobs(src_bucket, prefix=f"{src_prefix}/{folder}"),
                   key=lambda b: b.name.endswith("/manifest.json"))
    assert blobs, f"no checkpoint under {src_uri}/{folder}"
    for blob in blobs:
        source.copy_blob(blob, target, f"{dst_prefix}/{blob.name[len(src_prefix) + 1:]}")


def plant(client: Any, uri: str, name: str, data: bytes) -> None:
    """``data`` as the object ``name`` of the prefix ``uri`` (replacing whatever is there)."""
    bucket_name, prefix = _split(uri)
    client.bucket(bucket_name).blob(f"{prefix}/{name}").upload_from_string(data)


def delete_step(client: Any, uri: str, step: int) -> list[str]:
    """Delete every object of ``step-<step>/`` of the prefix ``uri``; the names deleted."""
    bucket_name, prefix = _split(uri)
    gone = []
    for blob in client.list_blobs(bucket_name, prefix=f"{prefix}/step-{step:08d}/"):
        blob.delete()
        gone.append(blob.name[len(prefix) + 1:])
    return gone


def intact(client: Any, uri: str, step: int) -> str | None:
    """Why ``step-<step>/`` of the prefix ``uri`` does not hold what its manifest lists (a file
    missing, of another size or digest under the hash its entry names), or None when it does (or is
    not there at all)."""
    bucket_name, prefix = _split(uri)
    folder = f"{prefix}/step-{step:08d}/"
    objects = {b.name[len(folder):]: b for b in client.list_blobs(bucket_name, prefix=folder)}
    if "manifest.json" not in objects:
        return None
    files = json.loads(objects["manifest.json"].download_as_bytes())["files"]
    for name, info in files.items():
        if name not in objects:
            return f"{name} is missing"
        data = objects[name].download_as_bytes()
        name_of_hash = _hash_of(info)
        expected = {k: info.get(k) for k in ("size", _HASHES[name_of_hash][0])}
        if digest(name_of_hash, data) != expected:
            return f"{name} is not what its manifest lists ({len(data)} bytes, manifest: {info['size']})"
    return None
