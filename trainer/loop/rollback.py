"""The rollback guard: a restore never goes silently back past a step this run recorded durable in
its bucket.

Whoever can write the bucket can delete its newest checkpoints; a restore would then take the
newest one left, and the run would go back without a word. The run's own record says otherwise:
its goodput ledger (``trainer.observe.ledger``), in the run dir on the persistent disk, which a
bucket writer cannot write, holds an event for every checkpoint that became durable in the bucket
(``durable`` on a bucket tier, ``tiers.BUCKET_TIERS``; ``preempted`` with its ``TIER_ok``;
``finished`` and ``paused``, whose checkpoints are durable on every tier). When that step is on no
tier at all any more (not even as a copy that fails verification: corruption is another fault,
logged where it is met), the restore
refuses (exit 2) and says which step and since when, unless the run says it means it
(``allow_rollback``: you deleted them yourself).

What it cannot see: with the run dir's disk lost too, the ledger's events come back from the
bucket's copy (marked ``recovered``), which the same writer can delete or forge; they are not
counted, so a writer who deletes the newest checkpoints of a run whose disk is gone rolls it back
unseen (docs/security.md: Object Versioning with a retention period is the cure a bucket can have).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterable

from trainer.checkpoint.tiers import BUCKET_TIERS
from trainer.observe.events import CheckpointDurable, Finished, Paused, Preempted
from trainer.observe.ledger import LEDGER_DIR, LEDGER_FILE, read_events



def _step(ev: dict[str, Any]) -> int | None:
    step = ev.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def newest_recorded(events: Iterable[dict[str, Any]],
                    buckets: Iterable[str] = BUCKET_TIERS) -> dict[str, Any] | None:
    """The event recording the newest step durable in a bucket (one of the tiers ``buckets``),
    from this disk's own events."""
    buckets = tuple(buckets)
    best: dict[str, Any] | None = None
    for ev in events:
        step = _step(ev)
        if step is None or ev.get("recovered"):
            continue
        kind = ev.get("event")
        durable = ((kind == CheckpointDurable.kind and ev.get("tier") in buckets)
                   or (kind == Preempted.kind and any(ev.get(f"{b}_ok") is True for b in buckets))
                   or kind in (Finished.kind, Paused.kind))
        if durable and (best is None or step > best["step"]):
            best = ev
    return best


def refusal(run_dir: Path, *, restored_step: int | None, steps_seen: set[int] | None,
            tiers: Iterable[str], allow: bool) -> tuple[str | None, str | None]:
    """(why the restore must stop, a warning to log); both None when nothing was rolled back.

    ``restored_step``: the step the restore found (None: none, a fresh start); ``steps_seen``:
    every step the survey listed on any tier (None: this process did not survey)."""
    buckets = [t for t in tiers if t in BUCKET_TIERS]
    if steps_seen is None or not buckets:
        return None, None
    ledger = run_dir / LEDGER_DIR / LEDGER_FILE
    recorded = newest_recorded(read_events(ledger), buckets)
    if recorded is None:
        return None, None
    step = recorded["step"]
    if step in steps_seen or (restored_step is not None and restored_step >= step):
        return None, None
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(recorded["t"])) if isinstance(
        recorded.get("t"), (int, float)) else "an earlier session"
    back_to = "a fresh start" if restored_step is None else f"step {restored_step}"
    what = (f"this run's ledger ({ledger}) records step {step} durable in the bucket ({recorded['event']} at "
            f"{when}), but no tier holds step {step} now: it was deleted, by you or by someone who can write "
            f"the bucket, and resuming would roll the run back to {back_to}")
    if allow:
        return None, f"event=rollback step={step} to={restored_step} allowed=1 detail={what} (allow_rollback is set)"
    return (f"cannot resume: {what}. If you deleted them on purpose, run once with --allow-rollback "
            "(allow_rollback = true); otherwise restore them (Object Versioning keeps deleted objects) and "
            "see docs/security.md (nothing was deleted)"), None
