"""The restore survey: what every tier holds, which checkpoint to restore, reading it back.

* **The survey** (``survey``): every tier listed, each checkpoint quick-checked (manifest
  self-check and HMAC under the run's key, file sizes); the valid copies newest first, the
  fastest tier first for equal steps. Invalid ones are logged with the reason; checkpoints of the
  other layout, another format version, unauthenticated or signed for another run are kept apart
  (``Quarantine``). A tier that cannot be listed is unknown, never empty: ``TierUnknown``.
* **The restore** (``restore``): the newest checkpoint that verifies (sha256 of every file too).
  A disk copy is used in place; a remote copy newer than anything on disk is downloaded into the
  home tier (atomically), else through a temporary folder; when neither takes it the run dir is
  unknown. A download that does not verify is read again (``DOWNLOAD_READS``) before it is
  judged. Any invalid copy is logged and the next one tried (the same step on a slower tier, then
  older steps); a verified copy that cannot be loaded here is a ``ResumeMismatch`` (no fallback),
  one whose load failed for a reason outside it is unknown (tried again at start-up).
* **Set aside** (``SetAside``): with nothing authentic left, checkpoints nobody can vouch for
  that are only on the remote tiers are set aside (never loaded, deleted or overwritten) and the
  run starts from scratch, saying whether its signed run record shows it saved before; on a disk
  tier they refuse the start (exit 2).
* **Reading back** (``check``, ``describe``): whether a step is on a tier (``durable()``), and
  each tier's checkpoints for ``status``.

Every method that takes the group's ranks is a collective of the layout's group (rank 0 reads
the tiers for the others); ``check`` and ``describe`` are this process's view.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, ContextManager, Literal

from trainer.checkpoint import run_record
from trainer.checkpoint.bookkeeping import Bookkeeping
from trainer.checkpoint.format import (VERIFY_READS, CheckpointInfo, check_checkpoint, delete_checkpoint, download_dir,
                                       list_checkpoints, read_manifest)
from trainer.checkpoint.key import CheckpointKey
from trainer.checkpoint.layout import Group, Layout
from trainer.checkpoint.manifest import (OTHER_FORMAT, OTHER_LAYOUT, OTHER_RUN, CheckpointInvalid,
                                         CheckpointUnloadable, CheckpointUnreadable, ResumeMismatch, layout_mismatch,
                                         other_layout, other_run_mismatch, quarantine_mismatch, quarantined,
                                         step_name)
from trainer.checkpoint.stores import is_unreachable
from trainer.checkpoint.tier_wait import TierUnknown
from trainer.checkpoint.tiers import Tier, Tiers

#: Listing a tier gives up after this long (a bucket unreachable at start-up must not stall
#: the restore for the full upload retry budget; the disk tiers are still tried).
LIST_TIMEOUT_S = 60.0
#: Reads of a remote copy before a verification failure is the copy's, not the transfer's.
DOWNLOAD_READS = VERIFY_READS


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
class Quarantine:
    """The quarantined checkpoints the last survey met that are not of the other layout, each as
    a line ``tier step N at LOCATION: reason``."""

    format: list[str] = dataclasses.field(default_factory=list)           # another format version
    unauthenticated: list[str] = dataclasses.field(default_factory=list)
    other_run: list[str] = dataclasses.field(default_factory=list)
    #: The unauthenticated and other-run ones on a disk tier, which no bucket writer can have put there.
    on_disk: list[str] = dataclasses.field(default_factory=list)
    #: The steps of those on a remote tier.
    remote_steps: list[int] = dataclasses.field(default_factory=list)


#: A leader's copy of a step (``_obtain``): ("ok", folder, tier, location, temporary folder to
#: remove or None, the disk tier the folder is on or None), or ("bad" | "unreachable", why, ...).
Copy = tuple[str, str, str, str, "str | None", "str | None"]
#: A copy loaded (``_load``): ("ok", (state, full model or None)) or ("invalid" | "unloadable" |
#: "unreadable", why).
Outcome = tuple[Literal["ok", "invalid", "unloadable", "unreadable"], Any]


class Survey:
    """What the tiers hold and the restore from them; see the module docstring."""

    def __init__(self, tiers: Tiers, layout: Layout, group: Group, book: Bookkeeping, *,
                 key: CheckpointKey | None, log: logging.Logger,
                 restoring: Callable[[], ContextManager[None]]) -> None:
        """``restoring``: holds retention off every tier while a restore runs."""
        self.tiers, self.layout, self.group, self.book, self.key, self.log = tiers, layout, group, book, key, log
        self._restoring = restoring
        self.list_timeout_s = LIST_TIMEOUT_S
        #: What the last survey met: the quick-checked copies (rank 0) and the quarantined ones.
        self._infos: dict[tuple[str, int], CheckpointInfo] = {}
        self._quarantined = Quarantine()
        #: What the last restore set aside to start from scratch beside (``SetAside``), or None.
        self.set_aside: SetAside | None = None
        #: Every step the last survey of this process listed on some tier, valid or not (None: no
        #: survey yet): what the rollback guard (``trainer.loop.rollback``) asks.
        self.steps_seen: set[int] | None = None
        self._reserver: threading.Thread | None = None

    # ------------------------------------------------------------------------------ the survey
    def listing(self, t: Tier) -> list[CheckpointInfo]:
        """Every checkpoint on ``t``, quick-checked, newest first (within ``list_timeout_s``)."""
        with t.store.deadline(time.monotonic() + self.list_timeout_s):
            return list_checkpoints(t.store, self.layout.parse_manifest, key=self.key)

    def newest_valid_step(self, excluding: frozenset[int] | set[int] = frozenset()) -> int | None:
        """The newest step that passes the quick check (manifest, sizes) on any tier, or None;
        ``excluding``: steps whose every copy here already failed full verification.

        Cheap (listings only): in a multi-node job every node leader answers it, so that the node
        whose disk holds the newest checkpoint restores for everyone. Raises ``TierUnknown``
        when a tier cannot be listed.
        """
        candidates, _ = self.survey()
        return next((s for s, _ in candidates if s not in excluding), None)

    def survey(self, *, tolerate_unknown: bool = False) -> tuple[list[tuple[int, str]], list[str]]:
        """Every tier listed for a restore: the valid copies as (step, tier), newest first and
        fastest tier first for equal steps, and a line per checkpoint of the other layout.
        Invalid ones are logged with the reason. A tier that cannot be listed raises
        ``TierUnknown`` (after every tier was tried), or with ``tolerate_unknown`` (a read-only
        look) is logged and skipped."""
        candidates: list[tuple[int, int, str]] = []
        other: list[str] = []
        unknown: dict[str, str] = {}
        self._infos = {}
        q = self._quarantined = Quarantine()
        seen: set[int] = set()
        for rank, t in enumerate(self.tiers):
            try:
                infos = self.listing(t)
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
                    line = f"{t.name} step {i.step} at {i.location}: {i.reason}"
                    if i.reason.startswith(OTHER_FORMAT):
                        q.format.append(line)
                    else:
                        (q.other_run if i.reason.startswith(OTHER_RUN) else q.unauthenticated).append(line)
                        if t.remote:
                            q.remote_steps.append(i.step)
                        else:
                            q.on_disk.append(line)
                    self.log.warning("refusing %s checkpoint step %d at %s: %s", t.name, i.step, i.location, i.reason)
                else:
                    self.log.warning("ignoring %s checkpoint step %d at %s: %s",
                                     t.name, i.step, i.location, i.reason)
        if unknown and not tolerate_unknown:
            raise TierUnknown(unknown)
        self.steps_seen = seen
        candidates.sort(key=lambda c: (-c[0], c[1]))
        return [(s, n) for s, _, n in candidates], other

    # ------------------------------------------------------------------------------ the restore
    def restore(self, *, download: bool, step: int | None, t_start: float) -> Restored | None:
        """``Checkpointer.restore`` once the saves in flight are done (see the module docstring)."""
        g = self.group
        with self._restoring():
            if download and g.is_leader:
                for t in self.tiers:
                    removed = t.store.clean_temporaries()
                    if removed:
                        self.log.info("removed leftovers of interrupted writes on %s: %s", t.name, ", ".join(removed))
            survey: Any = None
            if g.rank == 0:
                try:
                    survey = self.survey(tolerate_unknown=not download)
                except TierUnknown as e:  # every rank raises it together, below
                    survey = e.tiers
            survey, self._quarantined = g.bcast((survey, self._quarantined))
            if isinstance(survey, dict):
                raise TierUnknown(survey)
            candidates, other = survey
            q = self._quarantined
            if other and download:  # a trainer starting; a read-only look only looks
                raise ResumeMismatch(layout_mismatch(self.layout.parallelism, other))
            if q.format and download:
                raise ResumeMismatch(quarantine_mismatch(q.format, None))
            for found in sorted({s for s, _ in candidates}, reverse=True):
                if step is not None and found != step:
                    continue
                restored = self._restore_step(found, [n for s, n in candidates if s == found], download, t_start)
                if restored is not None:
                    return restored
            if step is not None:
                return None  # that step only (a node of a multi-node restore asked): not usable here
            self.set_aside = None
            if (q.unauthenticated or q.other_run) and download:
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
        return self._held_mismatch() if self._quarantined.on_disk else None

    def _held_mismatch(self) -> str:
        q = self._quarantined
        if q.unauthenticated:
            # Never a fresh start over them: they may be this run's work under a lost key.
            return quarantine_mismatch(q.unauthenticated, self.key)
        # Nor over another run's: they may be this run's own, moved here from elsewhere.
        return other_run_mismatch(q.other_run, self.key.run if self.key else None)

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
        if q.on_disk:
            return self._held_mismatch()
        saved, said, unknown = False, [], {}
        for t in self.tiers:
            if not t.remote:
                continue
            if self.key is None or self.key.run is None:
                said.append(f"{t.name}: no run record (this run's key is bound to no run)")
                continue
            try:
                with t.store.deadline(time.monotonic() + self.list_timeout_s):
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
        found = tuple(q.unauthenticated + q.other_run)
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
        return SetAside(found=found, steps=tuple(sorted(set(q.remote_steps))), saved_before=saved,
                        record=record, message=message)

    def _restore_step(self, step: int, valid_on: list[str], download: bool, t_start: float) -> Restored | None:
        """Load a copy of ``step`` (every node leader finds or downloads its own), trying the next
        copy when one does not verify; None when no copy of it is usable."""
        g = self.group
        tried: set[str] = set()
        while True:
            got = self._obtain(step, valid_on, tried, download) if g.is_leader else None
            copies: list[Copy | None] = g.all(got)
            unreachable = {f"{c[2]}" + (f" (node of rank {r})" if g.nodes > 1 else ""): c[1]
                           for r, c in enumerate(copies) if c is not None and c[0] == "unreachable"}
            if unreachable:
                raise TierUnknown(unreachable)
            bad = [(r, c[1]) for r, c in enumerate(copies) if g.leader_of[r] == r and c is not None and c[0] != "ok"]
            if bad:
                if g.rank == 0:
                    why = "; ".join(f"node of rank {r}: {w}" if g.nodes > 1 else w for r, w in bad)
                    self.log.warning("checkpoint step %d is unusable: %s; falling back to the next older one",
                                     step, why)
                return None
            mine = copies[g.leader_of[g.rank]]
            assert mine is not None, "every node leader obtains a copy"
            _, folder, tier, location, tmp, placed = mine
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
                    self.book.verified.add((placed, step))
                with contextlib.suppress(Exception):  # its copies hold this process's state
                    writer = read_manifest(Path(folder), self.layout.parse_manifest, key=self.key).get("writer")
                    if writer:
                        self.book.restored[step] = writer
                self.book.saved(list(self.tiers), step)
            seconds = time.monotonic() - t_start
            if g.rank == 0:
                self.log.info("restored step %d from %s (%s) in %.2fs", step, tier, location, seconds)
            return Restored(step=step, state=state, tier=tier, path=location, seconds=seconds, model=model)

    def _obtain(self, step: int, valid_on: list[str], tried: set[str], download: bool) -> Copy:
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
                    info = check_checkpoint(t.store, step, self.layout.parse_manifest, key=self.key)
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

    def _fetch(self, t: Tier, step: int, download: bool) -> Copy | str:
        """A remote tier's copy of ``step`` downloaded and verified: into the home tier
        (``download``), else (a read-only look, or a home that cannot take it) a temporary folder.
        A reason string when the tier holds no valid copy."""
        parse = self.layout.parse_manifest
        info = self._infos.get((t.name, step))
        if info is None:
            with t.store.deadline(time.monotonic() + self.list_timeout_s):
                info = check_checkpoint(t.store, step, parse, key=self.key)
        if info is None or not info.valid:
            return info.reason if info else "not there"
        home = self.tiers.home
        if download:
            stale = check_checkpoint(home.store, step, parse, key=self.key)
            if stale is not None and quarantined(stale.reason):
                self.log.warning("the %s tier's step %d is quarantined (%s): loading the %s copy without storing "
                                 "it there", home.name, step, stale.reason, t.name)
                download = False
            elif stale is not None:
                # The home copy of this step failed verification (or it would have been chosen
                # first): replace it with the good one.
                self.log.warning("replacing invalid %s copy of step %d with the %s one", home.name, step, t.name)
                delete_checkpoint(home.store, step)
        root = home.store.folder()
        if download and root is not None:
            try:
                folder = self._download(t, step, root)
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
                return download_dir(t.store, step, root, self.layout.parse_manifest, key=self.key)
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

    def _load(self, folder: Path, download: bool) -> Outcome:
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

    def close(self) -> None:
        """Wait for the host memory reserved in the background."""
        if self._reserver is not None:
            self._reserver.join()

    # ------------------------------------------------------------------------------ reading back
    def check(self, t: Tier, step: int, deadline: float) -> str:
        """``"ok"`` when ``step`` verifies on ``t`` (quick check, with the key, as a restore reads
        it), else why not; the reading gets a short while of its own after ``deadline``."""
        try:
            # After the deadline the check still gets a short while of its own.
            with t.store.deadline(max(deadline, time.monotonic() + 10.0)):
                # With the key, as a restore reads it: a manifest someone without the key planted
                # at this step is never this run's checkpoint, however well-formed.
                info = check_checkpoint(t.store, step, self.layout.parse_manifest, key=self.key)
        except Exception as e:  # noqa: BLE001 - the tier cannot be read: not durable as far as we know
            return f"cannot check it ({type(e).__name__}: {str(e)[:200]})"
        if info is None:
            return f"step {step} is not there"
        return "ok" if info.valid else info.reason

    def describe(self, *, deep: bool = False) -> dict:
        """``Checkpointer.describe``: per tier its checkpoints, the newest valid, the cadence."""
        out: dict[str, Any] = {"tiers": {}, "stats": dict(self.book.stats)}
        for t in self.tiers:
            entry: dict[str, Any] = {
                "location": t.store.location(),
                "policy": dataclasses.asdict(t.cadence) | {"keep": t.keep, "automatic": t.cadence.automatic},
                "interval_s": self.book.interval_s(t.name),
                "checkpoints": [], "newest_valid": None,
            }
            try:
                infos = self.listing(t)
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


__all__ = ["DOWNLOAD_READS", "LIST_TIMEOUT_S", "Quarantine", "Restored", "SetAside", "Survey"]
