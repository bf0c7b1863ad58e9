"""trainer/lease.py: one trainer per run dir (flock), one writer per GCS prefix (a lease object
written with generation preconditions, which the fault proxy enforces as Cloud Storage does)."""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from trainer.checkpoint.lease import (LEASE_KEY, LEASE_RECORD, LOCK_FILE, Lease, LeaseHeld, LeaseLost, RunDirBusy,
                                     RunDirLock, holder_id)
from trainer.checkpoint.stores import GcsStore
from trainer.checkpoint.tier_wait import TierUnknown


def store(gcs) -> GcsStore:
    s = GcsStore(gcs.uri, client=gcs.client())
    s.initial_backoff_s = 0.05
    return s


def lease(gcs, holder: str, ttl: float = 1.0, **kw) -> Lease:
    st = store(gcs)
    le = Lease(st, holder=holder, started=0.0, ttl_s=ttl, op_timeout_s=5.0, **kw)
    st.guard = le.check
    return le


def no_wait(seconds: float) -> bool:
    """The acquire loop's pause, real (no notice ever comes here)."""
    threading.Event().wait(seconds)
    return False


def test_acquire_renew_release_with_preconditions(gcs_proxy) -> None:
    a = lease(gcs_proxy, "vm-a:/run")
    with pytest.raises(LeaseLost, match="does not hold"):
        a.check()  # nothing is written before the lease is held
    a.acquire(sleep=no_wait, on_wait=lambda s: None)
    a.check()
    creates = gcs_proxy.proxy.seen("POST", rf"ifGenerationMatch=0 object=.*/{LEASE_KEY}")
    assert [s.outcome for s in creates] == ["forwarded 200"]
    a.start()
    assert _wait(lambda: len(gcs_proxy.proxy.seen("POST", rf"ifGenerationMatch=[1-9]\d* object=.*/{LEASE_KEY}")) >= 2)
    a.store.put_bytes("probe", b"x")  # the guard lets the holder write
    a.release()
    assert store(gcs_proxy).read_versioned(LEASE_KEY) is None
    assert gcs_proxy.proxy.seen("DELETE", rf"ifGenerationMatch=\d+.* object=.*/{LEASE_KEY}")[-1].outcome == "forwarded 200"


def test_a_live_holder_makes_a_second_trainer_exit_naming_it(gcs_proxy) -> None:
    a = lease(gcs_proxy, "vm-a:/run", ttl=2.0)
    a.acquire(sleep=no_wait, on_wait=lambda s: None)
    a.start()
    b = lease(gcs_proxy, "vm-b:/other-run", ttl=2.0)
    waits: list[str] = []
    with pytest.raises(LeaseHeld, match=r'held and renewed by "vm-a:/run \(pid \d+ on host '):
        b.acquire(sleep=no_wait, on_wait=waits.append)
    assert waits and waits[0].startswith('for the writer lease held by "vm-a:/run')
    with pytest.raises(LeaseLost):
        b.store.put_bytes("probe", b"x")
    assert "probe" not in store(gcs_proxy).names("")
    a.check()  # the holder never noticed
    a.release()


def test_a_dead_holder_is_taken_over_after_the_ttl(gcs_proxy) -> None:
    dead = lease(gcs_proxy, "vm-a:/run", ttl=1.0)
    dead.acquire(sleep=no_wait, on_wait=lambda s: None)  # then "SIGKILLed": never renewed, never released
    waits: list[str] = []
    b = lease(gcs_proxy, "vm-b:/run", ttl=1.0)
    b.acquire(sleep=no_wait, on_wait=waits.append)
    assert waits, "took a live-looking lease without waiting for it to expire"
    b.check()
    doc = json.loads(store(gcs_proxy).read_versioned(LEASE_KEY)[0])
    assert doc["holder"] == "vm-b:/run" and doc["pid"] == os.getpid() and doc["host"] == socket.gethostname()
    assert doc["incarnation"] == b.incarnation != dead.incarnation


def test_a_restart_on_the_same_run_dir_takes_its_predecessors_lease_at_once(gcs_proxy, tmp_path: Path) -> None:
    """The run dir records which lease its trainer took; a successor holding the run dir's lock
    on the same boot knows its predecessor is dead (the kernel dropped the lock) and takes that
    lease at once. A copy of the disk on another machine (another boot) waits like anyone."""
    record = tmp_path / "run" / LEASE_RECORD
    record.parent.mkdir()
    crashed = lease(gcs_proxy, "vm-b:/run", ttl=30.0, record=record)
    crashed.acquire(sleep=no_wait, on_wait=lambda s: None)  # then SIGKILLed: the lease stays live
    assert json.loads(record.read_text())["incarnation"] == crashed.incarnation
    again = lease(gcs_proxy, "vm-b:/run", ttl=30.0, record=record)
    again.acquire(sleep=lambda s: pytest.fail("waited for its predecessor's lease"), on_wait=lambda s: None)
    again.check()
    doc = json.loads(store(gcs_proxy).read_versioned(LEASE_KEY)[0])
    assert doc["incarnation"] == again.incarnation == json.loads(record.read_text())["incarnation"]
    # The same record on a clone of the disk booted elsewhere names the live holder: not its own.
    cloned = json.loads(record.read_text())
    cloned["boot"] = "another machine's boot"
    record.write_text(json.dumps(cloned))
    again.start()
    clone = lease(gcs_proxy, "vm-b:/run", ttl=30.0, record=record)
    with pytest.raises(LeaseHeld, match=r'held and renewed by "vm-b:/run \(pid '):
        clone.acquire(sleep=_renewed(gcs_proxy), on_wait=lambda s: None)
    again.check()
    again.release()


def test_a_second_incarnation_of_a_pool_job_does_not_take_its_live_lease(
        gcs_proxy, tmp_path: Path, monkeypatch) -> None:
    """Every torchrun job of a pool has the same rendezvous id (the experiment's name): a second
    deployment on the same prefix, or a duplicated pool, is named like the first one and must
    still find its lease held."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "pool")
    monkeypatch.setenv("SPOTTRAIN_NODE", "pool-node-0")
    first = lease(gcs_proxy, holder_id(tmp_path / "run"), ttl=2.0)
    first.acquire(sleep=no_wait, on_wait=lambda s: None)
    first.start()
    second = lease(gcs_proxy, holder_id(tmp_path / "run"), ttl=2.0)
    assert second.holder == first.holder
    with pytest.raises(LeaseHeld, match=r'held and renewed by "torchrun job pool '):
        second.acquire(sleep=_renewed(gcs_proxy), on_wait=lambda s: None)
    first.check()
    first.release()


def test_a_taker_whose_clock_runs_ahead_does_not_take_a_live_lease(gcs_proxy) -> None:
    """A VM whose wall clock runs ten TTLs ahead of Cloud Storage's: the lease's age is judged by
    the store's clock, so a live holder's lease is not expired to it."""
    a = lease(gcs_proxy, "vm-a:/run", ttl=2.0)
    a.acquire(sleep=no_wait, on_wait=lambda s: None)
    a.start()
    b = lease(gcs_proxy, "vm-b:/run", ttl=2.0, wall=lambda: time.time() + 20.0)
    with pytest.raises(LeaseHeld, match=r'held and renewed by "vm-a:/run '):
        b.acquire(sleep=_renewed(gcs_proxy), on_wait=lambda s: None)
    a.check()
    a.release()


def test_a_lease_expired_by_the_stores_clock_is_taken_at_once_by_a_taker_whose_clock_lags(gcs_proxy) -> None:
    """The converse: a dead holder's lease older than its TTL by Cloud Storage's clock is taken
    without waiting, by a VM whose wall clock runs an hour behind."""
    dead = lease(gcs_proxy, "vm-a:/run", ttl=1.0)
    dead.acquire(sleep=no_wait, on_wait=lambda s: None)  # never renewed
    threading.Event().wait(1.5)  # the lease ages past its TTL (the store's clock and ours both run)
    b = lease(gcs_proxy, "vm-b:/run", ttl=1.0, wall=lambda: time.time() - 3600.0)
    b.acquire(sleep=lambda s: pytest.fail("waited for a lease the store says expired"), on_wait=lambda s: None)
    b.check()


def test_a_lost_answer_on_create_is_recognised_as_our_own_write(gcs_proxy) -> None:
    gcs_proxy.proxy.add("POST", rf"ifGenerationMatch=0 object=.*/{LEASE_KEY}", "after-forward", status=503)
    a = lease(gcs_proxy, "vm-a:/run")
    a.acquire(sleep=lambda s: pytest.fail("waited for its own lease"), on_wait=lambda s: None)
    a.check()
    outcomes = [s.outcome for s in gcs_proxy.proxy.seen("POST", rf"object=.*/{LEASE_KEY}")]
    assert outcomes == ["forwarded 200, answered 503", "precondition 412"]


def test_a_taken_lease_is_lost_and_nothing_more_is_written(gcs_proxy) -> None:
    a = lease(gcs_proxy, "vm-a:/run", ttl=1.0)
    a.acquire(sleep=no_wait, on_wait=lambda s: None)
    a.start()
    # Another trainer takes the lease (as one that judged it expired would).
    gcs_proxy.client().bucket(gcs_proxy.bucket).blob(a.store._object(LEASE_KEY)).upload_from_string(
        json.dumps({"holder": "vm-z:/run", "pid": 7, "host": "z"}))
    assert _wait(lambda: a.lost is not None)
    assert a.lost.startswith('"vm-z:/run (pid 7 on host z')
    with pytest.raises(LeaseLost, match='taken by "vm-z'):
        a.store.put_bytes("late", b"x")
    assert "late" not in store(gcs_proxy).names("")
    a.release()  # not ours any more: left alone
    assert json.loads(store(gcs_proxy).read_versioned(LEASE_KEY)[0])["holder"] == "vm-z:/run"


def test_storage_answering_403_is_unknown_not_free(gcs_proxy) -> None:
    gcs_proxy.proxy.add("*", r"lease\.json", "status", status=403, times=None)
    with pytest.raises(TierUnknown, match="gcs: writer lease: Forbidden"):
        lease(gcs_proxy, "vm-a:/run").acquire(sleep=no_wait, on_wait=lambda s: None)


def test_run_dir_lock_names_its_holder(tmp_path: Path) -> None:
    first = RunDirLock(tmp_path / "run").acquire(started=0.0)
    with pytest.raises(RunDirBusy, match=rf"in use by another trainer \(pid {os.getpid()} on host "
                                         rf"{socket.gethostname()}, started 1970-01-01T00:00:00Z"):
        RunDirLock(tmp_path / "run").acquire(started=1.0)
    first.release()
    RunDirLock(tmp_path / "run").acquire(started=2.0).release()


def test_run_dir_lock_on_a_read_only_disk_locks_the_directory(small_fs) -> None:
    fs = small_fs("run", 1 << 20)
    fs.readonly()
    first = RunDirLock(fs.path).acquire(started=0.0)
    assert not (fs.path / LOCK_FILE).exists()
    with pytest.raises(RunDirBusy, match="holder not recorded"):
        RunDirLock(fs.path).acquire(started=0.0)
    first.release()


def _renewed(gcs):
    """The acquire loop's pause, until the live holder has renewed the lease once more (never a
    notice)."""
    st = store(gcs)

    def pause(seconds: float) -> bool:
        gen = st.read_versioned(LEASE_KEY)[1]
        assert _wait(lambda: st.read_versioned(LEASE_KEY)[1] != gen), "the holder stopped renewing"
        return False

    return pause


def _wait(cond, timeout: float = 30.0) -> bool:
    ev = threading.Event()
    for _ in range(int(timeout / 0.02)):
        if cond():
            return True
        ev.wait(0.02)
    return cond()


def test_a_garbage_lease_is_an_unreadable_holder_that_expires(gcs_proxy) -> None:
    """200 KB of nested `[` planted as the lease: no crash; nobody renews it, so it is taken
    over after the TTL as any dead holder's (never at once: it might hide a live writer's)."""
    gcs_proxy.client().bucket(gcs_proxy.bucket).blob(store(gcs_proxy)._object(LEASE_KEY)).upload_from_string(
        b"[" * 200_000)
    waits: list[str] = []
    b = lease(gcs_proxy, "vm-b:/run", ttl=1.0)
    b.acquire(sleep=no_wait, on_wait=waits.append)
    assert waits and waits[0].startswith('for the writer lease held by "unreadable lease object gs://')
    b.check()
    assert json.loads(store(gcs_proxy).read_versioned(LEASE_KEY)[0])["holder"] == "vm-b:/run"
