"""The chaos matrix: every fault at every moment it applies to, against the real trainer, and the
promise checked in each cell.

A cell (`run_cell`) is one fault at one moment (drill.chaos.faults). Its first run is a fresh job
of `STEPS` steps, saving every `EVERY` steps to the local SSD, the persistent disk and GCS; the
fault is injected at the moment, plays out (a preemption notice, a final save, an exit), and is
taken away; then the trainer runs again (the next boot, up to three boots) until it exits 0.
For the start-up and restore moments the first run is clean (notice at step 13) and the fault
meets the next boot.

Every cell must keep the promise (`Result.violations`):

- nothing lost beyond the step in flight: the step the next boot resumes from is the last step
  the first run completed (a notice lets the step in flight finish and saves it). A cell whose
  fault destroys steps by design (a node powered off without a notice, the only copy of a step
  rotting) allows exactly those (`Result.allowed`): it must resume from the newest valid step
  anywhere;
- no fresh start while a checkpoint exists: no boot restores step 0;
- no code run: the marker file of the forged checkpoints' pickle never appears, and no boot loads
  a forged checkpoint;
- exit 0 means finished: the final checkpoint is on the persistent disk and in GCS when a trainer
  exits 0 (read back by the harness at once), and the job's final model equals the uninterrupted
  reference run's (`model_digest`, on each durable tier);
- no trainer hangs (one without a notice is powered off after `GUARD_S`) or crashes (exit 1
  with a traceback); two trainers never train one job at once;
- no corrupt copy is kept: every step a trainer reported durable on GCS that is still in the
  bucket holds exactly what its manifest lists (read back by the harness: sizes and sha256s);
- the fault struck (a fault that never met the trainer proves nothing: `Fault.missed`);
- two nodes: every boot's rank 0 was on the node the rig meant (`Rig.lead`), or the cell did not
  test the node it names (the non-leader).

Where a fault keeps the job from finishing by design (`Fault.unfinishable`: an attacker's object
at the final step, which the trainer never overwrites), exit 0 must not happen at all, one next
boot shows it persists, and the final model is checked on the persistent disk only; the cell
says why in its notes.
"""
from __future__ import annotations

import fnmatch
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from drill.attacker import intact
from drill.chaos.faults import FAULTS, MOMENTS, WAITING, Fault, PdCorrupt
from drill.chaos.rig import EVERY, STEPS, Job, Rig, Trainer, key_env, reference_name
from drill.gcs_emulator import StorageEmulator

BOOTS = 3  # next boots at most (one with the fault, then after it is gone)
OUTAGE_S = 45.0  # the longest a start-up or restore outage lasts (removed sooner once the trainer waits)
SYNC_S = 60.0  # guard of a synchronisation point of a healthy run (a park, a save durable on GCS)


class CellAborted(Exception):
    """A synchronisation point never came (the trainer ended or hung first)."""


@dataclass
class Result:
    fault: str
    moment: str
    na: str | None = None
    stopped: int | None = None         # the last step the first run completed
    resumed: int | None = None         # the step the next boot(s) resumed from (the lowest)
    allowed: int = 0                   # steps the fault itself destroys (a power-off, the only copy rotted)
    exits: list[tuple[str, str]] = field(default_factory=list)
    unpickled: str = "no"
    fresh_start: bool = False
    digest_equal: bool | None = None
    violations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def lost(self) -> int | None:
        if self.stopped is None or self.resumed is None:
            return None
        return max(0, self.stopped - self.resumed)

    @property
    def too_many_lost(self) -> str | None:
        """The violation when more steps were lost than the cell allows (none by default: only the
        step in flight may go, and a notice saves it), else None."""
        if not self.lost or self.lost <= self.allowed:
            return None
        return (f"{self.lost} step(s) lost: the job had completed step {self.stopped}, the next boot resumed from "
                f"{self.resumed}" + (f" ({self.allowed} allowed: {self.stopped - self.allowed} was the newest that "  # type: ignore[operator]
                                     "survived the fault)" if self.allowed else ""))

    @property
    def ok(self) -> bool:
        return self.na is not None or not self.violations

    @property
    def verdict(self) -> str:
        return "n/a" if self.na is not None else "PASS" if self.ok else "FAIL"


def cells(selection: str = "") -> list[tuple[str, str]]:
    """Every (fault, moment) of the matrix, n/a ones included, filtered by ``selection``:
    comma-separated ``FAULT:MOMENT`` globs (``gcs-*:startup,pd-full:*``; a bare ``FAULT`` means
    every moment)."""
    pats = [p.strip() if ":" in p else f"{p.strip()}:*" for p in selection.split(",") if p.strip()]
    out = []
    for key in FAULTS:
        for moment in MOMENTS:
            if not pats or any(fnmatch.fnmatchcase(f"{key}:{moment}", p) for p in pats):
                out.append((key, moment))
    return out


# ------------------------------------------------------------------------------------ a cell


class Cell:
    def __init__(self, rig: Rig, fault: Fault, moment: str, reference: str, log: Callable[[str], None]):
        self.rig, self.fault, self.moment, self.reference, self.log = rig, fault, moment, reference, log
        self.r = Result(fault.key, moment)
        self.first: Trainer | None = None
        self.boots: list[Trainer] = []
        self.forged_step: int | None = None
        self.injected = False
        self.unfinishable = fault.unfinishable.get(moment)

    def inject(self) -> None:
        self.fault.inject(self.rig, self.moment)
        self.injected = True
        self.forged_step = getattr(self.fault, "forged", None)

    # --- synchronisation ------------------------------------------------------------------
    def must(self, ok: object, what: str, t: Trainer) -> None:
        if not ok:
            if not t.alive():
                t.finish()
            raise CellAborted(f"{t.role}: {what} never came (exit {t.exit})")

    def newest(self, tier: str, run_dir: Path | None = None) -> tuple[int | None, str | None]:
        """``Rig.newest``; a `status` that fails (it met a checkpoint it cannot read) is a violation."""
        try:
            return self.rig.newest(tier, run_dir)
        except Exception as e:  # noqa: BLE001
            self.r.violations.append(f"status of {tier} failed: {type(e).__name__}: {e}")
            return None, None

    def park(self, t: Trainer, step: int) -> None:
        self.must(self.rig.parked(t, step, SYNC_S), f"step {step}", t)

    def durable(self, t: Trainer, step: int, tier: str = "gcs") -> None:
        self.must(t.wait_for(rf"checkpoint step {step} durable on {tier}\b", SYNC_S), f"step {step} durable on {tier}", t)

    def boot_to_the_end(self, first: int = 1) -> None:
        """Next boots (numbered from ``first``), each run to its end, until one exits 0, ``BOOTS``
        at most; none exiting 0 is a violation."""
        for i in range(first, first + BOOTS):
            t = self.rig.start(f"boot {i}")
            self.boots.append(t)
            t.finish()
            self.ended(t)
            if t.rc == 0:
                return
        self.r.violations.append("the job never finished (no boot exited 0)")

    def ended(self, t: Trainer) -> None:
        """``t`` exited (or was powered off): record it; exit 0 must mean finished and durable."""
        if t.rc is None and t.killed is None:
            t.finish()
        self.r.exits.append((t.role, t.exit))
        if t.killed and t.notice_at is None:
            self.r.violations.append(f"{t.role} hung ({t.killed})")
        if t.rc == 1 and "Traceback" in t.output:
            self.r.violations.append(f"{t.role} crashed (exit 1 with a traceback)")
        if t.rc == 0:
            on = {tier: self.newest(tier, t.run_dir)[0] for tier in ("persistent", "gcs")}
            missing = [tier for tier, step in on.items() if step != STEPS]
            if missing:
                self.r.violations.append(f"{t.role} exited 0 but step {STEPS} is not on {'/'.join(missing)} "
                                         f"(newest: {on})")

    # --- the first run --------------------------------------------------------------------
    def settle(self, t: Trainer, step: int) -> None:
        """Park ``t`` at ``step`` and wait until its newest periodic save is durable on GCS (the last
        tier), so that a fault injected now meets what comes next, not a save still under way.
        (Which step that save is depends on the checkpointer: a save due while the previous one is
        still being written is made a step or two later.)"""
        self.park(t, step)
        saves = [int(m.group(1)) for m in t.find(r"\bevent=checkpoint_save step=(\d+)")]
        if saves:
            self.durable(t, max(saves))

    def first_run(self) -> None:
        """A fresh job; the fault at this cell's moment (none for start-up and restore cells)."""
        rig, fault, moment = self.rig, self.fault, self.moment
        if moment == "periodic":
            t = self.first = rig.start("first", park=[6, 17])
            self.settle(t, 6)
            self.inject()  # from before the next periodic save to after the notice
            fault.met(rig, moment, t)
            rig.release(6)
            self.park(t, 17)
            got = sorted({(int(m.group(1)), m.group(2)) for m in t.find(r"checkpoint step (\d+) durable on (\w+)")
                          if int(m.group(1)) > EVERY})
            self.r.notes.append("while it lasted: " + (", ".join(f"{k} on {n}" for k, n in got) or "no save durable"))
            t.notice(rig.metadata)
            rig.release(17)
        elif moment == "final":
            t = self.first = rig.start("first", park=[STEPS])
            self.settle(t, STEPS)
            self.inject()
            fault.met(rig, moment, t)
            rig.release(STEPS)
            if fault.notice_in_final:
                fault.ready(rig, moment, t)
                t.notice(rig.metadata)
        else:  # emergency; start-up and restore cells: a clean run stopped by a notice
            t = self.first = rig.start("first", park=[13])
            self.settle(t, 13)
            if moment == "emergency":
                self.inject()
                fault.met(rig, moment, t)
            t.notice(rig.metadata)
            rig.release(13)
        t.finish()
        self.ended(t)
        steps = t.steps()
        self.r.stopped = max(steps) if steps else 0
        m = t.find(r"\bevent=preempted step=\d+ (.*?) seconds=")
        if m:
            self.r.notes.append(f"first: {m[-1].group(1)}")

    # --- the next boots -------------------------------------------------------------------
    def next_boots(self) -> None:
        rig, fault, moment = self.rig, self.fault, self.moment
        at_boot = moment in ("startup", "restore")
        if not at_boot:
            fault.remove(rig)
        rig.next_boot(blank_pd=moment in fault.blank_pd)
        if at_boot:
            self.inject()
        present = at_boot
        # One boot shows that a job that cannot finish stays unfinished (and never exits 0).
        for i in range(1, (1 if self.unfinishable else BOOTS) + 1):
            t = rig.start(f"boot {i}")
            self.boots.append(t)
            if present:
                fault.ready(rig, moment, t)
                if fault.waits:  # an outage: until the trainer says it waits, at most OUTAGE_S
                    waited = t.wait_for(WAITING, OUTAGE_S)
                    self.r.notes.append(f"boot {i} waited for the tier" if waited else
                                        f"boot {i}: fault removed after {OUTAGE_S:.0f}s" if t.alive() else
                                        f"boot {i} ended without waiting")
                else:
                    t.finish()
                fault.remove(rig)
                present = False
            t.finish()
            self.ended(t)
            if t.rc == 0:
                break
        if self.unfinishable:
            self.r.notes.append(f"cannot finish: {self.unfinishable}")
        elif not any(t.rc == 0 for t in self.boots):
            self.r.violations.append("the job never finished (no boot exited 0)")

    # --- the checks -----------------------------------------------------------------------
    def check(self) -> None:
        r, rig = self.r, self.rig
        runs = self.boots
        restores = [(t.role, t.restored()) for t in runs]
        steps = [x[1][0] for x in restores if x[1] is not None]
        r.resumed = min(steps) if steps else None
        if any(s == 0 for s in steps):
            r.fresh_start = True
            r.violations.append("a boot started from scratch while a checkpoint existed")
        if r.too_many_lost:
            r.violations.append(r.too_many_lost)
        if self.forged_step is not None:
            why = [m.group(1) for t in self.rig.trainers for m in t.find(
                rf"(?:refusing|ignoring) \w+ checkpoint step {self.forged_step} at \S+: ([^;(]+)")]
            if why:
                r.notes.append(f"planted step {self.forged_step} refused: {why[0].strip()}")
            removed = [m.group(1) for t in self.rig.trainers for m in t.find(
                rf"removing partial upload of step {self.forged_step} on gcs \((.*)\)$")]
            if removed:
                r.notes.append(f"planted step {self.forged_step} replaced by the run's own (garbage, not a "
                               f"checkpoint: {removed[0]})")
            # The job's own copy of that step on a disk (it trained it) is no forgery: only a
            # restore of that step from the bucket, or of one the job never trained, is.
            # (Garbage at a step the run then saved was replaced by the run's own copy: any tier's.)
            own = {s for t in self.rig.trainers for s in t.steps()}
            for t in runs:
                m = t.find(r"\bevent=restore step=(\d+)(?: tier=(\S+))?")
                if m and int(m[0].group(1)) == self.forged_step and (self.forged_step not in own or (
                        m[0].group(2) not in ("persistent", "local") and not removed)):
                    r.violations.append(f"{t.role} loaded the planted checkpoint (step {self.forged_step}, "
                                        f"{m[0].group(2)})")
        if rig.marker.exists():
            r.unpickled = "YES (trainer run)"
            r.violations.append("the forged checkpoint's pickle ran (trainer run)")
        done = [t for t in runs if t.rc == 0]
        digests = {tier: self.newest(tier, done[-1].run_dir if done else None) for tier in ("persistent", "gcs")}
        if rig.marker.exists() and r.unpickled == "no":
            r.unpickled = "YES (trainer status)"
            r.violations.append("the forged checkpoint's pickle ran (trainer status)")
        if self.unfinishable:  # the bucket's final step is the attacker's: the disk's must be the job's
            digests.pop("gcs")
        r.digest_equal = all(d == (STEPS, self.reference) for d in digests.values())
        if not r.digest_equal:
            r.violations.append("the final model is not the reference's on every tier (" + ", ".join(
                f"{tier}: step {step}" + (", the reference's digest" if digest == self.reference else ", another digest")
                for tier, (step, digest) in digests.items()) + ")")
        trained = [t.role for t in runs if t.steps()]
        if len(trained) > 1 and self.fault.key.startswith("second-"):
            r.violations.append(f"two trainers trained the job: {', '.join(trained)}")
        r.violations += self.corrupt_in_bucket()
        if rig.nodes > 1:
            self.check_leaders()
        if self.injected:
            r.notes += self.fault.observed(rig)
            r.violations += self.fault.broken(rig)
            missed = self.fault.missed(rig)
            if missed:
                r.violations.append(f"the fault never struck: {missed}")

    def check_leaders(self) -> None:
        """Two nodes: the rig meant one node to get rank 0 at each boot (`Rig.lead`); what the
        trainers logged must say so, or the cell did not test the node it names."""
        seen = []
        for job in self.rig.jobs:
            ranks = job.ranks()
            rank0 = [n for n, rank in ranks.items() if rank == 0]
            seen.append(f"{job.role} {rank0[0] if rank0 else '?'}")
            if rank0 and rank0 != [job.leader]:
                self.r.violations.append(f"{job.role}: node {rank0[0]} got rank 0, the rig meant node {job.leader}")
        self.r.notes.append("rank 0 on node: " + ", ".join(seen))

    def corrupt_in_bucket(self) -> list[str]:
        """Every step a trainer reported durable on GCS that is still there must hold what its
        manifest lists (a copy corrupted on the way up, kept, would fail a later restore)."""
        durable = {int(m.group(1)) for t in self.rig.trainers
                   for m in t.find(r"checkpoint step (\d+) durable on gcs\b")}
        client = self.rig.client()
        bad = []
        for step in sorted(durable & set(self.rig.steps_in_bucket())):
            why = intact(client, self.rig.uri, step)
            if why:
                bad.append(f"step {step} in GCS, reported durable, is corrupt: {why}")
        return bad

    def run(self) -> Result:
        t0 = time.monotonic()
        try:
            script = SCRIPTS.get((self.fault.key, self.moment))
            if script is not None:
                script(self)
            else:
                self.first_run()
                self.next_boots()
            self.check()
        except CellAborted as e:
            self.r.violations.append(str(e))
            for t in self.rig.trainers:  # how each ended, for the table
                if (t.role, t.exit) not in self.r.exits and not t.alive():
                    t.finish()
                    self.r.exits.append((t.role, t.exit))
        except Exception as e:  # noqa: BLE001 - a harness error is a failed cell, with its reason
            self.r.violations.append(f"harness error: {type(e).__name__}: {e}")
            self.log(traceback.format_exc())
        finally:
            for t in self.rig.trainers:
                t.kill()
        self.r.seconds = time.monotonic() - t0
        return self.r


# ------------------------------------------------------------------------------------ a first boot


def _planted_at_first_boot(c: Cell) -> None:
    """The fault is planted before the job's first boot (not the next one's, as other start-up
    cells): that boot must set the planted checkpoints aside and train (a notice at step 13), and
    the next boot resume its own step 13 beside them and finish."""
    c.inject()
    c.first_run()  # a start-up cell's first run: clean but for the planted objects, notice at 13
    first = c.first.restored() if c.first is not None else None
    if first is None or first[0] != 0:  # its own first step, not the planted 15 or 16
        c.r.violations.append(f"the first boot did not start from scratch beside the planted checkpoints "
                              f"(restored {first}, exit {c.first.exit if c.first else None})")
    c.rig.next_boot()
    c.boot_to_the_end()


# ------------------------------------------------------------------------------------ two writers


def _second_writer_startup(c: Cell, run_dir: Path | None, what: str) -> None:
    """B starts while A trains: on A's run dir (B exits 2 naming A), or on another VM's blank disk
    with A's GCS prefix (B must not write the job: it waits for A's lease and gives up, exit 2).
    A carries on unharmed."""
    rig = c.rig
    a = c.first = rig.start("first", park=[6, 13])
    c.settle(a, 6)
    b = rig.start("second", run_dir=run_dir, local=run_dir is None)
    b.finish()
    c.ended(b)
    if b.rc != 2 or b.restored() is not None:
        c.r.violations.append(f"{what} exited {b.exit} (restored: {b.restored()})")
    rig.release(6)
    c.settle(a, 13)
    a.notice(rig.metadata)
    rig.release(13)
    a.finish()
    c.ended(a)
    c.r.stopped = max(a.steps())
    rig.next_boot()
    t = rig.start("boot 1")
    c.boots.append(t)
    t.finish()
    c.ended(t)


def _both_at_once(c: Cell, run_dir_b: object, local_b: bool) -> None:
    rig = c.rig
    c.first_run()
    rig.next_boot(blank_pd=False)
    a = rig.start("boot A")
    b = rig.start("boot B", run_dir=run_dir_b, local=local_b)  # type: ignore[arg-type]
    c.boots += [a, b]
    for t in (a, b):
        t.finish()
        c.ended(t)
    if not any(t.rc == 0 for t in (a, b)):
        t = rig.start("boot C")
        c.boots.append(t)
        t.finish()
        c.ended(t)
    if not any(t.rc == 0 for t in c.boots):
        c.r.violations.append("the job never finished (no boot exited 0)")
    bad = [f"{t.role} exited {t.exit}" for t in (a, b) if t.rc not in (0, 2)]
    if bad:
        c.r.violations.append("; ".join(bad))


# ------------------------------------------------------------------------------------ the ledger


def _ledger_copied_back(c: Cell) -> None:
    """Boot 1 copies the planted events back into its run dir's ledger (marked as the bucket's)
    and is stopped by a notice at its second step; boot 2 restores with them in its ledger, which
    the rollback guard reads: they must not count (boot 2 resumes boot 1's step, and finishes)."""
    rig = c.rig
    c.first_run()
    rig.next_boot(blank_pd=c.moment in c.fault.blank_pd)
    c.inject()
    b1 = rig.start("boot 1", park=[2])  # its second step (drill.chaos.task counts this process's)
    c.boots.append(b1)
    c.park(b1, 2)
    c.must(b1.wait_for(r"\bevent=ledger_recover events=\d+ from=gcs", SYNC_S), "the ledger's copy back from GCS", b1)
    b1.notice(rig.metadata)
    rig.release(2)
    b1.finish()
    c.ended(b1)
    saved = max(b1.steps(), default=None)
    rig.next_boot()
    b2 = rig.start("boot 2")
    c.boots.append(b2)
    b2.finish()
    c.ended(b2)
    got = b2.restored()
    if got is None or got[0] != saved:
        c.r.violations.append(f"boot 2 resumed from {got and got[0]}, boot 1 completed step {saved}")
    if b2.rc != 0:
        c.r.violations.append("the job never finished (boot 2 did not exit 0)")


# ------------------------------------------------------------------------------------ two nodes


def _stop_with_gcs_down(c: Cell, job: Job, step: int) -> None:
    """Park ``job`` at ``step``, take GCS away and send the notice: its emergency save reaches the
    disk of the node holding rank 0 alone. GCS comes back once the job has ended."""
    c.settle(job, step)
    c.rig.proxy.down()
    job.notice()
    c.rig.release(step)
    job.finish()
    c.ended(job)
    c.rig.proxy.up()
    m = job.find(r"\bevent=preempted step=\d+ (.*?) seconds=")
    if m:
        c.r.notes.append(f"{job.role}: {m[-1].group(1)}")


def _newest_on_one_disk(c: Cell) -> tuple[int | None, int | None]:
    """A first run of two nodes whose emergency save GCS refuses (down from before the notice at
    step 13, both nodes noticed): step 13 is on node a's disk alone (a held rank 0), GCS's newest
    is 10. The newest step on node a's disk and in GCS."""
    c.first = c.rig.start("first", park=[13])
    _stop_with_gcs_down(c, c.first, 13)
    c.r.stopped = max(c.first.steps(), default=0)
    return c.newest("persistent", c.rig.node_list[0].run_dir)[0], c.newest("gcs")[0]


def _corrupt_on_the_non_leader(c: Cell) -> None:
    """Step 13 on node a's disk alone; boot 1 (node b leading) resumes it and leaves step 15 on
    b's disk alone; one byte of that flips before boot 2, where a leads and b does not. b offers
    15 (its quick check passes), fails full verification, and the job must resume from the
    newest valid step anywhere: a's 13, not GCS's 10 (a fallback to the chosen node's own tiers
    only), not from scratch."""
    rig = c.rig
    on_a, gcs = _newest_on_one_disk(c)
    if on_a is None or gcs is None or on_a <= gcs:
        raise CellAborted(f"the first run left step {on_a} on node a's disk and {gcs} in GCS: no step on one disk alone")
    rig.next_boot()  # node b leads
    b1 = rig.start("boot 1", park=[2])  # its second step (drill.chaos.task counts this process's)
    c.boots.append(b1)
    _stop_with_gcs_down(c, b1, 2)
    got = b1.restored()
    if got is None or got[0] != c.r.stopped:
        c.r.violations.append(f"boot 1 resumed from {got and got[0]}, the first run completed step {c.r.stopped}")
    b = rig.node_list[1]
    on_b = c.newest("persistent", b.run_dir)[0]
    if on_b is None or on_b <= on_a:
        raise CellAborted(f"boot 1 left step {on_b} on node b's disk: nothing newer than a's {on_a}")
    c.r.stopped = max(b1.steps(), default=0)
    rig.next_boot(lead="a")
    flipped = PdCorrupt.corrupt(b.run_dir, c.moment)
    c.injected = True
    c.r.allowed = max(0, c.r.stopped - on_a)
    c.r.notes.append(f"step {flipped} on node b's disk alone, a byte of it flipped there; step {on_a} on node a's "
                     f"disk alone; GCS's newest {gcs}: the newest valid step anywhere is {on_a}")
    c.boot_to_the_end(first=2)
    if not rig.jobs[2].node["b"].find(rf"checkpoint step {flipped} (?:on \S+ at \S+ )?is unusable"):
        c.r.violations.append(f"the fault never struck: node b never found its step {flipped} unusable at boot 2")
    else:
        c.r.notes.append(f"node b found step {flipped} unusable; the nodes negotiated again")


def _newest_on_one_disk_gcs_down(c: Cell) -> None:
    """Step 13 on node a's disk alone, and the next boot starts with GCS down: the job cannot know
    GCS holds nothing newer, so it waits (never a fresh start, never GCS's older step), and
    resumes 13 from the non-leader's disk once GCS is back."""
    _newest_on_one_disk(c)
    c.next_boots()


def _node_powered_off(c: Cell) -> None:
    """Node a (rank 0, the saver) powered off without a notice while parked before step 13, step
    10 durable everywhere: node b's worker meets the dead peer and fails; the whole job boots
    again (node a with its persistent disk, blank SSDs) and resumes the newest durable step (on
    GCS or a's disk, both of which survive)."""
    rig = c.rig
    job = c.first = rig.start("first", park=[13])
    c.settle(job, 13)
    durable = max((int(m.group(1)) for m in job.find(r"checkpoint step (\d+) durable on (?:gcs|persistent)\b")),
                  default=0)
    victim, survivor = job.node["a"], job.node["b"]
    c.injected = True
    victim.kill()
    victim.killed = "powered off (no notice)"
    rig.release(13)
    survivor.finish()
    c.r.exits.append(("first", job.exit))
    if survivor.killed:
        c.r.violations.append(f"node b hung after its peer's power-off ({survivor.killed})")
    elif survivor.rc == 0:
        c.r.violations.append("node b exited 0 with its peer powered off")
    why = survivor.find(r"\bevent=failed reason=(\S+)")
    c.r.notes.append(f"node b: {'event=failed reason=' + why[-1].group(1) if why else 'no event=failed'}, "
                     f"exit {survivor.exit}")
    c.r.stopped = max(job.steps(), default=0)
    c.r.allowed = max(0, c.r.stopped - durable)
    c.r.notes.append(f"node a powered off at step {c.r.stopped}: the steps after the newest durable save "
                     f"({durable}) are lost by design")
    c.next_boots()


def _notice_to_one_node(c: Cell) -> None:
    """At step 13 only node b, the non-leader, is preempted (its metadata flag, SIGTERM to its
    agent); node a, rank 0, has no notice of its own and must save the step in flight for the
    job; both exit, and the next boot resumes exactly that step."""
    rig = c.rig
    job = c.first = rig.start("first", park=[13])
    c.settle(job, 13)
    c.injected = True
    b = rig.node_list[1]
    job.node[b.name].notice(b.metadata)
    job.notice_at = job.node[b.name].notice_at
    rig.release(13)
    job.finish()
    c.ended(job)
    a = job.node[rig.node_list[0].name]
    if a.killed:  # no notice of its own: a power-off is the guard's, a hang
        c.r.violations.append(f"node a, without a notice, never stopped ({a.killed})")
    c.r.stopped = max(job.steps(), default=0)
    m = job.find(r"\bevent=preempted step=\d+ (.*?) seconds=")
    c.r.notes.append(f"first: {m[-1].group(1)}" if m else "first: no event=preempted")
    c.next_boots()


SCRIPTS: dict[tuple[str, str], Callable[[Cell], None]] = {
    ("nodes2-notice-one", "emergency"): _notice_to_one_node,
    ("nodes2-pd-corrupt", "restore"): _corrupt_on_the_non_leader,
    ("nodes2-gcs-down", "startup"): _newest_on_one_disk_gcs_down,
    ("nodes2-power-off", "periodic"): _node_powered_off,
    ("second-trainer", "startup"): lambda c: _second_writer_startup(c, None, "the second trainer on the run dir"),
    ("second-trainer", "restore"): lambda c: _both_at_once(c, None, True),
    ("second-vm", "startup"): lambda c: _second_writer_startup(c, c.rig.dir / "other-vm", "the second VM"),
    ("second-vm", "restore"): lambda c: _both_at_once(c, c.rig.dir / "other-vm", False),
    ("planted-ledger", "startup"): _ledger_copied_back,
    ("planted-first-boot", "startup"): _planted_at_first_boot,
    ("planted-ledger", "restore"): _ledger_copied_back,
}


# ------------------------------------------------------------------------------------ the run


def reference_digest(workdir: Path, emulator: StorageEmulator, env: dict[str, str], nproc: int = 1,
                     nodes: int = 1, script: bool = False) -> str:
    """The uninterrupted run's final model digest (same task or script, settings, cadence, world
    size and nodes); its checkpoints stay in the bucket (the replay cells copy them)."""
    with Rig(workdir, emulator, reference_name(nproc, nodes, script), env, nproc=nproc, nodes=nodes,
             script=script) as rig:
        t = rig.start("reference")
        rc = t.finish()
        step, digest = rig.newest("persistent", t.run_dir)
        if rc != 0 or step != STEPS or digest is None:
            raise RuntimeError(f"the reference run failed (exit {t.exit}, newest step {step}):\n{t.output[-3000:]}")
        return digest


def run_matrix(selected: list[tuple[str, str]], workdir: Path, log: Callable[[str], None]) -> list[Result]:
    """Run the ``selected`` cells one after another (cells in parallel would fight for the cores
    and time the deadlines of each other); n/a ones are reported with their reason."""
    env = key_env(workdir)
    results: list[Result] = []
    with StorageEmulator("spottrain-chaos", quiet=True) as emulator:
        references: dict[tuple[int, int, bool], str] = {}  # (ranks per VM, VMs, own loop) -> the reference digest
        for n, (key, moment) in enumerate(selected, 1):
            fault = FAULTS[key]
            if moment in fault.na:
                results.append(Result(key, moment, na=fault.na[moment]))
                continue
            shape = (fault.nproc, fault.nodes, fault.script)
            if shape not in references:
                references[shape] = reference_digest(workdir, emulator, env, *shape)
                log(f"chaos: reference digest ({fault.nproc} rank(s) on each of {fault.nodes} node(s)"
                    f"{', own loop' if fault.script else ''}) {references[shape][:16]}")
            reference = references[shape]
            with Rig(workdir, emulator, f"{key}-{moment}", env, nproc=fault.nproc, nodes=fault.nodes,
                     script=fault.script) as rig:
                r = Cell(rig, fault, moment, reference, log).run()
            results.append(r)
            exits = ", ".join(f"{role} {code}" for role, code in r.exits)
            log(f"chaos: [{n}/{len(selected)}] {key}:{moment} {r.verdict} in {r.seconds:.0f}s: resumed "
                f"{r.resumed} lost {r.lost}; {exits}" + (f"; {'; '.join(r.violations)}" if r.violations else ""))
    return results
