"""What makes a checkpoint manifest authentic: its signed body, its self-checksum and its HMAC
under a checkpoint key. Standard library only: the trainer's checkpointing
(``trainer.checkpoint.manifest``, ``trainer.checkpoint.key``) and the VM's stop path
(``trainer.cloud.scale``, which runs without torch) judge a manifest by these same functions."""
from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

from trainer.untrusted import shown

ALG = "hmac-sha256"


def canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def signed_body(m: dict) -> bytes:
    """What the self-checksum and the HMAC cover: everything but themselves."""
    return canonical({k: v for k, v in m.items() if k not in ("manifest_sha256", "hmac")})


def key_id(secret: bytes) -> str:
    """A key's public name (recorded in manifests), which does not reveal the key."""
    return hmac.new(secret, b"spottrain checkpoint key id", hashlib.sha256).hexdigest()[:16]


def sign(secret: bytes, data: bytes) -> str:
    return hmac.new(secret, data, hashlib.sha256).hexdigest()


def verify(secret: bytes, data: bytes, mac: object) -> bool:
    return isinstance(mac, str) and hmac.compare_digest(sign(secret, data), mac)


def named_key(m: dict) -> str:
    """The key id a manifest says signed it ("none" when it names none)."""
    auth = m.get("auth")
    return str(auth.get("key_id"))[:64] if isinstance(auth, dict) else "none"


def unauthentic(m: Any, secret: bytes) -> str | None:
    """None when ``m`` (a parsed manifest) is self-consistent and its HMAC verifies under
    ``secret``; else why it is not authentic."""
    if not isinstance(m, dict):
        return "not a manifest (no JSON object)"
    if m.get("manifest_sha256") != hashlib.sha256(signed_body(m)).hexdigest():
        return "manifest checksum mismatch"
    if "hmac" not in m:
        return "its manifest carries no HMAC"
    if named_key(m) != key_id(secret):
        return f"its manifest names checkpoint key {shown(named_key(m))}, this run's is {key_id(secret)}"
    if not verify(secret, signed_body(m), m.get("hmac")):
        return "its manifest's HMAC does not verify with this run's checkpoint key"
    return None


def run_uri(bucket: str, prefix: str) -> str:
    """A run's identity as signed into its manifests: its durable location, ``gs://BUCKET/PREFIX``."""
    return f"gs://{bucket}/{prefix.strip('/')}"


def other_run(m: dict, run: str | None) -> str | None:
    """Why an authentic manifest is not ``run``'s (signed for another run), or None. A manifest
    that names no run (written before runs were bound, or by a run without a bucket) is not
    refused: it names none to compare."""
    named = m.get("run")
    if run is None or named is None or named == run:
        return None
    return f"signed for the run at {shown(str(named)[:200])}, this run is {run!r}"
