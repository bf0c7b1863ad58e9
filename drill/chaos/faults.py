"""The faults of the chaos matrix: what each reproduces, how the harness injects it, and at which
moments of a run it applies (and why not at the others).

Moments (`MOMENTS`), each with what the harness does (drill.chaos.matrix):

- ``startup``: the next boot starts while the fault is there (for Cloud Storage faults on a blank
  disk: the checkpoints are only in GCS); the fault goes once the trainer says it waits for it,
  or once it exits;
- ``periodic``: the fault starts just before a periodic save (step 10) and lasts through the
  next one (15) and the preemption notice (step 17): a request in flight when the notice comes;
- ``emergency``: the fault starts right before the preemption notice (step 13): the emergency
  save's own writes meet it;
- ``final``: the fault starts right before the last step: the final save meets it;
- ``restore``: the fault strikes while the next boot restores (a download from GCS onto a blank
  disk, or the disk's own copy).

A fault is injected with `inject(rig, moment)`, may need `ready(rig, moment, trainer)` once the
trainer runs (a trigger on the first download, a stalled request to be in flight, the trainer's
reaction to be seen), and is taken away with `remove(rig)` (an attacker's objects stay: removing
them is someone's decision, not the job's). `observed(rig)` adds what the fault did to the
table's notes.

Families: Cloud Storage failing (down, blackhole, 403, bursts, stalls, lost answers), bytes
corrupted in transit, the disks (full, read-only, corrupt), two writers, and whoever can write
the bucket without holding the checkpoint key (forged, replayed, garbage and oversized objects,
deleted checkpoints, for checkpoints, manifests, the lease, the ledger and the stop marker). A
fault with ``nproc`` 2 runs its cells under torchrun with two ranks (DDP, gloo on CPU); one with
``nodes`` 2 on two nodes (a torchrun agent each, one gloo rank each, their own disks and SSDs,
one bucket), where node a leads the first run and node b every next boot. One with ``script``
trains an own loop (`python -m trainer run --script`, drill.chaos.own_loop) instead of the task.
"""
from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from drill.attacker import (code_running_pickle, copy_step, delete_step, forge_in_bucket, plant, read_manifest,
                            state_file)
from drill.chaos.rig import EVERY, GUARD_S, LEASE_TTL_S, STEPS, Rig, Trainer

MOMENTS = ("startup", "periodic", "emergency", "final", "restore")

#: The trainer says it waits for a tier it cannot read (trainer.checkpoint.tier_wait).
WAITING = r"\bevent=waiting_for_tier\b"
#: Requests as the fault proxy names them (path?query object=NAME).
DOWNLOAD = r"alt=media.* object=\S*/step-\d+/tensors\.bin"
CHECKPOINT = r"step-"
UPLOAD_TENSORS = r"object=\S*/step-\d+/tensors\.bin"
LISTING = r"/o\?\S*prefix=[^&\s]*step-"
MANIFEST = r"object=\S*/step-\d+/manifest\.json"
LEASE = r"object=\S*/lease\.json"
#: The trainer finds its writer lease replaced (trainer.checkpoint.lease).
LEASE_LOST = r"\bevent=lease_lost\b"

#: Garbage as a bucket writer plants it: deep enough to exhaust a parser's recursion (a naive
#: `json.loads` raises RecursionError), and objects just over the trainer's size bounds
#: (trainer.untrusted: 16 MiB for a manifest, 1 MiB for the lease and a ledger event).
NESTED = b"[" * 200_000
OVERSIZED_MANIFEST = b" " * ((16 << 20) + 1)
OVERSIZED_SMALL = b" " * ((1 << 20) + 1)

GCS_NA_RESTORE_WRITES = "a restore writes nothing to GCS"


@dataclass
class Fault:
    key: str                      # the name CHAOS_CELLS selects
    title: str                    # the table's row
    reproduces: str               # what it is in the real cloud
    injects: str                  # how the harness makes it happen
    na: dict[str, str]            # moment -> why there is no cell
    waits: bool = False           # at start-up/restore the trainer should wait for it (removed then)
    blank_pd: tuple[str, ...] = ()  # moments whose next boot gets a blank persistent disk
    #: moment -> why the job cannot finish there while the fault stays (an attacker's object the
    #: trainer never overwrites): the cell then checks that no trainer exits 0, that nothing is
    #: lost and that the final step is on the persistent disk (drill.chaos.matrix).
    unfinishable: dict[str, str] = field(default_factory=dict)
    nproc: int = 1                # ranks on the VM: 2 runs the trainer under torchrun (DDP, gloo)
    nodes: int = 1                # VMs of the job: 2 runs a torchrun agent per node (drill.chaos.rig)
    script: bool = False          # the job keeps its own loop: examples/own_loop/train.py (drill.chaos.own_loop)

    def moments(self) -> list[str]:
        return [m for m in MOMENTS if m not in self.na]

    def inject(self, rig: Rig, moment: str) -> None:
        raise NotImplementedError

    def ready(self, rig: Rig, moment: str, t: Trainer) -> None:
        """After the trainer started (or was let go) at ``moment``: what must be in place before
        the harness goes on. Default: nothing."""

    def met(self, rig: Rig, moment: str, t: Trainer) -> None:
        """Right after the injection at a moment of the first run, the trainer still parked: wait
        until it has met the fault, when it meets it on a thread of its own. Default: nothing."""

    def remove(self, rig: Rig) -> None:
        raise NotImplementedError

    def observed(self, rig: Rig) -> list[str]:
        """What the fault did, for the table's notes. Default: nothing to add."""
        return []

    def missed(self, rig: Rig) -> str | None:
        """Why the fault never struck (then the cell proved nothing: a violation), or None."""
        return None

    def broken(self, rig: Rig) -> list[str]:
        """What the fault broke that the matrix's own checks do not look at (violations). Default:
        nothing."""
        return []

    #: Final save: a preemption notice comes while the fault holds the save (a stalled request).
    notice_in_final: ClassVar[bool] = False


# ------------------------------------------------------------------------------ Cloud Storage


class _Gcs(Fault):
    def remove(self, rig: Rig) -> None:
        rig.proxy.clear()
        rig.proxy.up()


class GcsDown(_Gcs):
    def inject(self, rig: Rig, moment: str) -> None:
        if moment == "restore":  # the first payload download is held, then the server goes away
            self.trigger = rig.proxy.add("GET", DOWNLOAD, "stall")
        else:
            rig.proxy.down()

    def ready(self, rig: Rig, moment: str, t: Trainer) -> None:
        if moment == "restore" and _held(rig, self.trigger, t):
            rig.proxy.down()
            rig.proxy.release(self.trigger)  # its connection is cut


class GcsBlackhole(_Gcs):
    def inject(self, rig: Rig, moment: str) -> None:
        if moment == "restore":
            self.trigger = rig.proxy.add("GET", DOWNLOAD, "stall")
        else:
            rig.proxy.blackhole()

    def ready(self, rig: Rig, moment: str, t: Trainer) -> None:
        if moment == "restore" and _held(rig, self.trigger, t):
            rig.proxy.blackhole()  # the held download is never answered either


class Gcs403(_Gcs):
    def inject(self, rig: Rig, moment: str) -> None:
        rig.proxy.add("GET" if moment == "restore" else "*", DOWNLOAD if moment == "restore" else ".", "status",
                      status=403, times=None)


class GcsBurst(_Gcs):
    """Three refusals in a row (429, 503, 503), then normal service."""

    def inject(self, rig: Rig, moment: str) -> None:
        pattern = {"startup": ".", "restore": DOWNLOAD}.get(moment, CHECKPOINT)
        rig.proxy.add("*", pattern, "status", status=429, times=1)
        rig.proxy.add("*", pattern, "status", status=503, times=2)


class StallUpload(_Gcs):
    notice_in_final = True

    def inject(self, rig: Rig, moment: str) -> None:
        self.rule = rig.proxy.add("POST", UPLOAD_TENSORS, "stall", times=None)

    def ready(self, rig: Rig, moment: str, t: Trainer) -> None:
        if moment == "final":
            _held(rig, self.rule, t)


class StallListing(_Gcs):
    def inject(self, rig: Rig, moment: str) -> None:
        self.rule = rig.proxy.add("GET", LISTING, "stall", times=1)


class LostAnswer(_Gcs):
    def inject(self, rig: Rig, moment: str) -> None:
        rig.proxy.add("POST", LEASE if moment == "startup" else MANIFEST, "after-forward", status=503, times=1)


class GcsFlip(_Gcs):
    """Bits corrupted in transit, the stored objects intact: at start-up the newest step's manifest
    (the survey's quick check), at restore its tensors.bin, each read twice in a row with a byte
    flipped (the third read is whole); during saves the next upload of a tensors.bin arrives with
    a byte flipped."""

    READS = 2

    def inject(self, rig: Rig, moment: str) -> None:
        if moment in ("startup", "restore"):
            newest = max(rig.steps_in_bucket())
            name = r"manifest\.json" if moment == "startup" else r"tensors\.bin"
            self.rule = rig.proxy.add("GET", rf"alt=media.* object=\S*/step-{newest:08d}/{name}", "flip",
                                      times=self.READS)
        else:
            self.rule = rig.proxy.add("POST", UPLOAD_TENSORS, "flip-request", times=1)

    def observed(self, rig: Rig) -> list[str]:
        hit = [f"{s.path.rsplit('/', 2)[-2]}/{s.path.rsplit('/', 1)[-1]}: {s.outcome}"
               for s in rig.proxy.seen() if "flipped" in s.outcome]
        return [f"flipped: {'; '.join(hit)}"] if hit else []

    def missed(self, rig: Rig) -> str | None:
        return None if self.rule.hits else "no request was corrupted (the trainer never made a matching one)"


def _held(rig: Rig, rule: Any, t: Trainer) -> bool:
    """Block until ``rule`` holds a request (the proxy counts them) or ``t`` ends."""
    import time

    end = time.monotonic() + GUARD_S
    while rule.held < 1:
        if not t.alive() or time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


# ------------------------------------------------------------------------------ disks


class PdFull(Fault):
    def inject(self, rig: Rig, moment: str) -> None:
        rig.pd.fill()

    def remove(self, rig: Rig) -> None:
        rig.pd.free()


class PdReadOnly(Fault):
    def inject(self, rig: Rig, moment: str) -> None:
        os.sync()  # what the trainer wrote before the disk failed is on it (its writes are fsynced anyway)
        rig.pd.readonly()
        self.active = True

    def remove(self, rig: Rig) -> None:
        if getattr(self, "active", False):
            rig.pd.writable()
            self.active = False


class SsdFull(Fault):
    def inject(self, rig: Rig, moment: str) -> None:
        rig.ssd.fill()

    def remove(self, rig: Rig) -> None:
        rig.ssd.free()


class PdCorrupt(Fault):
    """The newest checkpoint on the disk: cut short at start-up (a torn write the disk kept), one
    byte flipped at restore (bit rot: same size, only the sha256 tells)."""

    def inject(self, rig: Rig, moment: str) -> None:
        self.corrupt(rig.run_dir, moment)

    @staticmethod
    def corrupt(run_dir: Path, moment: str) -> int:
        """Damage the newest checkpoint in ``run_dir`` as at ``moment``; its step."""
        newest = max(run_dir.glob("step-*"))
        tensors = newest / "tensors.bin"
        data = bytearray(tensors.read_bytes())
        if moment == "startup":
            data = data[: len(data) // 2]
        else:
            data[len(data) // 2] ^= 0x01
        tensors.write_bytes(bytes(data))
        os.sync()
        return int(newest.name.removeprefix("step-"))

    def remove(self, rig: Rig) -> None:
        pass  # the damaged copy stays: the trainer must cope (and may replace it)


# ------------------------------------------------------------------------------ the bucket's attacker


class Tampered(Fault):
    """A checkpoint newer than the job's, planted in the bucket by someone who can write it but
    does not hold the checkpoint key: its state is a pickle that creates the cell's marker file
    if anything unpickles it; every sha256 and the manifest's self-checksum recomputed."""

    legacy = True      # format 1: a pickled state.pt, as older trainers wrote (no HMAC at all)
    keep_hmac = False  # the genuine manifest's HMAC kept over the altered content

    def inject(self, rig: Rig, moment: str) -> None:
        client = rig.client()
        genuine = max(rig.steps_in_bucket())
        self.forged = genuine + 1  # newer than anything authentic: a trainer that believed it would take it
        payload = code_running_pickle(rig.marker)
        name = "state.pt" if self.legacy else state_file(read_manifest(client, rig.uri, genuine))
        forge_in_bucket(client, rig.uri, genuine, self.forged, {name: payload}, legacy=self.legacy,
                        keep_hmac=self.keep_hmac)

    def remove(self, rig: Rig) -> None:
        pass  # an attacker's objects stay in the bucket


class TamperedHmac(Tampered):
    legacy = False
    keep_hmac = True


#: The step the run saves next at each moment with a save (drill.chaos.matrix): the periodic
#: cell's second save, the emergency save at the notice (step 13), the final save.
SAVED_AT = {"periodic": 3 * EVERY, "emergency": 13, "final": STEPS}


class Replay(Fault):
    """Another run's authentic checkpoint (signed with the experiment's key, which every run of it
    shares) copied into this run's prefix: a run of the same task, settings and data, stopped
    once it has saved that step (drill.chaos.rig.Rig.other_run)."""

    def inject(self, rig: Rig, moment: str) -> None:
        # At a save, the step it is about to write; at start-up, newer than anything of the run's.
        self.forged = SAVED_AT.get(moment) or 3 * EVERY
        assert self.forged > max(rig.steps_in_bucket(), default=0) or moment in SAVED_AT
        copy_step(rig.client(), rig.other_run(self.forged), rig.uri, self.forged)

    def remove(self, rig: Rig) -> None:
        pass  # an attacker's objects stay in the bucket


class PlantedFirstBoot(Fault):
    """Before the job's first boot, its prefix gets another run's authentic checkpoint (step 15)
    and an unsigned forgery whose state is the marker pickle (step 16): a run with nothing of its
    own must set them aside and train, never exit 2 on every boot (drill.chaos.matrix runs it:
    the first run is the fault's boot)."""

    #: What the trainer logs when it sets them aside (trainer.observe.sinks.log).
    SET_ASIDE = r"\bevent=checkpoints_set_aside saved_before=(\d) steps=(\S+)"

    def inject(self, rig: Rig, moment: str) -> None:
        client = rig.client()
        self.forged = 3 * EVERY  # the authentic one: a trainer that took it would resume from 15
        copy_step(client, rig.other_run(self.forged), rig.uri, self.forged)
        name = state_file(read_manifest(client, rig.uri, self.forged))
        forge_in_bucket(client, rig.uri, self.forged, self.forged + 1, {name: code_running_pickle(rig.marker)})

    def remove(self, rig: Rig) -> None:
        pass  # an attacker's objects stay in the bucket

    def observed(self, rig: Rig) -> list[str]:
        said = [(t.role, m) for t in rig.trainers for m in t.find(self.SET_ASIDE)]
        return [f"{role} set aside steps {m.group(2)} (saved before: {'yes' if m.group(1) == '1' else 'no'})"
                for role, m in said]

    def missed(self, rig: Rig) -> str | None:
        if not any(t.find(self.SET_ASIDE) for t in rig.trainers):
            return "no trainer set the planted checkpoints aside"
        return None


class GarbageManifest(Fault):
    """Two planted steps: 200 KB of nested `[` as a manifest (with a payload object beside it), and
    a manifest one byte over the trainer's 16 MiB bound at the next step."""

    def inject(self, rig: Rig, moment: str) -> None:
        step = SAVED_AT.get(moment) or max(rig.steps_in_bucket()) + 1
        client = rig.client()
        plant(client, rig.uri, f"step-{step:08d}/tensors.bin", b"x" * 1024)
        plant(client, rig.uri, f"step-{step:08d}/manifest.json", NESTED)
        plant(client, rig.uri, f"step-{step + 1:08d}/manifest.json", OVERSIZED_MANIFEST)
        self.forged = step

    def remove(self, rig: Rig) -> None:
        pass


class DeleteCheckpoints(Fault):
    """Every checkpoint of the run in the bucket deleted, the newest included (the persistent
    disk intact)."""

    def inject(self, rig: Rig, moment: str) -> None:
        self.deleted = rig.steps_in_bucket()
        for step in self.deleted:
            delete_step(rig.client(), rig.uri, step)

    def remove(self, rig: Rig) -> None:
        pass

    def observed(self, rig: Rig) -> list[str]:
        return [f"deleted from GCS: step {', '.join(map(str, self.deleted))}"]


class GarbageLease(Fault):
    """``lease.json`` replaced by 200 KB of nested `[` (mid-run: the live lease; at start-up: the
    one the next boot finds)."""

    def inject(self, rig: Rig, moment: str) -> None:
        from trainer.checkpoint.lease import LEASE_KEY

        plant(rig.client(), rig.uri, LEASE_KEY, NESTED)
        self.lost_seen: bool | None = None

    def met(self, rig: Rig, moment: str, t: Trainer) -> None:
        # The holder's next renewal (every ttl/4) finds it replaced.
        self.lost_seen = t.wait_for(LEASE_LOST, LEASE_TTL_S) is not None

    def missed(self, rig: Rig) -> str | None:
        return "the holder never found its lease replaced (no event=lease_lost)" if self.lost_seen is False else None

    def observed(self, rig: Rig) -> list[str]:
        out = [f"{t.role} found its lease replaced: wrote nothing more to GCS" for t in rig.trainers
               if t.find(LEASE_LOST)]
        out += [f"{t.role} took the unreadable lease over once nobody renewed it" for t in rig.trainers
                if t.find(r"event=lease_acquired .*took_over=expired previous=\"?unreadable")]
        return out

    def remove(self, rig: Rig) -> None:
        pass


class PlantedLedger(Fault):
    """Goodput events planted in the ledger's bucket copy (``goodput/<session>/<seq>.json``): a
    well-formed one claiming step 99999999 durable in the bucket (were it trusted, every restore
    would refuse as a rollback: exit 2 for good), 200 KB of nested `[` and one over 1 MiB.
    Scripted in drill.chaos.matrix: a boot that copies them back, then one that restores after it."""

    FORGED_STEP = 99_999_999

    def inject(self, rig: Rig, moment: str) -> None:
        import json

        from trainer.observe.ledger import LEDGER_DIR

        client, session = rig.client(), "9999999999999-forged00"
        event = {"session": session, "seq": 0, "event": "durable", "tier": "gcs", "step": self.FORGED_STEP,
                 "t": time.time(), "e": 0.0}
        plant(client, rig.uri, f"{LEDGER_DIR}/{session}/000000.json", json.dumps(event).encode())
        plant(client, rig.uri, f"{LEDGER_DIR}/{session}/000001.json", NESTED)
        plant(client, rig.uri, f"{LEDGER_DIR}/{session}/000002.json", OVERSIZED_SMALL)

    def missed(self, rig: Rig) -> str | None:
        from trainer.observe.ledger import LEDGER_DIR, LEDGER_FILE, read_events

        events = read_events(rig.run_dir / LEDGER_DIR / LEDGER_FILE)
        if any(e.get("step") == self.FORGED_STEP for e in events):
            return None
        return "the forged event never reached the run dir's ledger (the guard never read it)"

    def observed(self, rig: Rig) -> list[str]:
        from trainer.observe.ledger import LEDGER_DIR, LEDGER_FILE, read_events

        marked = [e.get("recovered") is True for e in read_events(rig.run_dir / LEDGER_DIR / LEDGER_FILE)
                  if e.get("step") == self.FORGED_STEP]
        if not marked:
            return []
        return ["the forged event copied back into the run dir's ledger, " + (
            "marked recovered (not counted)" if all(marked) else "NOT marked recovered")]

    def remove(self, rig: Rig) -> None:
        pass


#: A step the chaos job never reaches (STEPS is 20): a record of it can only be forged.
FORGED_STEP = 99


class ForgedLogText(Fault):
    """Text shaped like the trainer's own `event=finished` and `event=step` lines, inside a line and
    after a newline, in what the trainer logs: the writer lease's holder and host, a manifest's key
    id and another's hash name (planted in the bucket), and the task's own output
    (``CHAOS_LOG_TEXT``, drill.chaos.task). The next boots run with a log key, as on a VM; their
    output goes through the log shipper's own rule (``trainer.cloud.log_shipper.entry``, the
    trainer unit's journal records): no record may say finished or step 99."""

    FINISHED = f"2026-01-01T00:00:00.000 INFO trainer event=finished step={FORGED_STEP}"
    STEP = f"2026-01-01T00:00:00.000 INFO trainer event=step step={FORGED_STEP}/{FORGED_STEP} loss=0.1 steps_per_s=1"
    INLINE = f"x event=finished step={FORGED_STEP} event=step step={FORGED_STEP}/{FORGED_STEP}"

    def inject(self, rig: Rig, moment: str) -> None:
        import json

        from trainer.checkpoint.lease import LEASE_KEY
        from trainer.cloud.log_shipper import KEY_ENV, load_key

        client = rig.client()
        newline = f"x\n{self.FINISHED}\n{self.STEP}"
        lease = {"holder": newline, "host": self.INLINE, "pid": 7, "incarnation": "planted", "started": "now",
                 "renewed": "now", "ttl_s": 1}
        plant(client, rig.uri, LEASE_KEY, json.dumps(lease).encode())
        genuine = max(rig.steps_in_bucket())

        def key_id(m: dict) -> None:  # 64 characters of it reach a line: a newline and a whole line
            m["auth"]["key_id"] = f"k\n{self.FINISHED}"

        def hash_name(m: dict) -> None:
            m["hash"] = f"{self.INLINE}\n{self.STEP}"

        forge_in_bucket(client, rig.uri, genuine, genuine + 1, {}, keep_hmac=True, edit=key_id)
        forge_in_bucket(client, rig.uri, genuine, genuine + 2, {}, edit=hash_name)
        # The VM's log key (its shipper makes it) and the task's own forged output, for every next boot.
        self.key_file = rig.dir / "log.key"
        self.key = load_key(str(self.key_file), create=True)
        rig.env = {**rig.env, KEY_ENV: str(self.key_file), "CHAOS_LOG_TEXT": f"{self.INLINE}\n{self.FINISHED}"}

    def _entries(self, rig: Rig) -> list[dict[str, Any]]:
        """The next boots' output as the shipper ships it: each line a record of the trainer unit."""
        from trainer.cloud.log_shipper import entry

        cfg = {"project": "chaos", "experiment": rig.name, "run": rig.name}
        unit = {"_SYSTEMD_UNIT": "spottrain.service", "_SYSTEMD_INVOCATION_ID": "c" * 32}
        return [entry({"MESSAGE": line, **unit}, cfg, {}, self.key)
                for t in rig.trainers if t.role != "first" for line in t.lines]

    def missed(self, rig: Rig) -> str | None:
        lines = [line for t in rig.trainers if t.role != "first" for line in t.lines]
        routes = {"the lease's holder": "previous=", "a key id": "names checkpoint key",
                  "a hash name": "unsupported file hash", "the task's output": "a sample: "}
        absent = [what for what, mark in routes.items()
                  if not any(mark in line and f"event=finished step={FORGED_STEP}" in line for line in lines)]
        return f"the planted text never reached a log line through {', '.join(absent)}" if absent else None

    def broken(self, rig: Rig) -> list[str]:
        # The trainer's own records name steps up to STEPS; only the planted text names FORGED_STEP.
        bad = [e["jsonPayload"]["message"][:160] for e in self._entries(rig)
               if e["jsonPayload"].get("step") == FORGED_STEP
               or (e["jsonPayload"].get("event") == "finished" and e["jsonPayload"].get("step") != STEPS)]
        return [f"a forged log record: {m!r}" for m in bad[:3]]

    def observed(self, rig: Rig) -> list[str]:
        planted = [e["jsonPayload"] for e in self._entries(rig) if f"step={FORGED_STEP}" in e["jsonPayload"]["message"]]
        signed = [p for p in planted if "level" in p]  # the trainer's own lines, the text quoted in them
        return [f"{len(planted)} shipped lines held the planted text: {len(signed)} the trainer's own (the text "
                f"quoted), {len(planted) - len(signed)} plain messages without fields"]

    def remove(self, rig: Rig) -> None:
        pass  # an attacker's objects stay in the bucket


class NodePowerOff(Fault):
    """Scripted in drill.chaos.matrix: a node's agent and worker SIGKILLed at once."""

    def inject(self, rig: Rig, moment: str) -> None:
        raise AssertionError("scripted in drill.chaos.matrix")

    def remove(self, rig: Rig) -> None:
        pass  # the node boots again with the job


class PoolNotice(Fault):
    """A preemption notice and nothing else: the cell's notice itself is the fault (which nodes of
    a pool it reaches). To both nodes: the generic cell; to one: scripted in drill.chaos.matrix."""

    def inject(self, rig: Rig, moment: str) -> None:
        pass  # the cell's own notice at step 13

    def remove(self, rig: Rig) -> None:
        pass


class NotTheTrainers(Fault):
    """An object `trainer run` never reads: every moment is n/a, with the reason."""

    def inject(self, rig: Rig, moment: str) -> None:
        raise AssertionError("no cell")

    def remove(self, rig: Rig) -> None:
        pass


# ------------------------------------------------------------------------------ two writers


class SecondTrainer(Fault):
    """Handled by the matrix's own scripts (drill.chaos.matrix): two processes, not an injection."""

    def inject(self, rig: Rig, moment: str) -> None:
        raise AssertionError("scripted in drill.chaos.matrix")

    def remove(self, rig: Rig) -> None:
        pass


class SecondVm(SecondTrainer):
    pass


_NO_BUCKET_READ_IN_RUN = ("the ledger's bucket copy is read once per session, when its mirror starts: events planted "
                          "during a session are met by the next one (the start-up and restore cells)")
_LOG_TEXT_AT_START = ("the trainer logs the planted text where it reads it, at a boot's start (the lease taken over, "
                      "the manifests listed, the task built): the start-up cell; what the shipper makes of a line "
                      "does not depend on the moment")
_STOP_MARKER = ("`trainer run` never reads a stop marker: only the VM's stop path (`python -m trainer.cloud.scale "
                "honour` at boot, before the trainer starts; `stop`) and the control job do. The rig runs the trainer "
                "alone (no group, no control job), so there is no cell: a marker the run did not sign (garbage, "
                "forged, another key's) is refused by the control job, which leaves the groups alone and logs "
                "stop_marker_refused; a bucket writer can delay or pause the job, never delete a good checkpoint "
                "(docs/security.md). tests/trainer/cloud/test_scale.py runs the real stop path and the real control "
                "job against the fakes under the stack's grants")
_STOP_MARKER_AHEAD = ("what scales to zero is the control job resizing the group, which deletes the VMs' disks; the rig "
                      "has neither (it runs `trainer run` on one disk), so the cell cannot be expressed here. The "
                      "proof is end to end in tests/trainer/cloud/test_scale.py: the disk at step 686, the bucket's "
                      "newest authentic step 600, planted markers and replayed authentic ones (an earlier VM's, one "
                      "overtaken by a newer step): the scheduled control job, the real process under the stack's "
                      "IAM, resizes nothing, fails, and logs stop_marker_refused")
_FIRST_BOOT = ("a first boot is the start-up moment: planted later, beside the run's own checkpoints, they are the "
               "replay and tampered cells")
_SAVES_ONLY = "the trainer reads a checkpoint only when it starts: a forgery planted during the run is met at the next start-up"
_TWO_WRITERS = ("who may write is settled when a trainer starts (run-dir lock, GCS lease) whatever the "
                "first one is doing: the start-up and restore cells")
_TORN = ("a save cut short at any point of its writes is the crash-consistency tests' case (SIGKILL at nine points "
         "of a save; `make soak`); the matrix's cells are the damaged copy a next boot finds")

FAULTS: dict[str, Fault] = {f.key: f for f in [
    GcsDown("gcs-down", "GCS down (connection refused)",
            "Cloud Storage unreachable: a network partition, a firewall or route change, Private Google Access lost",
            "the fault proxy stops listening (at restore: once the first payload download is under way)",
            {}, waits=True, blank_pd=("startup", "restore")),
    GcsBlackhole("gcs-blackhole", "GCS blackhole (accepts, never answers)",
                 "packets silently dropped: a half-open connection, a broken NAT or proxy",
                 "the proxy accepts every request and never answers it (at restore: from the first payload download)",
                 {}, waits=True, blank_pd=("startup", "restore")),
    Gcs403("gcs-403", "403 on everything (IAM propagation)",
           "the VM's bucket grant not yet propagated (up to 7 minutes) or withdrawn",
           "the proxy answers every request 403 (at restore: every payload download)",
           {}, waits=True, blank_pd=("startup", "restore")),
    GcsBurst("gcs-burst", "429 and 503 burst",
             "rate limiting and transient backend errors",
             "the proxy answers the next three matching requests 429, 503, 503, then serves normally",
             {}, blank_pd=("startup", "restore")),
    StallUpload("stall-upload", "stalled upload of tensors.bin",
                "one request stuck in the network (a slow path, a lost packet with no timeout)",
                "the proxy holds every upload of a step's tensors.bin without an answer",
                {"startup": "start-up uploads no checkpoint", "restore": GCS_NA_RESTORE_WRITES}),
    StallListing("stall-listing", "stalled listing",
                 "one listing stuck in the network (restore's, an upload's check, retention's)",
                 "the proxy holds the next listing of checkpoints without an answer",
                 {"restore": "the restore's listing is the start-up cell's"}, waits=True, blank_pd=("startup",)),
    LostAnswer("lost-answer", "lost answer after a write",
               "the write reached Cloud Storage but its answer was lost (a reset after the request)",
               "the proxy forwards the write, then answers 503 (start-up: the lease's creation; saves: the manifest)",
               {"restore": GCS_NA_RESTORE_WRITES}, blank_pd=("startup",)),
    GcsFlip("gcs-flip", "bytes flipped in transit (GCS)",
            "bits corrupted between the VM and Cloud Storage (a faulty NIC, router or middlebox: what the client's "
            "crc32c and the manifest's sha256 are for); the stored objects intact",
            "the fault proxy flips one byte in the middle of a body, headers untouched. Start-up: the first two reads "
            "of the newest step's manifest (the survey's quick check); restore: the first two downloads of its "
            "tensors.bin (both on a blank disk: the checkpoints only in GCS); saves: the next upload of a "
            "tensors.bin, a multipart request whose metadata carries the payload's crc32c, which Cloud Storage and "
            "the emulator check (400, nothing stored). Uploads over 8 MiB go resumable with the crc32c in the last "
            "chunk's x-goog-hash, which Cloud Storage checks; the emulator stores the bytes and the client, seeing "
            "another crc32c, deletes them: not exercised here (the matrix's checkpoints are about 200 KB)",
            {}, blank_pd=("startup", "restore")),
    PdFull("pd-full", "PD full (ENOSPC)",
           "the persistent disk full (logs, data, leftovers)",
           "a real ext4 filled to the last block (at restore: a blank disk, full before the download)",
           {}, blank_pd=("restore",)),
    PdReadOnly("pd-readonly", "PD read-only (EROFS)",
               "ext4 errors=remount-ro after a disk I/O error",
               "a real ext4 aborted (mount -o remount,abort): EROFS whatever is open; back after a check, as after a reboot "
               "(at restore: a blank disk)",
               {}, blank_pd=("restore",)),
    SsdFull("ssd-full", "local SSD full",
            "the local SSD full (the fast tier, lost with the VM)",
            "a real tmpfs filled to the last byte",
            {"restore": "a replacement VM's local SSD is blank: it never holds a restore"}),
    PdCorrupt("pd-corrupt", "corrupted newest checkpoint on the PD",
              "a torn write the disk kept; bit rot",
              "tensors.bin of the disk's newest checkpoint cut in half (start-up) or one byte flipped (restore)",
              {"periodic": _TORN, "emergency": _TORN, "final": _TORN}),
    SecondTrainer("second-trainer", "a second trainer on the same run dir",
                  "a duplicated VM or a human starting the job again on the same disk",
                  "a second `trainer run` on the same run dir (start-up: while the first trains; restore: both at once)",
                  {"periodic": _TWO_WRITERS, "emergency": _TWO_WRITERS, "final": _TWO_WRITERS}),
    SecondVm("second-vm", "a second VM on the same GCS prefix",
             "two VMs of one job (a second deploy, a duplicated group)",
             "a second `trainer run` with its own run dir on the same GCS prefix (start-up: while the first "
             "trains; restore: both at once, the second on a blank disk)",
             {"periodic": _TWO_WRITERS, "emergency": _TWO_WRITERS, "final": _TWO_WRITERS}),
    Tampered("tampered-pickle", "tampered checkpoint: pickle payload, sha256 recomputed",
             "a bucket writer without the key (a leaked objectAdmin, a compromised pipeline)",
             "a newer checkpoint planted in the bucket: a __reduce__ pickle as state.pt (format 1), every sha256 "
             "and the manifest's self-checksum recomputed (start-up: disk intact; restore: blank disk)",
             {"periodic": _SAVES_ONLY, "emergency": _SAVES_ONLY, "final": _SAVES_ONLY}, blank_pd=("restore",)),
    TamperedHmac("tampered-hmac", "tampered checkpoint: current format, invalid HMAC",
                 "the same writer replaying a genuine signature over altered content",
                 "a genuine checkpoint copied to a newer step with its state replaced by the pickle, sha256s "
                 "recomputed, the genuine manifest's HMAC kept",
                 {"periodic": _SAVES_ONLY, "emergency": _SAVES_ONLY, "final": _SAVES_ONLY}, blank_pd=("restore",)),
    Replay("replay", "replay: another run's authentic checkpoint copied in",
           "a bucket writer without the key copying a checkpoint signed with the experiment's key, which every run "
           "of the experiment shares, from another run's prefix into this run's",
           "another run of the experiment (same task, settings and data, its own prefix) stopped once it saved a "
           "step, that step copied object by object, unchanged, into the cell's prefix: step 15, newer than anything "
           "of the run's (start-up: disk intact; restore: blank disk), or the step a save is about to write "
           "(periodic 15, emergency 13, final 20)",
           {}, blank_pd=("restore",),
           unfinishable={"final": "the other run's step 20 occupies the run's final step in GCS, which the trainer "
                                  "never overwrites, and the final save's read-back refuses it (another run's): "
                                  "exit 74 on every boot until someone removes it, never 0 (docs/security.md: a "
                                  "bucket writer can keep a run from finishing)"}),
    PlantedFirstBoot("planted-first-boot", "planted checkpoints at a first boot",
                     "a bucket writer without the key copying another run's authentic checkpoint, and an unsigned "
                     "forgery, into the prefix of a run that has none of its own yet (before this change: exit 2 on "
                     "every boot until someone removed them)",
                     "before the job's first boot: another run's step 15 copied in unchanged and step 16 forged from "
                     "it (the marker pickle as its state, no HMAC); the first boot must set them aside "
                     "(event=checkpoints_set_aside saved_before=0) and train; a notice at step 13, and the next boot "
                     "resumes the job's own step 13 beside them",
                     {"periodic": _FIRST_BOOT, "emergency": _FIRST_BOOT, "final": _FIRST_BOOT,
                      "restore": _FIRST_BOOT}),
    GarbageManifest("garbage-manifest", "garbage and oversized manifests",
                    "a bucket writer planting objects no parser should choke on (or a broken tool writing into the "
                    "prefix)",
                    "200 KB of nested `[` as step N's manifest.json (a 1 KB tensors.bin beside it) and 16 MiB + 1 byte "
                    "as step N+1's: N the step after the run's newest (start-up: disk intact; restore: blank disk), "
                    "or the step a save is about to write (periodic 15, emergency 13, final 20)",
                    {}, blank_pd=("restore",)),
    DeleteCheckpoints("delete-checkpoints", "checkpoints deleted from the bucket (the newest too)",
                      "a bucket writer (or a lifecycle rule, a human) deleting the run's checkpoints",
                      "every checkpoint of the run in GCS deleted, the newest included, the persistent disk intact: "
                      "before the next boot (start-up), or while the run trains (at the moment's start)",
                      {"restore": "with a blank persistent disk the run's own record of what was durable (its "
                                  "ledger) is gone too, and its bucket copy is the deleter's to delete or forge: a "
                                  "restore cannot tell deleted checkpoints from ones never written and resumes what "
                                  "is left (docs/security.md: Object Versioning with a retention period is the "
                                  "cure); with the disk intact, the start-up cell"}),
    GarbageLease("garbage-lease", "garbage writer lease",
                 "a bucket writer replacing the writer lease (lease.json) with bytes no parser should choke on",
                 "200 KB of nested `[` as lease.json. Start-up: before the next boot, which finds an unreadable "
                 "lease nobody renews; emergency and final: the live lease replaced before the notice or the last "
                 "step, the harness going on once the holder's renewal found it (event=lease_lost)",
                 {"periodic": "the lease is renewed on its own thread (every ttl/4), not with the saves: a "
                              "replacement found mid-run stops the run at its next step, whose two outcomes are the "
                              "emergency cell's (a notice too) and the final cell's (none)",
                  "restore": "the lease is taken before the restore begins: the start-up cell"}),
    PlantedLedger("planted-ledger", "planted ledger events in the bucket",
                  "a bucket writer planting goodput events in the ledger's bucket copy",
                  "in goodput/<session>/: a well-formed event claiming step 99999999 durable in the bucket, 200 KB "
                  "of nested `[` and 1 MiB + 1 byte. Boot 1 copies them back (event=ledger_recover) and is stopped "
                  "by a notice at its second step; boot 2 restores with them in its ledger (were the forged one "
                  "trusted, every restore would refuse as a rollback: exit 2). Start-up: disk intact; restore: "
                  "blank disk (the whole ledger comes back from the bucket)",
                  {"periodic": _NO_BUCKET_READ_IN_RUN, "emergency": _NO_BUCKET_READ_IN_RUN,
                   "final": _NO_BUCKET_READ_IN_RUN}, blank_pd=("restore",)),
    ForgedLogText("forged-log-text", "forged log text",
                  "a bucket writer (the lease's holder, a manifest's key id or hash name) or a task's own output "
                  "writing text shaped like the trainer's `event=finished` and `event=step` lines, inside a line and "
                  "after a newline, for the log shipper to make records of (the finished alert, the stall watchdog)",
                  "before the next boot: lease.json naming such a holder and host (taken over once it expires), the "
                  "run's newest step copied to two newer ones whose manifests name such a key id and hash name, and "
                  "the task printing and logging it; the next boots run with a log key, as on a VM, and their output "
                  "goes through the log shipper's rule: no record may say finished or step 99",
                  {"periodic": _LOG_TEXT_AT_START, "emergency": _LOG_TEXT_AT_START, "final": _LOG_TEXT_AT_START,
                   "restore": _LOG_TEXT_AT_START}),
    NotTheTrainers("stop-marker", "planted or garbage stop marker",
                   "a bucket writer creating the job's stop marker (`<prefix>/stop/...`), garbage or not",
                   "not injected: no cell", {m: _STOP_MARKER for m in MOMENTS}),
    NotTheTrainers("stop-marker-disk-ahead", "a planted stop marker while a disk is ahead",
                   "a bucket writer planting (or restoring an old authentic) stop marker while a VM's disk holds a "
                   "newer valid step than the bucket's newest authentic one (a disturbed lease): the scheduled "
                   "control job would scale the group to zero and delete that disk",
                   "not injected: no cell", {m: _STOP_MARKER_AHEAD for m in MOMENTS}),
]}


# ------------------------------------------------------------------------------ world size 2

_WS2_SAMPLE = ("world size 2 runs a sample of the matrix (torchrun and two ranks make a cell about twice as long): "
               "the moments where the ranks must agree (an emergency save's verdict, a restore's fallback, a lost "
               "lease); the others are the world size 1 row's")


def _variant(key: str, moments: tuple[str, ...], *, prefix: str, title: str, injects: str, sample: str,
             **changes: Any) -> Fault:
    """The fault ``key`` in another shape of job (``changes``), at ``moments`` only: the other
    moments say why with ``sample``."""
    base = FAULTS[key]
    return dataclasses.replace(
        base, key=f"{prefix}-{key}", title=f"{base.title}, {title}", injects=f"{base.injects}; {injects}",
        na={m: base.na.get(m, sample) for m in MOMENTS if m not in moments},
        blank_pd=tuple(m for m in base.blank_pd if m in moments),
        unfinishable={m: why for m, why in base.unfinishable.items() if m in moments}, **changes)


def _ws2(key: str, moments: tuple[str, ...]) -> Fault:
    """The fault ``key`` at ``moments``, two ranks on the VM (torchrun, DDP, gloo on CPU)."""
    return _variant(key, moments, prefix="ws2", title="world size 2", sample=_WS2_SAMPLE, nproc=2,
                    injects="two ranks under torchrun (DDP, gloo on CPU), rank 0 saving, training the 16-layer GPT "
                            "(788 tensors with AdamW's state: a restore between ranks at a real shape)")


for _f in [_ws2("gcs-down", ("emergency", "restore")), _ws2("gcs-flip", ("restore",)),
           _ws2("pd-corrupt", ("restore",)), _ws2("tampered-hmac", ("startup",)),
           _ws2("garbage-lease", ("final",))]:
    FAULTS[_f.key] = _f


# ------------------------------------------------------------------------------ an own loop

_SCRIPT_SAMPLE = ("the own loop runs a sample of the matrix: the checkpointing under its loop is the task's (one "
                  "engine, trainer.loop.steps); the cell shows that a script's own loop keeps the promise at the "
                  "moment where the loop must hand over: a notice between two of its steps, the save on what is left")


def _own_loop(key: str, moments: tuple[str, ...]) -> Fault:
    """The fault ``key`` at ``moments``, the job an own loop: `python -m trainer run --script` running
    examples/own_loop/train.py (pytorch/examples' MNIST, its loop kept) instead of a task."""
    return _variant(key, moments, prefix="own-loop", title="own loop", sample=_SCRIPT_SAMPLE, script=True,
                    injects="the job is examples/own_loop/train.py run by `python -m trainer run --script` (its own "
                            "loop, Adadelta and a per-epoch StepLR that steps at steps 10 and 20, 1.2 M parameters)")


for _f in [_own_loop("gcs-down", ("emergency",))]:
    FAULTS[_f.key] = _f


# ------------------------------------------------------------------------------ two nodes

_NODES2_SAMPLE = ("two nodes run a sample of the matrix (two torchrun agents, a rendezvous and two disks make a "
                  "cell about three times as long): where what one node's disk holds differs from the other's and "
                  "from GCS; the others are the world size 1 and 2 rows'")
_NODES2 = ("; two nodes on loopback (a torchrun agent each, --nnodes 2, one gloo rank each, c10d rendezvous on a "
           "coordinator that does not train), each with its own persistent disk, local SSD and metadata server, one "
           "bucket; the 16-layer GPT (788 tensors with AdamW's state); the notice reaches both nodes. Node a gets rank 0 in the first run (its disk holds the "
           "checkpoints), node b on every next boot (the rig orders their addresses; the logged node ranks are "
           "checked)")

for _f in [
    GcsDown("nodes2-gcs-down", "GCS down (connection refused), two nodes",
            FAULTS["gcs-down"].reproduces,
            "the fault proxy stops listening. Emergency: from before the notice at step 13, so its save reaches "
            "node a's disk only, and the next boot, GCS back, must take step 13 from the non-leader's disk. "
            "Start-up: the same first run, then the next boot starts with GCS down: the newest step on the "
            "non-leader's disk alone, GCS unknown (it could hold a newer one): the job waits for it, then resumes "
            "13" + _NODES2,
            {"periodic": _NODES2_SAMPLE, "final": _NODES2_SAMPLE,
             "restore": "with the newest on one node's disk alone the restore downloads nothing from GCS: the "
                        "start-up cell (GCS down as the next boot starts)"},
            waits=True, nodes=2),
    PdCorrupt("nodes2-pd-corrupt", "corrupted newest checkpoint on the non-leader's disk, two nodes",
              "bit rot on the disk of a node that is not rank 0 and holds the job's newest step, while the other "
              "node's disk holds a valid step newer than GCS's (each was rank 0 when its step was saved)",
              "GCS refuses two emergency saves (down from before each notice): the first run's (node a leading) "
              "leaves step 13 on node a's disk alone; boot 1 (node b leading) resumes it from there, and its own "
              "(a notice while it waits before step 15) leaves step 15 on node b's disk alone; GCS's newest is the "
              "first run's last periodic save (10). Before boot 2 (node a leading) one byte of b's step 15 flips: b "
              "offers 15 (the quick check passes) and fails full verification; the job must resume from the newest "
              "valid step anywhere, a's 13 (not GCS's older step, "
              "not from scratch), steps 14 and 15 lost as allowed (step 15's only copy rotted)" + _NODES2.replace(
                  "node b on every next boot", "node b on the next boot, node a again on the one after"),
              {"startup": _NODES2_SAMPLE, "periodic": _TORN, "emergency": _TORN, "final": _TORN}, nodes=2),
    PoolNotice("nodes2-notice-both", "preemption notice to both nodes, two nodes",
               "a pool's VMs preempted together (a zone's Spot capacity reclaimed): every node's metadata flag and "
               "SIGTERM at once",
               "the cell's notice at step 13 and nothing else: both nodes' metadata servers flip instance/preempted "
               "and both agents get SIGTERM; rank 0 (node a) saves the step in flight on every tier and the next "
               "boot (node b leading) resumes it" + _NODES2,
               {"startup": _NODES2_SAMPLE, "periodic": _NODES2_SAMPLE, "final": _NODES2_SAMPLE,
                "restore": _NODES2_SAMPLE}, nodes=2),
    PoolNotice("nodes2-notice-one", "preemption notice to the non-leader only, two nodes",
               "one VM of a pool preempted while the other runs on: the node holding rank 0 gets no notice",
               "at step 13 only node b (rank 1) gets the notice (its metadata flag, SIGTERM to its agent); node a "
               "(rank 0) hears it through the ranks' per-step stop flag, saves the step in flight on every tier "
               "within b's budget, and exits with b (the rig's agents do not restart their workers: the whole job "
               "boots again); the next boot (node b leading) resumes exactly that step" + _NODES2.replace(
                   "; the notice reaches both nodes", ""),
               {"startup": _NODES2_SAMPLE, "periodic": _NODES2_SAMPLE, "final": _NODES2_SAMPLE,
                "restore": _NODES2_SAMPLE}, nodes=2),
    NodePowerOff("nodes2-power-off", "a node powered off, two nodes",
                 "a VM of a pool losing power without a notice (a host failure, a kernel panic, a Spot VM whose "
                 "notice never came)",
                 "node a (rank 0, the saver) and its worker SIGKILLed while parked before step 13, step 10 durable "
                 "on every tier; "
                 "node b's worker meets the dead peer and fails; the whole job boots again (node a with its "
                 "persistent disk; blank SSDs) and must resume the newest durable step, the steps after it lost "
                 "by design" + _NODES2,
                 {"startup": "a power-off during start-up meets no checkpoint work: the restore cells",
                  "emergency": "a power-off is the absence of a notice: the periodic cell",
                  "final": "a power-off after the final save is a finished job; before it, the periodic cell's",
                  "restore": "a power-off during a restore loses nothing the disks and the bucket hold: the next "
                             "boot's restore is the periodic cell's"},
                 nodes=2),
]:
    FAULTS[_f.key] = _f
