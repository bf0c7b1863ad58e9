"""The ``Checkpointer``: the save policy the loop talks to. When to save and where to
(``due``, ``save``), when a checkpoint counts as durable (``durable``), and the one object the loop,
``status`` and ``export`` hold; it drives either layout (``trainer.checkpoint.layout``) and asks a
tier's fields (``trainer.checkpoint.tiers``), never its name. Its parts, each a module:

* ``trainer.checkpoint.bookkeeping``: each tier's schedule and health, the stats, and whose state
  this process saves (what the other parts record and read);
* ``trainer.checkpoint.disk_writer``: a thread per save that writes the due disk tiers;
* ``trainer.checkpoint.uploader``: the upload queue, its thread and lanes, retention;
* ``trainer.checkpoint.survey``: what the tiers hold, the restore, reading a step back;
* ``trainer.checkpoint.emergency``: the emergency save on a preemption notice.

Saving (CheckFreq's snapshot/persist split), every tier failing on its own:

* ``save()`` blocks the loop only while the layout stages the state into host memory (pinned when
  CUDA is involved); that is the time it returns. The whole-model layout copies the weights and
  the optimizer state beside the loop's next forward and backward: the loop calls
  ``before_update()`` before its optimizer step, which waits for that copy if it still runs.
* The disk writer waits for the copy, then writes the due disk tiers; it never touches the
  network. The uploader uploads what a remote tier is due for, from the committed disk copy, the
  staging folder or host memory, and applies retention. Every request it makes is bounded and
  each upload has its own abort flag.
* One disk write at a time: ``due()`` answers False while the disk writer runs (the due tier stays
  due and is saved at the first step after it finished; counted in ``stats["deferred_steps"]``).
  An upload never holds a disk save back: the next save's upload to a tier waits in a queue of one,
  where a newer save's replaces it. An explicit ``save()`` while the disk writer runs waits for it
  (``stats["waited"]``): the caller asked for that exact step.
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

Restoring (``restore``): the newest checkpoint that verifies across all tiers, a remote copy
downloaded into the home tier; a tier that cannot be read is unknown (``TierUnknown``), never
empty; checkpoints nobody can vouch for on the remote tiers only are set aside (``set_aside``).
The survey's module docstring has the whole rule.

Same step twice: a save that finds a folder of its step already on a tier keeps it when the same
session wrote it (the manifest's ``writer``: same session and step, same state), replaces it
atomically when it holds other state (an abandoned trajectory: the live run is the one a restart
must continue) or is invalid, and never touches a quarantined one (unauthenticated, another
format or layout): that tier then skips this step. A process's own state at a step is also what
the checkpoint it restored from holds: after a restore, copies of that step by its writer are
kept too (a re-run of a finished job writes only the copies that are missing).

Emergency (``emergency_save``): it never waits on the network; *saved* means on a tier that
outlives the VM (the emergency module's docstring).

Ranks: with the sharded layout every public method but ``due()``, ``describe()`` and
``durable()`` is a collective of the layout's group (every rank calls it, in the same order, with
the same step); rank 0 decides which tiers a save writes and reads the tiers for the others. With
the whole-model layout the group is this process alone.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid
from typing import Any, Callable

from trainer.checkpoint.bookkeeping import Bookkeeping, Failure, describe_failing
from trainer.checkpoint.disk_writer import DiskWriter
from trainer.checkpoint.emergency import Emergency, EmergencyReport
from trainer.checkpoint.interval import DEFAULT_MTBF_S
from trainer.checkpoint.key import CheckpointKey, KeyProblem
from trainer.checkpoint.layout import Layout, Staged
from trainer.checkpoint.survey import DOWNLOAD_READS, LIST_TIMEOUT_S, Restored, SetAside, Survey
from trainer.checkpoint.tiers import Tier, Tiers
from trainer.checkpoint.uploader import Uploader


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


class Checkpointer:
    """Asynchronous multi-tier checkpointing of one layout; see the module docstring."""

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
            raise KeyProblem(layout.needs_key)
        self.log = log or logging.getLogger("spottrain.checkpoint")
        self.layout: Layout = layout
        self.tiers, self.key = tiers, key
        self.group = layout.group
        #: This checkpointer's saves, in manifests as ``writer``: a save id (see the module docstring).
        self.session: str = self.group.bcast(uuid.uuid4().hex)
        g, log = self.group, self.log
        self._book = Bookkeeping(tiers, session=self.session, mtbf_s=mtbf_s, log=log)
        self._uploads = Uploader(tiers, layout, g, self._book, key=key, log=log)
        self._writer = DiskWriter(layout, g, self._book, self._uploads, key=key, log=log)
        self._survey = Survey(tiers, layout, g, self._book, key=key, log=log, restoring=self._uploads.restoring)
        self._emergency = Emergency(tiers, layout, g, self._book, self._writer, self._uploads, log=log)
        self.stats = self._book.stats
        #: The newest save while its copy may still run beside the loop (``before_update``), and
        #: its tiers (whose interval policies learn what the wait for it cost).
        self._copying: Staged | None = None
        self._copying_tiers: list[Tier] = []
        if self.group.nodes > 1 and self.group.rank == 0:
            self.log.info("%s checkpoints: %d ranks on %d nodes; each node's disk holds only its own ranks' "
                          "files, so the complete copy is the remote one", layout.name, self.group.size,
                          self.group.nodes)
            if not tiers.remotes:
                self.log.warning("%s checkpoints across %d nodes without a remote tier: no tier will hold a "
                                 "complete checkpoint, so no restore is possible", layout.name, self.group.nodes)

    def bind(self, model: Any, optimizer: Any, *, named: dict[str, Any] | None = None) -> None:
        """The model and optimizer a layout that saves them in place reads and loads (sharded);
        ``named``: the job's other models it saves the same way (``Sharded.bind``)."""
        self.layout.bind(model, optimizer, named=named)

    # ------------------------------------------------------------------------------ what the parts hold
    @property
    def LIST_TIMEOUT_S(self) -> float:  # noqa: N802 - the name callers set
        """Listing a tier gives up after this long (``trainer.checkpoint.survey.LIST_TIMEOUT_S``;
        start-up shortens it to its probe's time)."""
        return self._survey.list_timeout_s

    @LIST_TIMEOUT_S.setter
    def LIST_TIMEOUT_S(self, seconds: float) -> None:  # noqa: N802
        self._survey.list_timeout_s = seconds

    @property
    def set_aside(self) -> SetAside | None:
        """What the last restore set aside to start from scratch beside, or None."""
        return self._survey.set_aside

    @property
    def steps_seen(self) -> set[int] | None:
        """Every step the last survey of this process listed on some tier, valid or not (None: no
        survey yet): what the rollback guard (``trainer.loop.rollback``) asks."""
        return self._survey.steps_seen

    @property
    def on_durable(self) -> Callable[[str, int], None] | None:
        """Called with (tier, step) once a periodic save is durable on a tier (rank 0); must not block."""
        return self._book.on_durable

    @on_durable.setter
    def on_durable(self, fn: Callable[[str, int], None] | None) -> None:
        self._book.on_durable = fn

    @property
    def on_tier_health(self) -> Callable[[str, Failure | None], None] | None:
        """Called with (tier, failure record or None when it works again) on each change (rank 0).
        Must not raise (errors are logged)."""
        return self._book.on_tier_health

    @on_tier_health.setter
    def on_tier_health(self, fn: Callable[[str, Failure | None], None] | None) -> None:
        self._book.on_tier_health = fn

    @property
    def abandoned(self) -> int:
        """Uploads left running on their thread (emergency, deadline)."""
        return self._uploads.abandoned

    def failing(self) -> dict[str, Failure]:
        """Tiers whose latest writes failed: tier -> {since (unix time), failures, error}."""
        return self._book.failing()

    def uploading(self) -> bool:
        """An upload is running or queued."""
        return self._uploads.busy()

    def interval_s(self, tier: str) -> float | None:
        """The automatic interval currently in force for ``tier`` (None for fixed cadences)."""
        return self._book.interval_s(tier)

    # ------------------------------------------------------------------------------ the save policy
    def due(self, step: int) -> bool:
        """Whether to call ``save(step, ...)`` now; cheap, call it every step (rank 0 decides).

        False while a disk write is in flight, or while the layout has no host memory free for
        another save (the due tier stays due and is saved once that is over).
        """
        due = self._book.due_tiers(step)
        if self._writer.busy():
            self._writer.check(next_due=bool(due))
        if not due:
            return False
        if self._writer.busy() or not self.layout.can_stage(self._uploads.droppable()):
            self.stats["deferred_steps"] += 1
            return False
        return True

    def mark_restored(self, step: int) -> None:
        """Another node restored ``step`` for the job: count the tiers' intervals from there."""
        self._book.saved(list(self.tiers), step)

    def save(self, step: int, state: Any = None, *, meta: dict | None = None, every_tier: bool = False) -> float:
        """Stage ``state`` and write it in the background; returns the seconds the caller was
        blocked. Saves to the tiers that are due, or to every tier when none is (explicit save)
        or when ``every_tier`` (the final checkpoint, a pause). ``state``: the whole state (whole
        model), or rank 0's replicated rest beside the bound model's shards (sharded; the other
        ranks may pass None)."""
        t0 = time.perf_counter()
        meta = _check_meta(meta)
        if self._writer.busy():
            self.stats["waited"] += 1
            self._writer.join()  # its copy too: the buffer is free again
        tiers = self._plan(step, every_tier)
        t_stage = time.perf_counter()
        staged = self.layout.stage(step, state, meta, make_room=self._uploads.drop_memory_upload)
        # The cost C for the interval policy excludes a one-off buffer allocation; what the next
        # optimizer step waits for the copy is added then (``before_update``).
        stage_s = time.perf_counter() - t_stage - staged.alloc_s
        self._copying, self._copying_tiers = staged, tiers
        self._book.saved(tiers, step)
        self._book.blocked(tiers, stage_s)
        self.stats["saves"] += 1
        # Only one process's write yields: the ranks of a sharded save write together, and only
        # rank 0 runs the checks that would lift them.
        self._writer.start(staged, tiers, yielding=not every_tier and self.group.size == 1)
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
        self._book.blocked_longer(self._copying_tiers, waited)  # the save cost the loop this much more
        return True

    def _plan(self, step: int, every_tier: bool) -> list[Tier]:
        """The tiers a save writes (rank 0 decides for every rank), in table order."""
        names: list[str] | None = None
        if self.group.rank == 0:
            tiers = list(self.tiers) if every_tier else (self._book.due_tiers(step) or list(self.tiers))
            if self.group.nodes > 1 and self.uploading() and not every_tier:
                tiers = [t for t in tiers if not t.remote]  # uploads across nodes queue in order: remote stays due
            if any(t.remote for t in tiers) and not any(not t.remote for t in tiers):
                tiers.append(self.tiers.home)  # an upload reads a disk copy (host memory is freed)
            names = [t.name for t in self.tiers if t in tiers]
        return [self.tiers[n] for n in self.group.bcast(names)]

    def emergency_save(self, step: int, state: Any = None, *, deadline: float,
                       meta: dict | None = None) -> EmergencyReport:
        """Save now, on a preemption notice (``trainer.checkpoint.emergency``): the disk tiers
        (they always complete), then every remote tier until ``deadline`` (time.monotonic). A
        second signal (Ctrl-C) does not abort it."""
        meta = _check_meta(meta)
        copying, self._copying = self._copying is not None, None  # the emergency save waits for that copy
        return self._emergency.save(step, state, deadline=deadline, meta=meta, copying=copying)

    # ------------------------------------------------------------------------------ durability
    def durable(self, step: int, *, deadline: float) -> Durability:
        """Wait for the saves in flight (at most until ``deadline``, time.monotonic), then read
        ``step`` back from every tier it must be on (see the module docstring; rank 0 reads, the
        others get an empty verdict: the caller takes rank 0's). An upload still running at the
        deadline is aborted: it does not count. Not a collective."""
        if not self.wait(timeout=max(0.0, deadline - time.monotonic())):
            self._uploads.stop(f"step {step} was due durable by the deadline")
        if self.group.rank != 0:
            return Durability(step, {})
        complete = self.tiers.complete(self.group.nodes)
        if not complete:
            return Durability(step, {"remote": "not configured: no tier of this run can hold a complete copy"})
        return Durability(step, {t.name: self._survey.check(t, step, deadline) for t in complete})

    # ------------------------------------------------------------------------------ restoring
    def restore(self, *, download: bool = True, step: int | None = None) -> Restored | None:
        """Load the newest checkpoint that verifies across all tiers (``trainer.checkpoint.survey``),
        or the one of ``step``. A trainer restores with ``download`` (a remote copy is placed in
        the home tier; every rank gets the state, a sharded layout loads the bound model in place);
        ``download=False`` is a read-only look of one process (``status``, ``export``): it changes
        nothing on any tier and gives the full model state dict."""
        t_start = time.monotonic()
        self.wait()  # outside retention's locks: the background thread takes them
        return self._survey.restore(download=download, step=step, t_start=t_start)

    def newest_valid_step(self, excluding: frozenset[int] | set[int] = frozenset()) -> int | None:
        """The newest step that passes the quick check on any tier, or None (``Survey.newest_valid_step``)."""
        return self._survey.newest_valid_step(excluding)

    def held_on_disks(self) -> str | None:
        """After a survey: the refusal for unauthenticated or other-run checkpoints on this process's
        disk tiers, or None (``Survey.held_on_disks``)."""
        return self._survey.held_on_disks()

    # ------------------------------------------------------------------------------ lifecycle
    def wait(self, timeout: float | None = None) -> bool:
        """Block until the disk writer and the uploads queued so far are done (at most
        ``timeout`` seconds); False if they are not by then. Abandoned uploads are not waited for."""
        end = None if timeout is None else time.monotonic() + timeout
        if not self._writer.join(None if end is None else max(0.0, end - time.monotonic())):
            return False
        return self._uploads.wait(end)

    def close(self, timeout: float | None = None) -> bool:
        """Finish background work and release host memory: the disk writer always (disk I/O; a
        collective for a sharded layout), the uploads for at most ``timeout`` seconds (then they
        are abandoned). True if nothing was left unfinished."""
        self._writer.join()
        done = self.wait(timeout)
        self._uploads.close(done)
        self._survey.close()
        self.layout.close()
        # An abandoned upload may still sit in a collective of the uploader's lane: leave that to
        # the process's exit.
        self.group.close(abandoned=bool(self.abandoned))
        return done

    def describe(self, *, deep: bool = False) -> dict:
        """Per tier: checkpoints (valid or not, with the reason), the newest valid, the cadence.
        Not a collective: this node's view.

        ``deep`` also verifies every file of disk checkpoints (slow for big states); by default the
        check is the manifest self-checksum plus file presence and sizes.
        """
        return self._survey.describe(deep=deep)


def _check_meta(meta: dict | None) -> dict:
    meta = dict(meta or {})
    try:
        json.dumps(meta)
    except (TypeError, ValueError) as e:
        raise TypeError(f"checkpoint meta must be JSON-serializable: {e}") from None
    return meta


__all__ = ["DOWNLOAD_READS", "LIST_TIMEOUT_S", "Checkpointer", "Durability", "EmergencyReport", "Restored",
           "SetAside", "describe_failing"]
