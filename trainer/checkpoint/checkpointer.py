"""The ``Checkpointer``: when to save, where to, in the background; what to restore from; when a
checkpoint counts as durable. One checkpointer drives either layout
(``trainer.checkpoint.layout``); every tier is a record (``trainer.checkpoint.tiers``) and the
checkpointer asks its fields, never its name.

Saving (CheckFreq's snapshot/persist split), every tier failing on its own:

* ``save()`` blocks the loop only while the layout stages the state into host memory (pinned when
  CUDA is involved); that is the time it returns. The whole-model layout copies the weights and
  the optimizer state beside the loop's next forward and backward: the loop calls
  ``before_update()`` before its optimizer step, which waits for that copy if it still runs.
* The *disk writer* (a thread per save) waits for the copy, then has the layout write the due
  disk tiers (temporary folder, fsync, manifest last, atomic rename). A periodic save of one
  process writes at the lowest CPU priority where the time between saves leaves room for it,
  lifted back when it has yielded long enough (``trainer.checkpoint.yielding``). It never
  touches the network.
* The *uploader* (one long-lived thread) uploads a save that a remote tier is due for: from its
  committed disk folder (the home tier's, else another disk's), which frees host memory for the
  next save at once; else from the layout's staging folder; else, when no disk could take the
  save (a full or read-only disk), straight from host memory, which that upload then owns until it
  ends. Then it applies retention there. Every request it makes is bounded and each upload has its
  own abort flag, checked between requests and chunks.
* One disk write at a time: ``due()`` answers False while the disk writer runs (the due tier stays
  due and is saved at the first step after it finished; counted in ``stats["deferred_steps"]``).
  An upload never holds a disk save back: while one is in flight, the next save's upload to the
  same tier waits in a queue of one, where a newer save's replaces it (only the newest matters;
  across nodes every rank uploads its own shards, so uploads queue in order instead). An explicit
  ``save()`` while the disk writer runs waits for it (``stats["waited"]``): the caller asked for
  that exact step.
* Host memory is the layout's (``Layout.can_stage``): the whole-model layout keeps at most two
  buffers while training and drops a queued upload from memory when its buffer is needed.
* Background failures (disk full, a bucket unreachable after retries) are logged and counted; they
  never raise into the loop and never leave anything a restore would choose. A tier whose writes
  keep failing is reported by ``failing()`` (the health answer, the ledger, ``status``) until one
  succeeds.

Durable: ``durable(step, deadline=...)`` waits for the saves in flight (until the deadline) and
reads ``step`` back from every durable tier (``Tiers.complete``: across nodes only the remote ones):
its manifest parses and checks out, its HMAC verifies under the run's key (a manifest planted by
someone without the key is never durable), and every file it lists is there with the listed size. The
final checkpoint and a pause's count only then.

Restoring: the newest checkpoint that verifies (manifest self-check and HMAC under the run's key,
sizes, sha256 of every file) across all tiers, preferring the fastest tier for equal steps. A
remote copy newer than anything on disk is downloaded into the home tier (atomically) and loaded
from there; when the run dir cannot take it (full, read-only) through a temporary folder instead,
and when nothing can, the run dir is unknown (start-up waits): a disk's failure never makes a
checkpoint unusable. Any invalid copy is logged with the reason and the next one tried (the same
step on a slower tier, then older steps). A tier that cannot be listed or read is unknown, not
empty: a trainer's restore raises ``TierUnknown`` rather than choose without it
(``trainer.checkpoint.tier_wait`` waits); a read-only look (``download=False``: ``status``,
``export``) only notes it. What is never a reason to fall back or start afresh (a
``ResumeMismatch``, exit 2, nothing deleted): a checkpoint that verified but cannot be decoded or
does not fit the model, checkpoints of the other layout or another format version, and
unauthenticated or other-run checkpoints on a disk tier when nothing authentic is left. Such
checkpoints only in the bucket, where anyone who can write it may have planted them, are set aside
(``set_aside``: never loaded, deleted or overwritten) and the run starts from scratch, saying
whether its signed run record (``trainer.checkpoint.run_record``, written with the first upload of
each session) shows it saved before; a record that cannot be read is unknown, never "never saved".
A verified checkpoint whose load failed
for a reason outside it (an I/O error, memory running out, a peer rank failing:
``manifest.unreadable``) is neither: the tier is unknown (``TierUnknown`` on every rank), and
start-up tries the restore again.

Same step twice: a save that finds a folder of its step already on a tier keeps it when the same
session wrote it (the manifest's ``writer``: same session and step, same state), replaces it
atomically when it holds other state (an abandoned trajectory: the live run is the one a restart
must continue) or is invalid, and never touches a quarantined one (unauthenticated, another
format or layout): that tier then skips this step. A process's own state at a step is also what
the checkpoint it restored from holds: after a restore, copies of that step by its writer are
kept too (a re-run of a finished job writes only the copies that are missing).

Emergency (``emergency_save``, on a preemption notice): it never waits on the network. It drops
the queued uploads and aborts the one in flight, leaving its thread behind; waits only for a disk
writer still running (disk I/O); has the layout write the disk tiers (the whole model: every disk
tier at once from host memory); then uploads to every remote tier from the home tier's copy (else
another disk's, the staging folder, host memory) until the deadline. *Saved* means on a tier that
outlives the VM: a save only the local SSD got serves a restart of the trainer on this VM (systemd,
a reboot) but is lost with the VM (a preemption, a recreation), so it does not count as saved.

Ranks: with the sharded layout every public method but ``due()``, ``describe()`` and
``durable()`` is a collective of the layout's group (every rank calls it, in the same order, with
the same step); rank 0 decides which tiers a save writes and reads the tiers for the others. With
the whole-model layout the group is this process alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import shutil
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from trainer.checkpoint.format import (VERIFY_READS, CheckpointInfo, check_checkpoint, delete_checkpoint, download_dir,
                                       list_checkpoints, read_manifest)
from trainer.checkpoint.interval import DEFAULT_MTBF_S, YoungDalyPolicy, changed_materially
from trainer.checkpoint.key import CheckpointKey
from trainer.checkpoint import run_record
from trainer.checkpoint.layout import Layout, Refs, Staged, Written
from trainer.checkpoint.manifest import (MANIFEST, OTHER_FORMAT, OTHER_LAYOUT, OTHER_RUN, CheckpointInvalid,
                                         CheckpointUnloadable, CheckpointUnreadable, ResumeMismatch, StepOccupied,
                                         layout_mismatch, other_layout, other_run_mismatch, quarantine_mismatch,
                                         quarantined, step_name)
from trainer.checkpoint.stores import UploadAborted, is_unreachable
from trainer.checkpoint.tier_wait import TierUnknown
from trainer.checkpoint.tiers import Tier, Tiers
from trainer.checkpoint.yielding import YieldingWrites


@dataclasses.dataclass
class Restored:
    step: int
    state: Any           # what was saved: the whole state, or (sharded) the replicated rest
    tier: str            # where it was read from
    path: str            # folder/URI, for logs
    seconds: float       # restore wall time
    model: dict | None = None  # a read-only look: the full model state dict (on CPU)


@dataclasses.dataclass(frozen=True)
class SetAside:
    """What a restore set aside to start from scratch beside (``Checkpointer.restore``): checkpoints
    on remote tiers only, unauthenticated or signed for another run, of a run with nothing
    authentic left. ``saved_before``: an authentic run record says the run saved before (its own
    checkpoints are gone: deleted, perhaps restorable from soft delete); False: it provably never
    saved on a tier that is there to ask. A person is needed either way: the event says so."""

    found: tuple[str, ...]   # "tier step N at LOCATION: reason", each
    steps: tuple[int, ...]
    saved_before: bool
    record: str              # what the remote tiers' run records say, in words
    message: str             # the warning, whole


@dataclasses.dataclass
class EmergencyReport:
    """What an emergency save got: ``ok[tier]`` True/False for each tier of the run."""

    step: int
    ok: dict[str, bool]
    seconds: float        # notice -> durable
    detail: str           # one human line: what was saved and what was not
    saved: bool = False   # on a tier that outlives the VM (see the module docstring)
    complete: bool = False  # on every durable tier this run has (a final checkpoint then counts)

    def __getattr__(self, name: str) -> Any:
        # ``report.gcs_ok``: the tier's ``ok``, None where the run has no such tier (the log line's
        # and the ledger's fields).
        if name.endswith("_ok") and not name.startswith("_"):
            return self.__dict__.get("ok", {}).get(name[:-3])
        raise AttributeError(name)

    def fields(self, order: list[str]) -> dict[str, bool | None]:
        """``{tier}_ok`` for each tier in ``order`` (the ledger's and the log line's fields)."""
        return {f"{n}_ok": self.ok.get(n) for n in order}


@dataclasses.dataclass
class Durability:
    """``durable()``'s verdict: each durable tier with ``"ok"`` or why ``step`` is not there."""

    step: int
    tiers: dict[str, str]

    @property
    def ok(self) -> bool:
        return bool(self.tiers) and all(v == "ok" for v in self.tiers.values())

    @property
    def missing(self) -> list[str]:
        return [k for k, v in self.tiers.items() if v != "ok"]

    @property
    def detail(self) -> str:
        return "; ".join(f"{k} {'ok' if v == 'ok' else 'NOT DURABLE: ' + v}" for k, v in self.tiers.items())


@dataclasses.dataclass
class _Schedule:
    """When a tier was last saved to, and its automatic interval."""

    auto: YoungDalyPolicy | None
    last_step: int = 0
    last_time: float | None = None
    logged_interval: float | None = None


@dataclasses.dataclass(eq=False)
class _Source:
    """What an upload reads: a folder (committed on ``pin``'s disk tier, or a staging folder),
    or a staged state in host memory; shared by the uploads of one save (``refs``)."""

    step: int
    folder: Path | None = None
    memory: Staged | None = None
    manifest: bytes | None = None
    pin: str | None = None        # the disk tier whose committed folder this is (kept from retention)
    refs: Refs | None = None


@dataclasses.dataclass(eq=False)
class _Upload:
    """One upload the uploader owes: ``source`` to the remote ``tier``."""

    tier: Tier
    source: _Source
    collective: bool = False      # across nodes: every rank uploads its own files
    abort: threading.Event = dataclasses.field(default_factory=threading.Event)
    deadline: float | None = None
    released: bool = False

    @property
    def step(self) -> int:
        return self.source.step



def _no_quarantine() -> dict[str, list[Any]]:
    # "on_disk": the unauthenticated and other-run ones on a disk tier, which no bucket writer can
    # have put there; "remote_steps": the steps of those on a remote tier.
    return {"format": [], "unauthenticated": [], "other_run": [], "on_disk": [], "remote_steps": []}

class Checkpointer:
    """Asynchronous multi-tier checkpointing of one layout; see the module docstring."""

    #: Listing a tier gives up after this long (a bucket unreachable at start-up must not stall
    #: the restore for the full upload retry budget; the disk tiers are still tried).
    LIST_TIMEOUT_S = 60.0

    def __init__(self, tiers: Tiers, layout: Layout | None = None, *, key: CheckpointKey | None = None,
                 mtbf_s: float = DEFAULT_MTBF_S, log: logging.Logger | None = None) -> None:
        """``key``: sign every manifest and load only checkpoints whose HMAC verifies under it
        (``trainer.checkpoint.key``); None trusts the sha256 alone (nothing is unpickled either
        way, but anyone who can write a tier can then make a checkpoint this run loads).
        ``layout``: default the whole-model layout."""
        if layout is None:
            from trainer.checkpoint.whole_model import WholeModel

            layout = WholeModel()
        if key is None and layout.needs_key is not None:
            from trainer.checkpoint.key import KeyProblem

            raise KeyProblem(layout.needs_key)
        self.log = log or logging.getLogger("spottrain.checkpoint")
        self.tiers, self.layout, self.key = tiers, layout, key
        self.group = layout.group
        #: This checkpointer's saves, in manifests as ``writer``: a save id (see the module docstring).
        self.session = self.group.bcast(uuid.uuid4().hex)
        self._schedule = {t.name: _Schedule(YoungDalyPolicy(mtbf_s=mtbf_s) if t.cadence.automatic else None)
                          for t in tiers}
        #: What the last survey met: the quick-checked copies (rank 0) and the quarantined
        #: checkpoints that are not of the other layout ("format", "unauthenticated", "other_run").
        self._infos: dict[tuple[str, int], CheckpointInfo] = {}
        self._quarantined: dict[str, list[Any]] = _no_quarantine()
        #: What the last restore set aside to start from scratch beside (``SetAside``), or None.
        self.set_aside: SetAside | None = None
        #: Remote tiers this session wrote its run record to (``trainer.checkpoint.run_record``).
        self._recorded: set[str] = set()
        #: Every step the last survey of this process listed on some tier, valid or not (None: no
        #: survey yet): what the rollback guard (``trainer.loop.rollback``) asks.
        self.steps_seen: set[int] | None = None
        self._thread: threading.Thread | None = None  # the disk writer of the newest save
        #: The newest save while its copy may still run beside the loop (``before_update``), and
        #: its tiers (whose interval policies learn what the wait for it cost).
        self._copying: Staged | None = None
        self._copying_tiers: list[Tier] = []
        self._reserver: threading.Thread | None = None
        # The uploader: its thread, the upload it runs, the queue, and a condition over all of it,
        # the pins and tier health.
        self._cv = threading.Condition(threading.RLock())
        self._uploader: threading.Thread | None = None
        self._active: _Upload | None = None
        self._pending: list[_Upload] = []
        self._closing = False
        self.abandoned = 0  # uploads left running on their thread (emergency, deadline)
        self._pins: dict[tuple[str, int], int] = {}  # (tier, step) folders an upload reads
        #: (tier, step) disk folders holding this process's state: it wrote them, or restored from them.
        self._verified: set[tuple[str, int]] = set()
        self._restored: dict[int, str] = {}  # step -> writer of the checkpoint this process restored
        self._failing: dict[str, dict[str, Any]] = {}
        #: Called with (tier, failure record or None when it works again) on each change (rank 0).
        #: Must not raise (errors are logged).
        self.on_tier_health: Callable[[str, dict | None], None] | None = None
        #: Called with (tier, step) once a periodic save is durable on a tier (rank 0); must not block.
        self.on_durable: Callable[[str, int], None] | None = None
        # Retention never deletes while a restore runs: one lock per tier (a remote tier's
        # retention, which may sit in a stalled request, must never hold a disk tier's up), all of
        # them for a restore.
        self._tier_locks = {t.name: threading.Lock() for t in tiers}
        self._restore_lock = _Locks(list(self._tier_locks.values()))
        self._started = time.monotonic()
        self._yielding = YieldingWrites(time.monotonic)
        self.stats: dict[str, Any] = {
            "saves": 0, "tier_writes_ok": 0, "tier_writes_failed": 0, "deferred_steps": 0,
            "waited": 0, "blocked_s_total": 0.0, "last_blocked_s": None, "last_error": None,
            "uploads_superseded": 0, "update_waited_s_total": 0.0, "writes_yielded": 0,
            "writes_lifted": 0,
        }
        if self.group.nodes > 1 and self.group.rank == 0:
            self.log.info("%s checkpoints: %d ranks on %d nodes; each node's disk holds only its own ranks' "
                          "files, so the complete copy is the remote one", layout.name, self.group.size,
                          self.group.nodes)
            if not tiers.remotes:
                self.log.warning("%s checkpoints across %d nodes without a remote tier: no tier will hold a "
                                 "complete checkpoint, so no restore is possible", layout.name, self.group.nodes)

    # ------------------------------------------------------------------------------ properties
    def bind(self, model: Any, optimizer: Any) -> None:
        """The model and optimizer a layout that saves them in place reads and loads (sharded)."""
        self.layout.bind(model, optimizer)

    def _busy(self) -> bool:
        """A disk writer is running (the uploader is not counted: it never holds saves back)."""
        return self._thread is not None and self._thread.is_alive()

    def _join_writer(self) -> None:
        """Wait for the disk writer, lifted to this thread's priority first: whoever waits for a
        write must not wait for a starved one."""
        self._lift_writer()
        self._thread.join()  # type: ignore[union-attr]

    def _lift_writer(self) -> None:
        self._yielding.release()
        self.stats["writes_lifted"] = self._yielding.lifted

    def uploading(self) -> bool:
        """An upload is running or queued."""
        with self._cv:
            return self._active is not None or bool(self._pending)

    def _parse(self, data: bytes, step: int | None = None, *, key: Any = None) -> dict:
        return self.layout.parse_manifest(data, step, key=key)

    # ------------------------------------------------------------------------------ scheduling
    def interval_s(self, tier: str) -> float | None:
        """The automatic interval currently in force for ``tier`` (None for fixed cadences)."""
        auto = self._schedule[tier].auto
        return auto.decide().seconds if auto else None

    def _tier_due(self, t: Tier, step: int, now: float) -> bool:
        s = self._schedule[t.name]
        base = s.last_time if s.last_time is not None else self._started
        if s.auto is not None:
            d = s.auto.decide()
            if changed_materially(s.logged_interval, d.seconds):
                self.log.info("checkpoint interval for %s: %.0fs (%s)", t.name, d.seconds, d.reason)
                s.logged_interval = d.seconds
            return now - base >= d.seconds
        c = t.cadence
        if c.every_steps is not None and step >= (s.last_step // c.every_steps + 1) * c.every_steps:
            return True
        return c.every_seconds is not None and now - base >= c.every_seconds

    def _due_tiers(self, step: int) -> list[Tier]:
        now = time.monotonic()
        return [t for t in self.tiers if self._tier_due(t, step, now)]

    def due(self, step: int) -> bool:
        """Whether to call ``save(step, ...)`` now; cheap, call it every step (rank 0 decides).

        False while a disk write is in flight, or while the layout has no host memory free for
        another save (the due tier stays due and is saved once that is over).
        """
        due = self._due_tiers(step)
        if self._busy():
            self._yielding.check(next_due=bool(due))
            self.stats["writes_lifted"] = self._yielding.lifted
        if not due:
            return False
        if self._busy() or not self.layout.can_stage(self._droppable()):
            self.stats["deferred_steps"] += 1
            return False
        return True

    def _saved(self, tiers: list[Tier], step: int) -> None:
        now = time.monotonic()
        for t in tiers:
            self._schedule[t.name].last_step, self._schedule[t.name].last_time = step, now

    def mark_restored(self, step: int) -> None:
        """Another node restored ``step`` for the job: count the tiers' intervals from there."""
        self._saved(list(self.tiers), step)

    # ------------------------------------------------------------------------------ saving
    def save(self, step: int, state: Any = None, *, meta: dict | None = None, every_tier: bool = False) -> float:
        """Stage ``state`` and write it in the background; returns the seconds the caller was
        blocked. Saves to the tiers that are due, or to every tier when none is (explicit save)
        or when ``every_tier`` (the final checkpoint, a pause). ``state``: the whole state (whole
        model), or rank 0's replicated rest beside the bound model's shards (sharded; the other
        ranks may pass None)."""
        t0 = time.perf_counter()
        meta = _check_meta(meta)
        if self._busy():
            self.stats["waited"] += 1
            self._join_writer()  # its copy too: the buffer is free again
        tiers = self._plan(step, every_tier)
        t_stage = time.perf_counter()
        staged = self.layout.stage(step, state, meta, make_room=self._drop_memory_upload)
        # The cost C for the interval policy excludes a one-off buffer allocation; what the next
        # optimizer step waits for the copy is added then (``before_update``).
        stage_s = time.perf_counter() - t_stage - staged.alloc_s
        self._copying, self._copying_tiers = staged, tiers
        self._saved(tiers, step)
        for t in tiers:
            auto = self._schedule[t.name].auto
            if auto is not None:
                auto.observe(blocked_s=stage_s)
        self.stats["saves"] += 1
        # Only one process's write yields: the ranks of a sharded save write together, and only
        # rank 0 runs the checks that would lift them.
        self._yielding.started(yielding=not every_tier and self.group.size == 1)
        self.stats["writes_yielded"] = self._yielding.yielded
        self._thread = threading.Thread(target=self._persist, args=(staged, tiers),
                                        name=f"checkpoint-{step}", daemon=True)
        self._thread.start()
        blocked = time.perf_counter() - t0
        self.stats["blocked_s_total"] += blocked
        self.stats["last_blocked_s"] = blocked
        return blocked

    def before_update(self, timeout: float | None = None) -> bool:
        """The loop is about to write the weights or the optimizer state (the optimizer step):
        wait until the newest save's copy of them into host memory is done (under CUDA the
        device's current stream waits for it, not the host). The loop calls this before every
        optimizer step; it returns at once when no copy is in flight. True once they may be
        written; False when ``timeout`` passed first (then the copy is still running)."""
        staged = self._copying
        if staged is None:
            return True
        t0 = time.perf_counter()
        if not staged.before_update(timeout):
            return False
        waited = time.perf_counter() - t0
        self._copying = None
        self.stats["update_waited_s_total"] += waited
        for t in self._copying_tiers:  # the save cost the loop this much more (the interval's C)
            auto = self._schedule[t.name].auto
            if auto is not None:
                auto.blocked_longer(waited)
        return True

    def _plan(self, step: int, every_tier: bool) -> list[Tier]:
        """The tiers a save writes (rank 0 decides for every rank), in table order."""
        names: list[str] | None = None
        if self.group.rank == 0:
            tiers = list(self.tiers) if every_tier else (self._due_tiers(step) or list(self.tiers))
            if self.group.nodes > 1 and self.uploading() and not every_tier:
                tiers = [t for t in tiers if not t.remote]  # uploads across nodes queue in order: remote stays due
            if any(t.remote for t in tiers) and not any(not t.remote for t in tiers):
                tiers.append(self.tiers.home)  # an upload reads a disk copy (host memory is freed)
            names = [t.name for t in self.tiers if t in tiers]
        return [self.tiers[n] for n in self.group.bcast(names)]

    def _persist(self, staged: Staged, tiers: list[Tier]) -> None:
        """The disk writer: the due disk tiers, then hand the uploads over; never raises, never
        touches the network."""
        try:
            try:
                staged.copied()  # the first thing: a save after this thread ended reuses the buffer
            except Exception as e:  # noqa: BLE001 - every tier of this save failed
                for t in tiers:
                    self._failed(t.name, staged.step, e)
                return
            try:
                written = self._yielding.run(lambda: self._write(staged, tiers, emergency=False))
            finally:
                self._yielding.finished()
            if self.group.rank == 0:
                for line in written.detail:
                    self.log.warning("checkpoint step %d: %s", staged.step, line)
            remotes = [t for t in tiers if t.remote]
            source = self._source(staged, written, remotes) if remotes and self._uploads_here(written) else None
            if source is not None:
                for t in remotes:
                    self._enqueue(_Upload(t, source, collective=written.collective), hold=True)
                source.refs.release()  # type: ignore[union-attr]
            else:
                self._discard(written)
                if remotes and self.group.rank == 0:
                    for t in remotes:
                        self._failed(t.name, staged.step, RuntimeError(written.failure or "nothing to upload from"))
        except BaseException as e:  # noqa: BLE001 - a background thread must not die silently
            self._failed("?", staged.step, e)

    def _write(self, staged: Staged, tiers: list[Tier], *, emergency: bool) -> Written:
        """Have the layout write the disk tiers of ``tiers`` (a collective): a periodic save
        records each tier's success (retention, the ledger), an emergency save only its health."""
        disks = [t for t in tiers if not t.remote]
        plan = {t.name: self._same_step(t, staged.step) for t in disks} if self.group.is_leader else {}

        def on_tier(t: Tier, error: BaseException | None, seconds: float, folder: Path | None) -> None:
            if error is None:
                self._verified.add((t.name, staged.step))
                if emergency:
                    self._saved([t], staged.step)
                    self._note(t.name, None)
                else:
                    self._succeeded(t, staged.step, seconds)
            elif self.group.nodes > 1:
                self.log.info("checkpoint step %d: no complete copy on %s (%d nodes, each disk holds its own "
                              "files)", staged.step, t.name, self.group.nodes)
            elif emergency:
                self._note(t.name, f"{type(error).__name__}: {error}"[:300])
            else:
                self._failed(t.name, staged.step, error)

        return self.layout.write(staged, disks, plan, for_upload=any(t.remote for t in tiers), parallel=emergency,
                                 on_tier=on_tier, key=self.key, writer=self.session)

    def _uploads_here(self, written: Written) -> bool:
        """This rank uploads the save: every rank across nodes (each its own files), else rank 0."""
        return written.collective or self.group.rank == 0

    def _discard(self, written: Written) -> None:
        """Nothing uploads what ``written`` left for an upload: give it back."""
        if written.staging is not None and self.group.is_leader:
            shutil.rmtree(written.staging, ignore_errors=True)
        if written.memory is not None:
            written.memory.release()

    def _source(self, staged: Staged, written: Written, remotes: list[Tier]) -> _Source | None:
        """What the uploads of a save read: this node's committed copy (the home tier's first),
        else the staging folder, else host memory. The caller holds one reference (``refs``)."""
        step = staged.step
        committed = sorted(written.folders, key=lambda n: n != self.tiers.roles.home)
        if committed and not written.collective:
            tier = committed[0]
            self._pin(tier, step)
            return _Source(step, folder=written.folders[tier], pin=tier, refs=Refs(lambda: self._unpin(tier, step)))
        if written.staging is not None:
            stage, leader = written.staging, self.group.is_leader
            return _Source(step, folder=stage, manifest=written.manifest,
                           refs=Refs(lambda: shutil.rmtree(stage, ignore_errors=True) if leader else None))
        if written.memory is not None:
            self.log.warning("checkpoint step %d: no disk tier took it; uploading it to %s from host memory", step,
                             ", ".join(t.name for t in remotes))
            memory = written.memory
            return _Source(step, memory=memory, refs=Refs(memory.release))
        return None

    def _succeeded(self, t: Tier, step: int, write_s: float) -> None:
        self.stats["tier_writes_ok"] += 1
        auto = self._schedule[t.name].auto
        if auto is not None:
            auto.observe(write_s=write_s)
        self.log.info("checkpoint step %d durable on %s in %.2fs", step, t.name, write_s)
        self._note(t.name, None)
        if self.on_durable is not None:
            with contextlib.suppress(Exception):
                self.on_durable(t.name, step)
        try:
            self._retain(t, step)
        except Exception as e:  # noqa: BLE001
            self.log.warning("retention on %s failed (nothing lost): %s: %s", t.name, type(e).__name__, e)

    def _failed(self, tier: str, step: int, e: BaseException) -> None:
        self.stats["tier_writes_failed"] += 1
        self.stats["last_error"] = f"{tier} step {step}: {type(e).__name__}: {e}"
        self.log.error("checkpoint step %d on %s failed (training continues; nothing partial is "
                       "visible): %s: %s", step, tier, type(e).__name__, e)
        if tier in self.tiers:
            self._note(tier, f"{type(e).__name__}: {e}"[:300])

    def _note(self, tier: str, error: str | None) -> None:
        """Track whether ``tier`` keeps failing (``error`` None: it just worked)."""
        with self._cv:
            rec = self._failing.get(tier)
            if error is None:
                if rec is None:
                    return
                del self._failing[tier]
                changed: dict | None = None
                self.log.info("checkpoint tier %s works again (after %d failed write(s))", tier, rec["failures"])
            else:
                rec = self._failing.setdefault(tier, {"since": time.time(), "failures": 0})
                rec["failures"] += 1
                rec["error"] = " ".join(error.split())  # one line: it goes into the health answer
                changed = dict(rec)
        if self.on_tier_health is not None:
            try:
                self.on_tier_health(tier, changed)
            except Exception as e:  # noqa: BLE001 - reporting must never break a save
                self.log.warning("reporting the health of tier %s failed: %s", tier, e)

    def failing(self) -> dict[str, dict[str, Any]]:
        """Tiers whose latest writes failed: tier -> {since (unix time), failures, error}."""
        with self._cv:
            return {k: dict(v) for k, v in self._failing.items()}

    def _same_state(self, step: int, writer: str | None = None) -> set[str]:
        """The writers whose copy of ``step`` holds the state this process saves for it: this
        session, the one whose checkpoint of that step it restored, and ``writer``."""
        return {w for w in (self.session, self._restored.get(step), writer) if w}

    def _same_step(self, t: Tier, step: int) -> str:
        """The plan for a disk tier that may hold a folder of this step already (a save right after
        another of the same step, e.g. an emergency save of a step just saved, the final save of a
        re-run): ``write`` (none there), ``keep`` (this state, see ``_same_state``), ``replace``
        (other state, or invalid) or ``occupied: why`` (quarantined: never overwritten)."""
        folder = t.store.folder(step_name(step))
        if folder is None or not folder.exists():
            return "write"
        if (t.name, step) in self._verified:
            return "keep"
        try:
            m = self.layout.verify(folder, key=self.key)
        except CheckpointInvalid as e:
            if quarantined(str(e)):
                return (f"occupied: {folder} holds a checkpoint that is never overwritten ({e}); this tier "
                        f"skips step {step}")
            self.log.warning("replacing invalid %s (%s)", folder, e)
            return "replace"
        if m.get("writer") in self._same_state(step):
            return "keep"
        self.log.warning("%s step %d at %s verifies but holds other state (written by session %s, not this "
                         "one: an abandoned trajectory); replacing it atomically with this run's step %d",
                         t.name, step, folder, m.get("writer", "unknown"), step)
        return "replace"

    # ------------------------------------------------------------------------------ uploading
    def _pin(self, tier: str, step: int) -> None:
        with self._cv:
            self._pins[(tier, step)] = self._pins.get((tier, step), 0) + 1

    def _unpin(self, tier: str, step: int) -> None:
        with self._cv:
            self._pins[(tier, step)] -= 1
            if not self._pins[(tier, step)]:
                del self._pins[(tier, step)]
            self._cv.notify_all()

    def _pinned(self, tier: str) -> set[int]:
        with self._cv:
            return {s for (t, s) in self._pins if t == tier}

    def _droppable(self) -> bool:
        """A queued upload reads host memory that a newer save could take instead."""
        with self._cv:
            return any(j.source.memory is not None for j in self._pending)

    def _drop_memory_upload(self) -> bool:
        """Drop one queued upload from host memory (its buffer is needed by a newer save)."""
        with self._cv:
            job = next((j for j in self._pending if j.source.memory is not None), None)
            if job is None:
                return False
            self._pending.remove(job)
        self._superseded(job, "its host memory is needed by a newer save")
        return True

    def _enqueue(self, job: _Upload, *, hold: bool = False) -> None:
        """Queue ``job`` for the uploader: it replaces a queued one to the same tier (in order when
        collective). ``hold``: take a reference on its source first."""
        if hold:
            job.source.refs.hold()  # type: ignore[union-attr]
        with self._cv:
            if self._closing:
                dropped = [job]
            else:
                dropped = [] if job.collective else [j for j in self._pending if j.tier is job.tier]
                self._pending = [j for j in self._pending if j not in dropped] + [job]
                if self._uploader is None:
                    self._uploader = threading.Thread(target=self._upload_loop, name="checkpoint-uploader",
                                                      daemon=True)
                    self._uploader.start()
                self._cv.notify_all()
        for old in dropped:
            self._superseded(old, "the checkpointer is closing" if old is job else f"step {job.step} is newer")

    def _superseded(self, job: _Upload, why: str) -> None:
        self.stats["uploads_superseded"] += 1
        self.log.info("upload of step %d to %s dropped: %s", job.step, job.tier.name, why)
        self._release(job)

    def _release(self, job: _Upload) -> None:
        """The upload ``job`` ended (or never started): give its source back."""
        if job.released or job.source.refs is None:
            return
        job.released = True
        try:
            job.source.refs.release()
        except Exception as e:  # noqa: BLE001 - a leftover staging folder is removed at restore
            self.log.warning("cleaning up after the upload of step %d failed: %s", job.step, e)
        with self._cv:
            self._cv.notify_all()

    def _upload_loop(self) -> None:
        me = threading.current_thread()
        while True:
            with self._cv:
                while not self._pending and self._uploader is me:
                    self._cv.wait()
                if self._uploader is not me:
                    return  # replaced: this thread's upload was abandoned
                job = self._active = self._pending.pop(0)
            try:
                t0 = time.monotonic()
                with job.tier.store.aborting(job.abort):  # retention too: an abandoned upload stops at its next request
                    try:
                        self._upload(job, lane="upload")
                    except Exception as e:  # noqa: BLE001
                        if self.group.rank == 0:
                            self._failed(job.tier.name, job.step, e)
                    else:
                        if self.group.rank == 0:
                            self._succeeded(job.tier, job.step, time.monotonic() - t0)
            except BaseException as e:  # noqa: BLE001 - this thread must not die silently
                self._failed(job.tier.name, job.step, e)
            finally:
                with self._cv:
                    if self._active is job:
                        self._active = None
                self._release(job)

    def _upload(self, job: _Upload, *, lane: str) -> None:
        """Every checkpoint upload goes through here (the writer lease guards the store). Rank 0
        looks at what the tier holds at this step first; then every rank that holds files of it
        uploads its own (one rank alone unless ``job.collective``), and rank 0 uploads the manifest
        last, once every part is there (before the deadline), so nothing partial is ever valid.
        Raises when the upload did not complete."""
        g, store, step, src = self.group, job.tier.store, job.step, job.source

        def agree(obj: Any) -> Any:
            return g.bcast(obj, lane=lane) if job.collective else obj

        decision: Any = None
        if g.rank == 0:
            try:
                with store.deadline(job.deadline), store.aborting(job.abort):
                    decision = self._remote_plan(job)
            except Exception as e:  # noqa: BLE001 - said on every rank below
                decision = e if not job.collective else f"{type(e).__name__}: {e}"
        decision = agree(decision)
        if decision == "skip":
            return
        if decision != "upload":
            raise decision if isinstance(decision, BaseException) else RuntimeError(decision)
        manifest = src.manifest
        if manifest is None:
            manifest = (self.layout.memory_manifest(src.memory, key=self.key, writer=self.session)
                        if src.memory is not None else (src.folder / MANIFEST).read_bytes())  # type: ignore[operator]
        names = self.layout.uploads(sorted(self._parse(manifest)["files"]), collective=job.collective)
        prefix = step_name(step)

        def upload_mine() -> None:
            with store.deadline(job.deadline), store.aborting(job.abort):
                for name in names:
                    if src.memory is not None:
                        store.put_memory(f"{prefix}/{name}", self.layout.memory_file(src.memory, name))
                    else:
                        store.put_file(src.folder / name, f"{prefix}/{name}")  # type: ignore[operator]

        error: BaseException | None = None
        try:
            upload_mine()
        except Exception as e:  # noqa: BLE001 - travels to rank 0
            error = e
        errors = g.all(None if error is None else f"{type(error).__name__}: {error}", lane=lane) \
            if job.collective else [error]
        result: Any = None
        if g.rank == 0:
            bad = [(r, e) for r, e in enumerate(errors) if e is not None]
            if bad:
                result = bad[0][1] if not job.collective else RuntimeError(
                    "; ".join(f"rank {r}: {e}" for r, e in bad) + " (no manifest uploaded: nothing partial is visible)")
            else:
                try:
                    with store.deadline(job.deadline), store.aborting(job.abort):
                        if job.deadline is not None and time.monotonic() > job.deadline:
                            raise UploadAborted("deadline passed before the manifest upload")
                        self._record(job.tier, step)
                        store.put_bytes(f"{prefix}/{MANIFEST}", manifest)
                except Exception as e:  # noqa: BLE001
                    result = e
            if job.collective and result is not None:
                result = f"{type(result).__name__}: {result}" if not isinstance(result, RuntimeError) else str(result)
        result = agree(result)
        if result is not None:
            raise result if isinstance(result, BaseException) else RuntimeError(result)

    def _record(self, t: Tier, step: int) -> None:
        """Rank 0, before the manifest of this session's first checkpoint on the remote tier ``t``:
        the run's signed record that it saved there (``trainer.checkpoint.run_record``), so that no
        visible checkpoint of the run is ever without one. Rewritten once a session: a record a
        bucket writer replaced or deleted is back with the next save. A failure fails the upload."""
        if self.key is None or self.key.run is None or t.name in self._recorded:
            return
        t.store.put_bytes(run_record.RECORD_KEY, run_record.build(self.key, step=step, writer=self.session),
                          overwrite=True)
        self._recorded.add(t.name)

    def _remote_plan(self, job: _Upload) -> str:
        """What to do with the copy of ``job.step`` the remote tier may hold already: ``skip`` (this
        very state), ``upload`` (after removing a partial upload or other state); raises
        ``StepOccupied`` for a quarantined one."""
        store, step, src = job.tier.store, job.step, job.source
        info = check_checkpoint(store, step, self._parse, key=self.key)
        if info is None:
            return "upload"
        mine = None
        if src.manifest is not None:
            mine = json.loads(src.manifest).get("writer")
        elif src.folder is not None:
            mine = read_manifest(src.folder, self._parse, key=self.key).get("writer")
        if info.valid and (info.manifest or {}).get("writer") in self._same_state(step, mine):
            return "skip"
        if quarantined(info.reason):
            raise StepOccupied(f"{job.tier.name} holds a checkpoint at step {step} that is never overwritten "
                               f"({info.reason}); this tier skips step {step}")
        if info.valid:
            self.log.warning("%s step %d verifies but holds other state (written by session %s, not this one); "
                             "replacing it with this run's", job.tier.name, step,
                             (info.manifest or {}).get("writer", "unknown"))
        else:
            # A leftover partial upload of this step: its objects are create-only, so remove them
            # first; they were never visible as a checkpoint.
            self.log.info("removing partial upload of step %d on %s (%s)", step, job.tier.name, info.reason)
        delete_checkpoint(store, step)
        return "upload"

    def _stop_uploads(self, why: str) -> None:
        """Drop the queued uploads and abort the one in flight, without waiting for it: its thread
        is left to end by itself (at its next request, or when a request times out)."""
        with self._cv:
            dropped, self._pending = self._pending, []
            job = self._active
            if job is not None:
                job.abort.set()
                self._active = None
                self._uploader = None  # a later upload gets a fresh thread
                self.abandoned += 1
                self.log.warning("upload of step %d to %s abandoned: %s", job.step, job.tier.name, why)
            self._cv.notify_all()
        for old in dropped:
            self._superseded(old, why)

    # ------------------------------------------------------------------------------ durability
    def durable(self, step: int, *, deadline: float) -> Durability:
        """Wait for the saves in flight (at most until ``deadline``, time.monotonic), then read
        ``step`` back from every tier it must be on (see the module docstring; rank 0 reads, the
        others get an empty verdict: the caller takes rank 0's). An upload still running at the
        deadline is aborted: it does not count. Not a collective."""
        if not self.wait(timeout=max(0.0, deadline - time.monotonic())):
            self._stop_uploads(f"step {step} was due durable by the deadline")
        if self.group.rank != 0:
            return Durability(step, {})
        complete = self.tiers.complete(self.group.nodes)
        if not complete:
            return Durability(step, {"remote": "not configured: no tier of this run can hold a complete copy"})
        return Durability(step, {t.name: self._check(t, step, deadline) for t in complete})

    def _check(self, t: Tier, step: int, deadline: float) -> str:
        try:
            # After the deadline the check still gets a short while of its own.
            with t.store.deadline(max(deadline, time.monotonic() + 10.0)):
                # With the key, as a restore reads it: a manifest someone without the key planted
                # at this step is never this run's checkpoint, however well-formed.
                info = check_checkpoint(t.store, step, self._parse, key=self.key)
        except Exception as e:  # noqa: BLE001 - the tier cannot be read: not durable as far as we know
            return f"cannot check it ({type(e).__name__}: {str(e)[:200]})"
        if info is None:
            return f"step {step} is not there"
        return "ok" if info.valid else info.reason

    # ------------------------------------------------------------------------------ retention
    def _retain(self, t: Tier, newest_step: int) -> None:
        """Keep the checkpoint just written plus the newest ``keep - 1`` valid older ones.

        Only checkpoints older than the one just written (and verified while writing) are ever
        deleted. Newer folders are left alone: they may be valid checkpoints a restore skipped
        because of a transient error, or corrupt ones that look valid to the quick check (which
        must not make us delete the good checkpoint we just wrote). A folder an upload is reading
        is kept until that upload ended. Across nodes the disks hold no committed checkpoints
        to prune.
        """
        if not t.remote and self.group.nodes > 1:
            return
        with self._tier_locks[t.name]:
            older = [i for i in list_checkpoints(t.store, self._parse, key=self.key) if i.step < newest_step]
            keep_older = {i.step for i in [x for x in older if x.valid][: t.keep - 1]}
            pinned = self._pinned(t.name)
            for i in older:
                # Quarantined ones are never deleted: an unauthenticated checkpoint may be this run's
                # own work under a lost or rotated key, and garbage in the bucket must never cost a
                # good checkpoint (retention counts only valid ones). Nor is a folder an upload reads.
                if i.step in keep_older or i.step in pinned or quarantined(i.reason):
                    continue
                self.log.info("retention: deleting %s step %d (%s)", t.name, i.step,
                              f"beyond the newest {t.keep} valid" if i.valid else f"invalid: {i.reason}")
                delete_checkpoint(t.store, i.step)
                self._verified.discard((t.name, i.step))

    # ------------------------------------------------------------------------------ restoring
    def newest_valid_step(self, excluding: set[int] = frozenset()) -> int | None:  # type: ignore[assignment]
        """The newest step that passes the quick check (manifest, sizes) on any tier, or None;
        ``excluding``: steps whose every copy here already failed full verification.

        Cheap (listings only): in a multi-node job every node leader answers it, so that the node
        whose disk holds the newest checkpoint restores for everyone. Raises ``TierUnknown``
        when a tier cannot be listed.
        """
        candidates, _ = self._survey()
        return next((s for s, _ in candidates if s not in excluding), None)

    def _list(self, t: Tier) -> list[CheckpointInfo]:
        with t.store.deadline(time.monotonic() + self.LIST_TIMEOUT_S):
            return list_checkpoints(t.store, self._parse, key=self.key)

    def _survey(self, *, tolerate_unknown: bool = False) -> tuple[list[tuple[int, str]], list[str]]:
        """Every tier listed for a restore: the valid copies as (step, tier), newest first and
        fastest tier first for equal steps, and a line per checkpoint of the other layout.
        Invalid ones are logged with the reason. A tier that cannot be listed raises
        ``TierUnknown`` (after every tier was tried), or with ``tolerate_unknown`` (a read-only
        look) is logged and skipped."""
        candidates: list[tuple[int, int, str]] = []
        other: list[str] = []
        unknown: dict[str, str] = {}
        self._infos = {}
        self._quarantined = _no_quarantine()
        seen: set[int] = set()
        for rank, t in enumerate(self.tiers):
            try:
                infos = self._list(t)
            except Exception as e:  # noqa: BLE001 - a tier being down: unknown, never empty
                self.log.warning("cannot list checkpoints on %s (%s: %s); what it holds is unknown",
                                 t.name, type(e).__name__, e)
                unknown[t.name] = f"{type(e).__name__}: {e}"
                continue
            for i in infos:
                seen.add(i.step)
                if i.valid:
                    candidates.append((i.step, rank, t.name))
                    self._infos[(t.name, i.step)] = i
                elif other_layout(i.reason):
                    other.append(f"{t.name} step {i.step}: {i.reason[len(OTHER_LAYOUT):]}")
                elif quarantined(i.reason):
                    what = ("format" if i.reason.startswith(OTHER_FORMAT) else
                            "other_run" if i.reason.startswith(OTHER_RUN) else "unauthenticated")
                    line = f"{t.name} step {i.step} at {i.location}: {i.reason}"
                    self._quarantined[what].append(line)
                    if what != "format":
                        if t.remote:
                            self._quarantined["remote_steps"].append(i.step)
                        else:
                            self._quarantined["on_disk"].append(line)
                    self.log.warning("refusing %s checkpoint step %d at %s: %s", t.name, i.step, i.location, i.reason)
                else:
                    self.log.warning("ignoring %s checkpoint step %d at %s: %s",
                                     t.name, i.step, i.location, i.reason)
        if unknown and not tolerate_unknown:
            raise TierUnknown(unknown)
        self.steps_seen = seen
        candidates.sort(key=lambda c: (-c[0], c[1]))
        return [(s, n) for s, _, n in candidates], other

    def restore(self, *, download: bool = True, step: int | None = None) -> Restored | None:
        """Load the newest checkpoint that verifies across all tiers (see the module docstring),
        or the one of ``step``. A trainer restores with ``download`` (a remote copy is placed in
        the home tier; every rank gets the state, a sharded layout loads the bound model in place);
        ``download=False`` is a read-only look of one process (``status``, ``export``): it changes
        nothing on any tier and gives the full model state dict."""
        t_start = time.monotonic()
        g = self.group
        self.wait()  # outside the lock: the background thread takes it for retention
        with self._restore_lock:
            if download and g.is_leader:
                for t in self.tiers:
                    removed = t.store.clean_temporaries()
                    if removed:
                        self.log.info("removed leftovers of interrupted writes on %s: %s", t.name, ", ".join(removed))
            survey: Any = None
            if g.rank == 0:
                try:
                    survey = self._survey(tolerate_unknown=not download)
                except TierUnknown as e:  # every rank raises it together, below
                    survey = e.tiers
            survey, self._quarantined = g.bcast((survey, self._quarantined))
            if isinstance(survey, dict):
                raise TierUnknown(survey)
            candidates, other = survey
            if other and download:  # a trainer starting; a read-only look only looks
                raise ResumeMismatch(layout_mismatch(self.layout.parallelism, other))
            if self._quarantined["format"] and download:
                raise ResumeMismatch(quarantine_mismatch(self._quarantined["format"], None))
            for found in sorted({s for s, _ in candidates}, reverse=True):
                if step is not None and found != step:
                    continue
                restored = self._restore_step(found, [n for s, n in candidates if s == found], download, t_start)
                if restored is not None:
                    return restored
            if step is not None:
                return None  # that step only (a node of a multi-node restore asked): not usable here
            self.set_aside = None
            if (self._quarantined["unauthenticated"] or self._quarantined["other_run"]) and download:
                # Nothing authentic left, but checkpoints nobody can vouch for as this run's: rank 0
                # decides (it read the tiers) and every rank follows.
                verdict = g.bcast(self._beside_held() if g.rank == 0 else None)
                if isinstance(verdict, dict):
                    raise TierUnknown(verdict)
                if isinstance(verdict, str):
                    raise ResumeMismatch(verdict)
                self.set_aside = verdict
                if g.rank == 0:
                    self.log.warning("%s", verdict.message)
                    if self.steps_seen is not None:
                        # Not the run's checkpoints: the rollback guard must not count them as its
                        # steps still being there (a forgery at a step the ledger recorded durable).
                        self.steps_seen -= set(verdict.steps)
                return None
            if g.rank == 0:
                self.log.info("no valid checkpoint on any tier; starting from scratch")
            return None

    def held_on_disks(self) -> str | None:
        """After a survey: the refusal for unauthenticated or other-run checkpoints on this process's
        disk tiers, or None. A multi-node restore asks every node leader (each surveys its own
        disks), so that no node starts from scratch while another's disk holds such a one."""
        return self._held_mismatch() if self._quarantined["on_disk"] else None

    def _held_mismatch(self) -> str:
        q = self._quarantined
        if q["unauthenticated"]:
            # Never a fresh start over them: they may be this run's work under a lost key.
            return quarantine_mismatch(q["unauthenticated"], self.key)
        # Nor over another run's: they may be this run's own, moved here from elsewhere.
        return other_run_mismatch(q["other_run"], self.key and self.key.run)

    def _beside_held(self) -> SetAside | str | dict[str, str]:
        """Rank 0, nothing authentic left to resume: whether to start from scratch beside the
        unauthenticated or other-run checkpoints the survey met (a ``SetAside``), refuse (the
        message: exit 2), or wait (tier -> error: a run record could not be read).

        On a disk tier they are the run's own or root's (no bucket writer can write a disk): its
        work under a lost key, or moved here; refuse, as always. On the remote tiers only, anyone
        who can write the bucket may have put them there, and refusing would let them stop the run
        for good: set them aside (never loaded, deleted or overwritten) and start from scratch,
        saying whether the run's own signed record shows it saved before. A tier whose record
        cannot be read is unknown, never "never saved"."""
        q = self._quarantined
        if q["on_disk"]:
            return self._held_mismatch()
        saved, said, unknown = False, [], {}
        for t in self.tiers:
            if not t.remote:
                continue
            if self.key is None or self.key.run is None:
                said.append(f"{t.name}: no run record (this run's key is bound to no run)")
                continue
            try:
                with t.store.deadline(time.monotonic() + self.LIST_TIMEOUT_S):
                    ok, what = run_record.read(t.store, self.key)
            except Exception as e:  # noqa: BLE001 - unknown, not empty
                self.log.warning("cannot read the run record on %s (%s: %s); what it holds is unknown",
                                 t.name, type(e).__name__, e)
                unknown[t.name] = f"run record: {type(e).__name__}: {e}"
                continue
            saved = saved or ok
            said.append(what)
        if unknown:
            return unknown
        found = tuple(q["unauthenticated"] + q["other_run"])
        listed = "; ".join(found[:5]) + (f"; and {len(found) - 5} more" if len(found) > 5 else "")
        record = "; ".join(said)
        if saved:
            why = (f"this run saved before ({record}), but no checkpoint of it is left on any tier: they were deleted "
                   "(a bucket's soft delete may still hold them: to resume from them, stop the run, restore them and "
                   "remove what it wrote since if that is newer)")
        else:
            why = f"this run never saved a checkpoint ({record})"
        # Not an event=... line: the session emits the event (one entry for the alert to count).
        message = (f"setting aside checkpoints (saved_before={int(saved)}): {why}; starting from scratch beside "
                   f"checkpoints nobody can vouch for as this run's ({listed}). They are never loaded, deleted or "
                   "overwritten (a save at their step skips that tier). Someone who can write the bucket put them "
                   "there without the key, or they are this run's own under a lost key or from another place: "
                   "look at them, and remove them. See docs/security.md")
        return SetAside(found=found, steps=tuple(sorted(set(q["remote_steps"]))), saved_before=saved,
                        record=record, message=message)

    def _restore_step(self, step: int, valid_on: list[str], download: bool, t_start: float) -> Restored | None:
        """Load a copy of ``step`` (every node leader finds or downloads its own), trying the next
        copy when one does not verify; None when no copy of it is usable."""
        g = self.group
        tried: set[str] = set()
        while True:
            got = self._obtain(step, valid_on, tried, download) if g.is_leader else None
            copies = g.all(got)
            unreachable = {f"{c[2]}" + (f" (node of rank {r})" if g.nodes > 1 else ""): c[1]
                           for r, c in enumerate(copies) if c is not None and c[0] == "unreachable"}
            if unreachable:
                raise TierUnknown(unreachable)
            bad = [(r, c[1]) for r, c in enumerate(copies) if g.leader_of[r] == r and c[0] != "ok"]
            if bad:
                if g.rank == 0:
                    why = "; ".join(f"node of rank {r}: {w}" if g.nodes > 1 else w for r, w in bad)
                    self.log.warning("checkpoint step %d is unusable: %s; falling back to the next older one",
                                     step, why)
                return None
            _, folder, tier, location, tmp, placed = copies[g.leader_of[g.rank]]
            try:
                outcome = self._load(Path(folder), download)
            finally:
                if tmp is not None and g.is_leader:
                    shutil.rmtree(tmp, ignore_errors=True)
            outcomes = g.all(outcome if outcome[0] != "ok" else ("ok", None))
            unloadable = [(r, o[1]) for r, o in enumerate(outcomes) if o[0] == "unloadable"]
            if unloadable:
                why = unloadable[0][1] if g.size == 1 else "; ".join(f"rank {r}: {w}" for r, w in unloadable)
                raise ResumeMismatch(f"cannot resume from step {step} on {tier} ({location}): {why}"[:3000])
            unread = [(r, o[1]) for r, o in enumerate(outcomes) if o[0] == "unreadable"]
            if unread:  # every rank raises it together: start-up tries the restore again, then exits 69
                why = unread[0][1] if g.size == 1 else "; ".join(f"rank {r}: {w}" for r, w in unread)
                raise TierUnknown({tier: f"step {step} ({location}): {why}"[:3000]})
            invalid = [(r, o[1]) for r, o in enumerate(outcomes) if o[0] == "invalid"]
            if invalid:
                if g.rank == 0:
                    self.log.warning("checkpoint step %d on %s at %s is unusable: %s; falling back to the next "
                                     "older one", step, tier, location, "; ".join(w for _, w in invalid))
                tried.add(tier)
                continue
            state, model = outcome[1]
            if download:  # a trainer starting (a read-only look changes nothing)
                self._reserve_in_background(state)
                if placed is not None:  # verified while loading: this process's state now
                    self._verified.add((placed, step))
                with contextlib.suppress(Exception):  # its copies hold this process's state
                    writer = read_manifest(Path(folder), self._parse, key=self.key).get("writer")
                    if writer:
                        self._restored[step] = writer
                self._saved(list(self.tiers), step)
            seconds = time.monotonic() - t_start
            if g.rank == 0:
                self.log.info("restored step %d from %s (%s) in %.2fs", step, tier, location, seconds)
            return Restored(step=step, state=state, tier=tier, path=location, seconds=seconds, model=model)

    def _obtain(self, step: int, valid_on: list[str], tried: set[str],
                download: bool) -> tuple[str, str, str, str, str | None, str | None]:
        """Leader: a copy of ``step`` on this node, fastest tier first: ("ok", folder, tier,
        location, temporary folder to remove or None, the disk tier the folder is on or None),
        ("bad", reason, ...) when none is usable,
        or ("unreachable", error, tier, ...) when a tier that may hold it did not answer (unknown,
        not invalid: never fall back to an older step then). A disk copy is used in place; a
        remote one is downloaded into the home tier (``download``) or a temporary folder."""
        reasons = []
        for t in self.tiers:
            if t.name in tried:
                continue
            try:
                if t.remote:
                    got = self._fetch(t, step, download)
                    if isinstance(got, str):
                        reasons.append(f"{t.name}: {got}")
                        continue
                    return got
                folder = t.store.folder(step_name(step))
                if folder is None or not folder.exists():
                    continue
                info = self._infos.get((t.name, step)) if t.name in valid_on else None
                if info is None:
                    info = check_checkpoint(t.store, step, self._parse, key=self.key)
                if info is None or not info.valid:
                    reasons.append(f"{t.name} copy at {folder}: {info.reason if info else 'not there'}")
                    continue
                if self.layout.verify_on_obtain:
                    self.layout.verify(folder, key=self.key)
                return ("ok", str(folder), t.name, str(folder), None, t.name)
            except TierUnknown as e:
                name, why = next(iter(e.tiers.items()))
                return ("unreachable", why, name, "", None, None)
            except CheckpointInvalid as e:
                reasons.append(f"{t.name} copy: {e}")
                self.log.warning("checkpoint step %d on %s is unusable: %s", step, t.name, e)
            except Exception as e:  # noqa: BLE001
                if is_unreachable(e):  # unknown, not invalid: never fall back to an older step
                    return ("unreachable", f"{type(e).__name__}: {e}", t.name, "", None, None)
                reasons.append(f"{t.name}: {type(e).__name__}: {e}")
        return ("bad", "; ".join(reasons) or "no copy on this node", "", "", None, None)

    def _fetch(self, t: Tier, step: int, download: bool) -> tuple[str, str, str, str, str | None, str | None] | str:
        """A remote tier's copy of ``step`` downloaded and verified: into the home tier
        (``download``), else (a read-only look, or a home that cannot take it) a temporary folder.
        A reason string when the tier holds no valid copy."""
        info = self._infos.get((t.name, step))
        if info is None:
            with t.store.deadline(time.monotonic() + self.LIST_TIMEOUT_S):
                info = check_checkpoint(t.store, step, self._parse, key=self.key)
        if info is None or not info.valid:
            return info.reason if info else "not there"
        home = self.tiers.home
        if download:
            stale = check_checkpoint(home.store, step, self._parse, key=self.key)
            if stale is not None and quarantined(stale.reason):
                self.log.warning("the %s tier's step %d is quarantined (%s): loading the %s copy without storing "
                                 "it there", home.name, step, stale.reason, t.name)
                download = False
            elif stale is not None:
                # The home copy of this step failed verification (or it would have been chosen
                # first): replace it with the good one.
                self.log.warning("replacing invalid %s copy of step %d with the %s one", home.name, step, t.name)
                delete_checkpoint(home.store, step)
        if download:
            try:
                folder = self._download(t, step, home.store.folder())  # type: ignore[arg-type]
            except _CannotStore as e:  # a full or read-only run dir: load it from elsewhere all the same
                self.log.warning("the run dir cannot take the download of step %d (%s): loading it through a "
                                 "temporary folder; the run dir gets checkpoints again once it takes writes",
                                 step, e.error)
            else:
                self.log.info("downloaded step %d from %s into %s", step, info.location, folder)
                return ("ok", str(folder), t.name, info.location, None, home.name)
        try:
            tmp = Path(tempfile.mkdtemp(prefix="spottrain-restore-"))
        except OSError as e:
            raise self._nowhere(step, e) from e
        try:
            folder = self._download(t, step, tmp)
        except _CannotStore as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise self._nowhere(step, e.error) from e
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return ("ok", str(folder), t.name, info.location, str(tmp), None)

    def _download(self, t: Tier, step: int, root: Path) -> Path:
        """``download_dir``; a tier that stops answering midway is unknown, and a folder that cannot
        take the files is ``_CannotStore`` (the checkpoint is not thereby invalid: never fall back
        to an older one for either).

        A download that does not verify (a sha256 or HMAC mismatch, or the client's own
        ``DataCorruption``) is read again, up to ``DOWNLOAD_READS`` times in all: bits flipped on
        the way are not a bad checkpoint, and falling back for them would give up intact steps
        (after two, a fresh start). Only a copy that fails verification on every read is invalid."""
        for read in range(1, DOWNLOAD_READS + 1):
            try:
                return download_dir(t.store, step, root, self._parse, key=self.key)
            except Exception as e:
                corrupt = isinstance(e, CheckpointInvalid) or _data_corruption(e)
                if corrupt and read < DOWNLOAD_READS:
                    self.log.warning("event=download_retry tier=%s step=%d read=%d reason=%s (bytes may be "
                                     "corrupted in transit: reading it again before judging the checkpoint)",
                                     t.name, step, read, e)
                    continue
                if _data_corruption(e):
                    raise CheckpointInvalid(f"every read of step {step} from {t.name} was corrupted: {e}") from e
                if is_unreachable(e):
                    raise TierUnknown({t.name: f"{type(e).__name__}: {e}"}) from e
                if isinstance(e, OSError):  # writing the files here failed (ENOSPC, EROFS, EIO, ...)
                    raise _CannotStore(e) from e
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _nowhere(self, step: int, e: OSError) -> TierUnknown:
        """Neither the run dir nor a temporary folder takes the download: the run dir cannot be used
        now, so start-up waits for it (trainer.checkpoint.tier_wait), as for any tier it cannot use."""
        home = self.tiers.home.name
        return TierUnknown({home: f"cannot store the download of step {step} in the run dir nor in a "
                                  f"temporary folder ({type(e).__name__}: {e})"})

    def _load(self, folder: Path, download: bool) -> tuple[Any, Any]:
        """("ok", (state, full model or None)), or ("invalid", why) for a copy that does not verify
        (another copy may), ("unloadable", why) for one that verified but cannot be loaded
        here (a resume mismatch: no fallback), or ("unreadable", why) for one that verified but
        could not be loaded just now (I/O, memory, a peer: unknown, tried again)."""
        try:
            if download:
                return "ok", (self.layout.load(folder, key=self.key), None)
            model, state = self.layout.look(folder, key=self.key)
            return "ok", (state, model)
        except CheckpointUnloadable as e:
            return "unloadable", str(e)
        except CheckpointUnreadable as e:
            return "unreadable", str(e)
        except TierUnknown:
            raise
        except CheckpointInvalid as e:
            return "invalid", str(e)
        except Exception as e:  # noqa: BLE001 - a copy that cannot be read: the next one may
            return "invalid", f"{type(e).__name__}: {e}"

    def _reserve_in_background(self, state: Any) -> None:
        """Allocate host memory for the first save while the loop starts, rather than during
        that save (training time). Best effort: a failure only moves the cost to the first save."""
        def reserve() -> None:
            try:
                self.layout.reserve(state)
            except Exception as e:  # noqa: BLE001
                self.log.debug("snapshot buffer not reserved: %s", e)

        # Not a daemon: a process that ends soon after its restore (without close()) must wait for
        # the allocation, since a daemon thread still inside torch at interpreter exit aborts it.
        self._reserver = threading.Thread(target=reserve, name="checkpoint-reserve", daemon=False)
        self._reserver.start()

    # ------------------------------------------------------------------------------ emergency
    def emergency_save(self, step: int, state: Any = None, *, deadline: float,
                       meta: dict | None = None) -> EmergencyReport:
        """Save now, on a preemption notice (see the module docstring): the disk tiers (they
        always complete), then every remote tier until ``deadline`` (time.monotonic). A second
        signal (Ctrl-C) does not abort it."""
        t0 = time.monotonic()
        meta = _check_meta(meta)
        report = self._uninterrupted(step, t0, lambda: self._emergency(step, state, deadline, meta, t0))
        if self.group.rank == 0:
            (self.log.info if report.saved else self.log.error)("emergency save: %s", report.detail)
        return report

    def _uninterrupted(self, step: int, t0: float, save: Callable[[], EmergencyReport]) -> EmergencyReport:
        """Run an emergency ``save`` in a thread and wait for it, ignoring Ctrl-C meanwhile: a
        second signal must not break off the save (or a collective) midway. A save that raises is
        reported as failed, never raised."""
        result: list[EmergencyReport] = []
        done = threading.Event()

        def work() -> None:
            try:
                result.append(save())
            except BaseException as e:  # noqa: BLE001
                result.append(EmergencyReport(step, {t.name: False for t in self.tiers}, time.monotonic() - t0,
                                              f"step {step}: emergency save failed: {type(e).__name__}: {e}"))
            finally:
                done.set()

        threading.Thread(target=work, name="checkpoint-emergency", daemon=True).start()
        while True:
            try:
                if done.wait(1.0):
                    return result[0]
            except KeyboardInterrupt:
                self.log.warning("interrupt ignored: emergency checkpoint of step %d in progress", step)

    def _emergency(self, step: int, state: Any, deadline: float, meta: dict, t0: float) -> EmergencyReport:
        # Nothing on the network is waited for: older uploads are dropped or left behind (across
        # nodes that one runs on the uploader's own group). Then every tier, disks first.
        self._stop_uploads(f"emergency save of step {step}")
        if self._busy():
            if self._copying is not None:
                self.log.info("emergency save of step %d: waiting for the previous save's copy into host memory "
                              "and its disk write", step)
            self._join_writer()  # the disk writer (its copy first): disk I/O only
        self._copying = None
        staged = self.layout.stage(step, state, meta, make_room=self._drop_memory_upload)
        tiers = list(self.tiers)
        written = self._write(staged, tiers, emergency=True)
        ok: dict[str, bool] = {}
        parts: list[str] = list(written.detail)
        for t in self.tiers.disks:
            error = written.errors.get(t.name)
            ok[t.name] = t.name in written.errors and error is None
            if ok[t.name]:
                folder = written.folders.get(t.name)
                parts.append(f"{t.name} saved" + (f" ({folder}, {written.seconds.get(t.name, 0.0):.1f}s)"
                                                    if folder is not None else ""))
            elif self.group.nodes > 1:
                parts.append(f"{t.name} not complete")
            else:
                parts.append(f"{t.name} FAILED ({type(error).__name__}: {error})")
        remotes = self.tiers.remotes
        source = self._source(staged, written, remotes) if remotes and self._uploads_here(written) else None
        if source is None:
            self._discard(written)
        if remotes:
            ok.update(self._emergency_uploads(remotes, source, written, deadline, parts))
        if source is not None:
            source.refs.release()  # type: ignore[union-attr]
        cache = [t.name for t in self.tiers if not t.durable and ok.get(t.name)]
        if cache and not any(ok.get(t.name) for t in self.tiers if t.durable):
            parts.append(f"step {step} is only on {', '.join(cache)}, lost with the VM: a restart of the trainer on "
                         "this VM resumes from it, but it does not count as saved")
        complete = self.tiers.complete(self.group.nodes)
        return EmergencyReport(step=step, ok=ok, seconds=time.monotonic() - t0, detail=f"step {step}: " + "; ".join(parts),
                               saved=any(ok.get(t.name) for t in self.tiers if t.durable),
                               complete=bool(complete) and all(ok.get(t.name) for t in complete))

    def _emergency_uploads(self, remotes: list[Tier], source: _Source | None, written: Written, deadline: float,
                           parts: list[str]) -> dict[str, bool]:
        """Upload to every remote tier until ``deadline``: across nodes together, in order (a
        collective cannot be left behind on one rank); else on rank 0, each on a thread of its own,
        a request still running at the deadline abandoned there. Rank 0's outcome on every rank."""
        g = self.group
        out: dict[str, bool] = {}
        if source is None:
            if g.rank == 0 or written.collective:
                for t in remotes:
                    out[t.name] = False
                    parts.append(f"{t.name} not done ({written.failure or 'nothing to upload from'})")
            if not written.collective and g.size > 1:
                out, more = g.bcast((out, parts))
                parts[:] = more
            return out
        if written.collective:
            for t in remotes:
                t1 = time.monotonic()
                job = _Upload(t, source, collective=True, deadline=deadline)
                try:
                    self._upload(job, lane="save")
                except Exception as e:  # noqa: BLE001
                    out[t.name] = False
                    parts.append(f"{t.name} not done ({e})")
                    if g.rank == 0:
                        self._failed(t.name, source.step, e)
                else:
                    out[t.name] = True
                    parts.append(f"{t.name} uploaded ({t.store.location(step_name(source.step))})")
                    if g.rank == 0:
                        self._succeeded(t, source.step, time.monotonic() - t1)
            return out
        if g.rank == 0:
            threads = {}
            for t in remotes:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    out[t.name] = False
                    parts.append(f"{t.name} not done (no time left before the deadline)")
                    continue
                threads[t.name] = self._upload_thread(t, source, deadline)
            for t in remotes:
                if t.name in threads:
                    out[t.name] = self._upload_joined(t, source, threads[t.name], deadline, parts)
        if g.size > 1:
            out, more = g.bcast((out, parts))
            parts[:] = more
        return out

    def _upload_thread(self, t: Tier, source: _Source, deadline: float) -> tuple[threading.Thread, _Upload, list, float]:
        job = _Upload(t, source, deadline=deadline)
        result: list[BaseException | None] = []

        def upload() -> None:
            try:
                with t.store.aborting(job.abort):
                    self._upload(job, lane="save")
                result.append(None)
            except BaseException as e:  # noqa: BLE001
                result.append(e)

        th = threading.Thread(target=upload, name=f"checkpoint-emergency-upload-{t.name}", daemon=True)
        th.start()
        return th, job, result, deadline - time.monotonic()

    def _upload_joined(self, t: Tier, source: _Source, started: tuple, deadline: float, parts: list[str]) -> bool:
        th, job, result, remaining = started
        th.join(max(0.0, deadline - time.monotonic()))
        if th.is_alive():
            job.abort.set()
            parts.append(f"{t.name} not done by the deadline ({remaining:.1f}s were left; the manifest will not "
                         "be uploaded, so nothing partial is visible)")
            self._note(t.name, "the emergency upload did not finish by the deadline")
            return False
        if result and result[0] is None:
            parts.append(f"{t.name} uploaded ({t.store.location(step_name(source.step))})"
                         + ("" if source.memory is None else " from host memory"))
            self._saved([t], source.step)
            self._note(t.name, None)
            return True
        e = result[0] if result else None
        parts.append(f"{t.name} not done ({type(e).__name__}: {e})")
        self._note(t.name, f"{type(e).__name__}: {e}"[:300])
        return False

    # ------------------------------------------------------------------------------ lifecycle
    def wait(self, timeout: float | None = None) -> bool:
        """Block until the disk writer and the uploads queued so far are done (at most
        ``timeout`` seconds); False if they are not by then. Abandoned uploads are not waited for."""
        end = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if end is None else max(0.0, end - time.monotonic())

        th = self._thread
        if th is not None:
            self._lift_writer()
            th.join(left())
            if th.is_alive():
                return False
        with self._cv:
            while self._active is not None or self._pending:
                if end is not None and time.monotonic() >= end:
                    return False
                self._cv.wait(left())
        return True

    def close(self, timeout: float | None = None) -> bool:
        """Finish background work and release host memory: the disk writer always (disk I/O; a
        collective for a sharded layout), the uploads for at most ``timeout`` seconds (then they
        are abandoned). True if nothing was left unfinished."""
        if self._thread is not None:
            self._join_writer()
        done = self.wait(timeout)
        with self._cv:
            self._closing = True
        if not done:
            self._stop_uploads("the checkpointer is closing")
        with self._cv:
            self._uploader = None  # an idle uploader thread ends
            self._cv.notify_all()
        if self._reserver is not None:
            self._reserver.join()
        self.layout.close()
        # An abandoned upload may still sit in a collective of the uploader's lane: leave that to
        # the process's exit.
        self.group.close(abandoned=bool(self.abandoned))
        return done

    # ------------------------------------------------------------------------------ status
    def describe(self, *, deep: bool = False) -> dict:
        """Per tier: checkpoints (valid or not, with the reason), the newest valid, the cadence.
        Not a collective: this node's view.

        ``deep`` also verifies every file of disk checkpoints (slow for big states); by default the
        check is the manifest self-checksum plus file presence and sizes.
        """
        out: dict[str, Any] = {"tiers": {}, "stats": dict(self.stats)}
        for t in self.tiers:
            entry: dict[str, Any] = {
                "location": t.store.location(),
                "policy": dataclasses.asdict(t.cadence) | {"keep": t.keep, "automatic": t.cadence.automatic},
                "interval_s": self.interval_s(t.name),
                "checkpoints": [], "newest_valid": None,
            }
            try:
                infos = self._list(t)
            except Exception as e:  # noqa: BLE001
                entry["error"] = f"{type(e).__name__}: {e}"
                infos = []
            for i in infos:
                valid, reason = i.valid, i.reason
                folder = t.store.folder(step_name(i.step))
                if deep and valid and folder is not None:
                    try:
                        self.layout.verify(folder, key=self.key)
                    except CheckpointInvalid as e:
                        valid, reason = False, str(e)
                entry["checkpoints"].append({"step": i.step, "valid": valid, "reason": reason,
                                             "bytes": i.bytes, "created": i.created,
                                             "location": i.location})
                if valid and entry["newest_valid"] is None:
                    entry["newest_valid"] = i.step
            out["tiers"][t.name] = entry
        return out


#: Reads of a remote copy before a verification failure is the copy's, not the transfer's.
DOWNLOAD_READS = VERIFY_READS


def _data_corruption(exc: BaseException) -> bool:
    """The storage client's own checksum (crc32c/md5 against the object's) refused the bytes."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if type(e).__name__ == "DataCorruption":
            return True
        e = e.__cause__ or e.__context__
    return False


class _CannotStore(Exception):
    """A download that the folder it goes to cannot take (full, read-only, failing): the disk's
    problem, not the checkpoint's."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


class _Locks:
    """Several locks taken together, always in the same order."""

    def __init__(self, locks: list[threading.Lock]) -> None:
        self._locks = locks

    def __enter__(self) -> None:
        for lock in self._locks:
            lock.acquire()

    def __exit__(self, *exc: object) -> None:
        for lock in reversed(self._locks):
            lock.release()


def describe_failing(failing: dict[str, dict[str, Any]]) -> str:
    """One line for the tiers ``failing()`` returns, e.g. ``gcs failing since
    2026-11-24T04:00:00Z (3 failed writes; last: Forbidden: ...)``; empty when none is."""
    def one(tier: str, rec: dict[str, Any]) -> str:
        since, n = rec.get("since"), rec.get("failures")
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(since)) if isinstance(since, (int, float)) else "?"
        return f"{tier} failing since {when} ({n} failed write{'' if n == 1 else 's'}; last: {rec.get('error')})"

    return "; ".join(one(tier, rec) for tier, rec in sorted(failing.items()))


def _check_meta(meta: dict | None) -> dict:
    meta = dict(meta or {})
    try:
        json.dumps(meta)
    except (TypeError, ValueError) as e:
        raise TypeError(f"checkpoint meta must be JSON-serializable: {e}") from None
    return meta


__all__ = ["Checkpointer", "Durability", "EmergencyReport", "Restored", "describe_failing"]
