"""The run record: a run's signed word, on its remote tiers, that it has saved a checkpoint there.

A bucket writer without the key can plant checkpoints (forged ones, or another run's authentic ones)
in the prefix of a run that has none of its own yet. Refusing to start beside them (they might be
the run's own under a lost key, or moved here) let that writer stop the run for good. So the run
writes ``run-record.json`` on each remote tier, HMAC-signed under its checkpoint key and naming the
run it belongs to (``CheckpointKey.run``), before the manifest of its first checkpoint there in each
session. Only a holder of the key can write one that verifies; a restore that finds nothing
authentic to resume asks it whether the run ever saved (``trainer.checkpoint.survey``).

Disk tiers get none: a bucket writer cannot write them, so whatever they hold is already the
run's own (or root's) word, and a quarantined checkpoint there still stops the run.

This module owns the record's format, its signing and its judging, and nothing else.
"""
from __future__ import annotations

import time
from typing import Any

from trainer import untrusted
from trainer.checkpoint.key import CheckpointKey
from trainer.manifest_auth import ALG, canonical, named_key, signed_body

#: The record's object name at the root of a remote tier (beside ``lease.json``).
RECORD_KEY = "run-record.json"
FORMAT = "spottrain-run-record"
VERSION = 1
#: A record is a few hundred bytes; anything bigger is not one (judged before it is downloaded).
MAX_BYTES = 64 << 10


def build(key: CheckpointKey, *, step: int, writer: str) -> bytes:
    """A record that ``key``'s run saved ``step`` on a tier (``writer``: the saving session)."""
    assert key.run is not None, "a run record names its run: only a key bound to one signs it"
    now = time.time()
    body: dict[str, Any] = {"format": FORMAT, "version": VERSION, "run": key.run,
                            "auth": {"alg": ALG, "key_id": key.id}, "step": step, "writer": writer,
                            "created_unix": now,
                            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))}
    body["hmac"] = key.sign(canonical(body))
    return canonical(body)


def unauthentic(data: bytes, key: CheckpointKey) -> str | None:
    """None when ``data`` is a record signed under ``key`` for ``key``'s run; else why it is not
    (garbage, no HMAC, another key, another run): such a record proves nothing."""
    try:
        r = untrusted.loads(data, limit=MAX_BYTES, what="run record")
    except untrusted.Garbage as e:
        return str(e)
    if not isinstance(r, dict) or r.get("format") != FORMAT:
        return "no spottrain run record format marker"
    if "hmac" not in r:
        return "it carries no HMAC"
    if named_key(r) != key.id:
        return f"it names checkpoint key {untrusted.shown(named_key(r))}, this run's key is {key.id}"
    if not key.verify(signed_body(r), r.get("hmac")):
        return f"its HMAC does not verify with this run's checkpoint key {key.id}"
    if r.get("run") != key.run:
        return f"signed for the run at {untrusted.shown(str(r.get('run'))[:200])}, this run is {key.run!r}"
    return None


def read(store: Any, key: CheckpointKey) -> tuple[bool, str]:
    """(whether ``store`` holds an authentic record of ``key``'s run, what it holds in words).
    Raises whatever the store raises when it cannot be read: unknown is not "never saved"."""
    sizes = store.sizes(RECORD_KEY)
    if RECORD_KEY not in sizes:
        return False, f"no run record at {store.location(RECORD_KEY)}"
    if sizes[RECORD_KEY] > MAX_BYTES:
        return False, (f"the run record at {store.location(RECORD_KEY)} proves nothing: it is {sizes[RECORD_KEY]} "
                       f"bytes, more than the {MAX_BYTES} a record may be")
    try:
        data = store.get_bytes(RECORD_KEY)
    except KeyError:  # deleted between the listing and the download
        return False, f"no run record at {store.location(RECORD_KEY)}"
    why = unauthentic(data, key)
    if why is not None:
        return False, f"the run record at {store.location(RECORD_KEY)} proves nothing: {why}"
    return True, f"the run record at {store.location(RECORD_KEY)} (signed by this run's key for this run)"
