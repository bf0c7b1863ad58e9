"""The stop marker as a signed record, and what the bucket must hold before anyone acts on one.

Scaling a group to zero deletes its VMs *and their checkpoint disks*. The VM's stop path
(`trainer.cloud.scale`) checks, with the run's checkpoint key, that the bucket holds an authentic
copy of its disk's newest step before it writes the marker; the control job
(`trainer.cloud.control`), which does the scaling, on its own schedule too, must know the same from
what only the run could have written. Whoever can write the bucket can write a marker's name, so a
name is never enough. This module owns:

- **The record** (`sign`, `verify`): the marker's JSON, HMAC-SHA256 under the checkpoint key over
  a domain-separated canonical body (so a marker never verifies as a manifest, nor a manifest as a
  marker). It is bound to the run (`gs://BUCKET/PREFIX`), to its own object name, to the VM that
  wrote it (instance name and id) and to the bucket's step that the VM verified as authentic and
  at least as new as its disk's newest (`step`; None when neither the disk nor the bucket had one).
- **The bucket's judgement** (`unauthentic_step`, `newest_authentic`): one checkpoint authentic
  and complete, as the trainer judges it (`trainer.manifest_auth`: HMAC, run binding, its own step,
  every listed file there with its size), and the newest such step. The VM and the job both use them.
- **Whether a verified marker may still be acted on** (`stale`): its writer is a current member of
  one of the experiment's groups (an earlier incarnation's marker, replayed, names an instance
  that no longer exists), and the bucket holds no authentic step newer than the marker's (training
  went on after it was written). The residual risk is in docs/security.md.

Standard library only, like the rest of the stop path.
"""
from __future__ import annotations

import json
import re
from typing import Any, Callable

from trainer import manifest_auth, untrusted

KIND = "spottrain-stop-marker"
VERSION = 1
#: What the HMAC covers starts with this, so no other signed object of the run (a manifest) can
#: pass for a marker, and a marker cannot pass for anything else.
DOMAIN = b"spottrain stop marker v1\n"
_STEP = re.compile(r"step-(\d{8,})$")
#: The event the VM's stop path and the control job log for a marker they would not act on (what
#: the `markers_refused` metric counts, `stacks.run_metrics`).
REFUSED_EVENT = "stop_marker_refused"


def _body(record: dict[str, Any]) -> bytes:
    return DOMAIN + manifest_auth.canonical({k: v for k, v in record.items() if k != "hmac"})


def sign(secret: bytes, record: dict[str, Any]) -> bytes:
    """The marker's bytes: ``record`` with its kind, version, key id and HMAC."""
    signed = {**record, "kind": KIND, "version": VERSION, "key_id": manifest_auth.key_id(secret)}
    signed["hmac"] = manifest_auth.sign(secret, _body(signed))
    return json.dumps(signed, sort_keys=True).encode()


def verify(raw: bytes, secret: bytes, *, name: str, run: str) -> tuple[dict[str, Any] | None, str]:
    """(the record, "") when ``raw``, read from object ``name``, is a marker this run wrote; else
    (None, why not)."""
    try:
        record = untrusted.loads(raw, limit=untrusted.SMALL_MAX_BYTES, what="a stop marker")
    except untrusted.Garbage as e:
        return None, str(e)
    if not isinstance(record, dict):
        return None, "not a stop marker (no JSON object)"
    if record.get("kind") != KIND or record.get("version") != VERSION:
        return None, "not a signed stop marker (no kind/version): planted, or written before markers were signed"
    if record.get("key_id") != manifest_auth.key_id(secret):
        return None, f"it names checkpoint key {str(record.get('key_id'))[:64]}, this run's is {manifest_auth.key_id(secret)}"
    if not manifest_auth.verify(secret, _body(record), record.get("hmac")):
        return None, "its HMAC does not verify with this run's checkpoint key"
    # Signed by the run; now bound to this run and to this object (a marker of another run of the
    # key, or one copied to another name, is not this one).
    if record.get("run") != run:
        return None, f"signed for the run at {str(record.get('run'))[:200]!r}, this run is {run!r}"
    if record.get("name") != name:
        return None, f"signed as {str(record.get('name'))[:200]!r}, found at {name!r}"
    step = record.get("step")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
        return None, f"its step is {step!r}"
    if not isinstance(record.get("instance_id"), str) or not record["instance_id"]:
        return None, "it names no instance id"
    return record, ""


def steps_in(sizes: dict[str, int]) -> list[int]:
    """The steps that have a manifest among ``sizes``' names, newest first."""
    found = {int(m.group(1)) for n in sizes if n.endswith("/manifest.json")
             and (m := _STEP.search(n.rsplit("/", 2)[-2]))}
    return sorted(found, reverse=True)


def unauthentic_step(read: Callable[[str], bytes | None], prefix: str, run: str, step: int,
                     sizes: dict[str, int], secret: bytes) -> str | None:
    """None when the bucket's ``step`` (under ``prefix``; ``sizes``: its listing, name -> bytes;
    ``read``: an object's bytes by name) is authentic and complete for ``run``, else why not."""
    folder = f"{prefix}/step-{step:08d}/"
    size = sizes.get(folder + "manifest.json")
    if size is None:
        return "not there"
    if not 0 <= size <= untrusted.MANIFEST_MAX_BYTES:
        return f"its manifest is {size} bytes, too large to be one"
    raw = read(folder + "manifest.json")
    if raw is None:
        return "not there"
    try:
        m = untrusted.loads(raw, limit=untrusted.MANIFEST_MAX_BYTES, what="manifest")
    except untrusted.Garbage as e:
        return str(e)
    why = manifest_auth.unauthentic(m, secret)
    if why is not None:
        return "unauthenticated: " + why
    why = manifest_auth.other_run(m, run)
    if why is not None:
        return "another run's: " + why
    if m.get("step") != step or not isinstance(m.get("files"), dict):
        return f"its manifest says step {m.get('step')!r}"
    for fname, info in m["files"].items():
        want = info.get("size") if isinstance(info, dict) else None
        if sizes.get(folder + fname) != want:
            return f"{fname} is missing or not {want} bytes"
    return None


def newest_authentic(read: Callable[[str], bytes | None], prefix: str, run: str, sizes: dict[str, int],
                     secret: bytes, *, above: int = -1) -> tuple[int | None, list[str]]:
    """The newest authentic step in the bucket that is greater than ``above``, and why each newer
    candidate was not one."""
    refused: list[str] = []
    for step in steps_in(sizes):
        if step <= above:
            break
        why = unauthentic_step(read, prefix, run, step, sizes, secret)
        if why is None:
            return step, refused
        refused.append(f"step {step}: {why}")
    return None, refused


def member_ids(managed: dict[str, Any]) -> set[str]:
    """The instance ids of a `listManagedInstances` answer (a member being created has none yet)."""
    return {str(m["id"]) for m in managed.get("managedInstances", []) if m.get("id")}


def stale(record: dict[str, Any], *, vms: int, ids: set[str], newer: int | None) -> str | None:
    """Why a verified marker must not be acted on now, or None. ``vms``: how many VMs a resize to
    zero would delete (every group's members), ``ids``: the instance ids of the experiment's VMs;
    ``newer``: the newest authentic step in the bucket above the marker's (None when there is none)."""
    if newer is not None:
        return (f"the bucket holds authentic step {newer}, newer than the marker's {record.get('step')}: "
                "training went on after it was written (a replayed marker)")
    if vms == 0:
        return None  # no VM, no disk: scaling empty groups to zero deletes nothing (a stop already done)
    if record["instance_id"] not in ids:
        return (f"it was written by {str(record.get('instance'))[:100]!r} (id {record['instance_id'][:40]}), "
                "which is no VM of the experiment now: a marker of an earlier VM (a replay), while another "
                "VM's disk may be ahead of the bucket")
    return None
