"""The rollback guard (trainer.loop.rollback) over a real ledger: what counts as "durable in the
bucket", what does not (another tier, events copied back from the bucket), and when a missing
step is a rollback (absent everywhere) rather than corruption (present, failing verification)."""
from __future__ import annotations

import shutil
from pathlib import Path

from trainer.checkpoint.stores import GcsStore
from trainer.loop.rollback import refusal
from trainer.observe.ledger import LEDGER_DIR, LEDGER_FILE, Ledger, read_events

TIERS = ("persistent", "gcs")


def _ledger(run_dir: Path, *events: tuple[str, dict], store=None, session: str = "000-a") -> None:
    ledger = Ledger(run_dir, store=store, session=session)
    for kind, fields in events:
        ledger.append(kind, **fields)
    ledger.close()


def test_a_step_recorded_durable_in_the_bucket_and_now_absent_everywhere_is_refused(tmp_path: Path) -> None:
    _ledger(tmp_path, ("durable", {"tier": "gcs", "step": 30}), ("durable", {"tier": "persistent", "step": 40}))
    why, note = refusal(tmp_path, restored_step=20, steps_seen={10, 20}, tiers=TIERS, allow=False)
    assert why is not None and "records step 30 durable in the bucket" in why and "back to step 20" in why
    assert note is None
    # Present but failing verification: corruption, met and logged by the restore, not a rollback.
    assert refusal(tmp_path, restored_step=20, steps_seen={10, 20, 30}, tiers=TIERS, allow=False) == (None, None)
    # Said on purpose: a warning, no refusal.
    why, note = refusal(tmp_path, restored_step=20, steps_seen={10, 20}, tiers=TIERS, allow=True)
    assert why is None and note is not None and note.startswith("event=rollback step=30 to=20 allowed=1")
    # Without a bucket tier (this run no longer has one) there is nothing to compare.
    assert refusal(tmp_path, restored_step=20, steps_seen={10, 20}, tiers=("persistent",), allow=False) == (None, None)


def test_an_emergency_save_and_a_finish_count_only_where_the_bucket_had_them(tmp_path: Path) -> None:
    _ledger(tmp_path, ("preempted", {"step": 50, "gcs_ok": False, "persistent_ok": True}),
            ("preempted", {"step": 45, "gcs_ok": True}))
    why, _ = refusal(tmp_path, restored_step=None, steps_seen=set(), tiers=TIERS, allow=False)
    assert why is not None and "records step 45" in why and "to a fresh start" in why
    _ledger(tmp_path, ("finish", {"step": 60, "blocked_s": 0.0, "productive_s": 1.0}), session="001-b")
    why, _ = refusal(tmp_path, restored_step=45, steps_seen={45}, tiers=TIERS, allow=False)
    assert why is not None and "records step 60" in why


def test_events_copied_back_from_the_bucket_are_not_trusted(tmp_path: Path, gcs_emulator) -> None:
    """With the run dir's disk lost, the ledger's events come back from the bucket, where whoever
    can write it could plant "step 99999999 durable": they are marked and not counted."""
    store = GcsStore(gcs_emulator.uri, client=gcs_emulator.client)
    _ledger(tmp_path / "run", ("durable", {"tier": "gcs", "step": 99_999_999}), store=store)
    shutil.rmtree(tmp_path / "run")  # the persistent disk is lost
    _ledger(tmp_path / "run", ("session_start", {"started": 5.0}), store=store, session="001-b")
    local = read_events(tmp_path / "run" / LEDGER_DIR / LEDGER_FILE)
    assert [e.get("recovered") for e in local if e["event"] == "durable"] == [True]
    assert refusal(tmp_path / "run", restored_step=20, steps_seen={20}, tiers=TIERS, allow=False) == (None, None)
