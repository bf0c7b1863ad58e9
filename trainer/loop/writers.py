"""Who may write the job, for the loop: the run dir's lock on every node and the job's writer
lease on its remote tiers, decided once for every rank (``trainer.checkpoint.lease`` has the
mechanisms).

``lock()``: each node leader locks its run dir; a second trainer there stops every rank (exit 2).
``take()``: rank 0 takes the writer lease on the ``lease`` tier (waiting for it to expire, or for
the tier to answer), every rank learns the outcome together, and every remote store of this
process asks it before it writes. ``lost``: another trainer took the lease (rank 0 sees it; the
others through the loop's per-step flags). ``release()``: the next trainer of the job takes over
at once.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

from trainer.checkpoint import tier_wait
from trainer.checkpoint.lease import LEASE_RECORD, FollowerLease, Lease, LeaseHeld, RunDirBusy, RunDirLock, holder_id
from trainer.distributed import World


class Writers:
    def __init__(self, cfg: Any, world: World, log: logging.Logger, *, started: float) -> None:
        self.cfg, self.world, self.log, self.started = cfg, world, log, started
        self.run_lock: RunDirLock | None = None
        self.lease: Lease | FollowerLease | None = None
        self._decided = False

    def lock(self) -> None:
        """Node leaders lock their run dir; a second trainer there stops every rank (exit 2)."""
        busy: RunDirBusy | None = None
        if self.world.is_node_leader:
            try:
                self.run_lock = RunDirLock(self.cfg.run_dir, self.log).acquire(self.started)
            except RunDirBusy as e:
                busy = e
            except OSError as e:  # no run dir at all: nothing on it to protect; the tiers report it
                self.log.warning("event=run_dir_lock ok=0 error=%r", e)
        if self.world.any_flags(busy is not None)[0]:
            raise busy or RunDirBusy("run_dir: another node's run dir is in use by another trainer (see its log)")

    def take(self, tiers: Any, *, sleep: Callable[[float], bool], on_wait: Callable[[str], None],
             op_timeout_s: float) -> bool:
        """Rank 0 takes the job's writer lease on the ``lease`` tier (once); every rank learns the
        outcome together. True once this process may write the remote tiers (False: the run has
        none). Raises ``TierUnknown`` (wait and try again), ``LeaseHeld`` (exit 2) or
        ``tier_wait.Stopped`` (a notice came)."""
        tier = tiers.role("lease") if tiers is not None else None
        if self._decided:
            return True
        # Rank 0 (which always has the tiers) says whether the job has a lease: every rank then
        # takes part in deciding it, including those without a checkpointer of their own.
        if not self.world.broadcast(tier is not None):
            return False
        if self.lease is None and tier is not None:
            if self.world.is_main:
                # The run dir's lease record only while this process holds the run dir's lock:
                # that is what proves the incarnation it names has ended.
                record = Path(self.cfg.run_dir) / LEASE_RECORD if self.run_lock is not None else None
                self.lease = Lease(tier.store, holder=holder_id(self.cfg.run_dir), started=self.started,
                                   ttl_s=self.cfg.lease_ttl_s, log=self.log, op_timeout_s=op_timeout_s,
                                   record=record)
            else:
                self.lease = FollowerLease()
            for remote in tiers.remotes if tiers is not None else []:  # refused until held
                remote.store.guard = self.lease.check
        outcome: tuple[str, Any] | None = None
        if self.world.is_main:
            assert isinstance(self.lease, Lease)
            try:
                self.lease.acquire(sleep=sleep, on_wait=on_wait)
                outcome = ("held", None)
            except tier_wait.TierUnknown as e:
                outcome = ("unknown", e.tiers)
            except LeaseHeld as e:
                outcome = ("busy", str(e))
            except InterruptedError as e:
                outcome = ("stopped", str(e))
        kind, detail = self.world.broadcast(outcome) or ("held", None)
        if kind == "unknown":
            raise tier_wait.TierUnknown(detail or {})
        if kind == "busy":
            raise LeaseHeld(detail)
        if kind == "stopped":
            raise tier_wait.Stopped(detail)
        self._decided = True
        if isinstance(self.lease, FollowerLease):
            self.lease.granted = True
        elif isinstance(self.lease, Lease):
            self.lease.start()
        return True

    @property
    def lost(self) -> bool:
        """Another trainer took the job's lease (as far as this rank knows)."""
        return self.lease is not None and self.lease.lost is not None

    def taken_by(self) -> str | None:
        """Who took the lease; a rank other than 0 learns it from rank 0's flag."""
        taker = self.lease.lost if self.lease is not None else None
        if isinstance(self.lease, FollowerLease) and taker is None:
            self.lease.lose("another trainer (rank 0 saw it)")
            taker = self.lease.lost
        return taker

    def release(self, timeout: float) -> None:
        if self.lease is not None:  # the next trainer of the job takes over at once
            try:
                self.lease.release(timeout=timeout)
            except Exception:  # noqa: BLE001 - it expires by itself
                pass
        if self.run_lock is not None:
            self.run_lock.release()
