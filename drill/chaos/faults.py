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
trainer runs (a trigger on the first download, a stalled request to be in flight), and is taken
away with `remove(rig)`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, ClassVar

from drill.attacker import code_running_pickle, forge_in_bucket, read_manifest, state_file
from drill.chaos.rig import GUARD_S, Rig, Trainer

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

    def moments(self) -> list[str]:
        return [m for m in MOMENTS if m not in self.na]

    def inject(self, rig: Rig, moment: str) -> None:
        raise NotImplementedError

    def ready(self, rig: Rig, moment: str, t: Trainer) -> None:
        """After the trainer started (or was let go) at ``moment``: what must be in place before
        the harness goes on. Default: nothing."""

    def remove(self, rig: Rig) -> None:
        raise NotImplementedError

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
        newest = max(rig.run_dir.glob("step-*"))
        tensors = newest / "tensors.bin"
        data = bytearray(tensors.read_bytes())
        if moment == "startup":
            data = data[: len(data) // 2]
        else:
            data[len(data) // 2] ^= 0x01
        tensors.write_bytes(bytes(data))
        os.sync()

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
        genuine = max(_gcs_steps(rig))
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


def _gcs_steps(rig: Rig) -> list[int]:
    prefix = rig.uri.split("/", 3)[3] + "/"
    return sorted({int(b.name[len(prefix):].split("/")[0].removeprefix("step-"))
                   for b in rig.client().list_blobs(rig.emulator.bucket, prefix=prefix + "step-")
                   if b.name.endswith("/manifest.json")})


# ------------------------------------------------------------------------------ two writers


class SecondTrainer(Fault):
    """Handled by the matrix's own scripts (drill.chaos.matrix): two processes, not an injection."""

    def inject(self, rig: Rig, moment: str) -> None:
        raise AssertionError("scripted in drill.chaos.matrix")

    def remove(self, rig: Rig) -> None:
        pass


class SecondVm(SecondTrainer):
    pass


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
]}
