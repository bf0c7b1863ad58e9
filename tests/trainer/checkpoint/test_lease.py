"""trainer/lease.py: one trainer per run dir (flock), one writer per GCS prefix (a lease object
written with generation preconditions, which the fault proxy enforces as Cloud Storage does)."""
from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path

import pytest

from trainer.checkpoint.lease import LEASE_KEY, LOCK_FILE, Lease, LeaseHeld, LeaseLost, RunDirBusy, RunDirLock
from trainer.checkpoint.stores import GcsStore
from trainer.checkpoint.tier_wait import TierUnknown


def store(gcs) -> GcsStore:
    s = GcsStore(gcs.uri, client=gcs.client())
    s.initial_backoff_s = 0.05
    return s


def lease(gcs, holder: str, ttl: float = 1.0) -> Lease:
    st = store(gcs)
    le = Lease(st, holder=holder, started=0.0, ttl_s=ttl, op_timeout_s=5.0)
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
    with pytest.raises(LeaseHeld, match=r"held and renewed by vm-a:/run \(pid \d+ on host "):
        b.acquire(sleep=no_wait, on_wait=waits.append)
    assert waits and waits[0].startswith("for the writer lease held by vm-a:/run")
    with pytest.raises(LeaseLost):
        b.store.put_bytes("probe", b"x")
    assert "probe" not in store(gcs_proxy).list("")
    a.check()  # the holder never noticed
    a.release()


def test_a_dead_holder_is_taken_over_after_the_ttl_and_its_own_restart_at_once(gcs_proxy) -> None:
    dead = lease(gcs_proxy, "vm-a:/run", ttl=1.0)
    dead.acquire(sleep=no_wait, on_wait=lambda s: None)  # then "SIGKILLed": never renewed, never released
    waits: list[str] = []
    b = lease(gcs_proxy, "vm-b:/run", ttl=1.0)
    b.acquire(sleep=no_wait, on_wait=waits.append)
    assert waits, "took a live-looking lease without waiting for it to expire"
    b.check()
    doc = json.loads(store(gcs_proxy).read_versioned(LEASE_KEY)[0])
    assert doc["holder"] == "vm-b:/run" and doc["pid"] == os.getpid() and doc["host"] == socket.gethostname()
    # The same VM and run dir (a restart after a crash) take their own lease over at once.
    again = lease(gcs_proxy, "vm-b:/run", ttl=1.0)
    again.acquire(sleep=lambda s: pytest.fail("waited for its own lease"), on_wait=lambda s: None)
    again.check()


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
    assert a.lost.startswith("vm-z:/run (pid 7 on host z")
    with pytest.raises(LeaseLost, match="taken by vm-z"):
        a.store.put_bytes("late", b"x")
    assert "late" not in store(gcs_proxy).list("")
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
    assert waits and waits[0].startswith("for the writer lease held by unreadable lease object gs://")
    b.check()
    assert json.loads(store(gcs_proxy).read_versioned(LEASE_KEY)[0])["holder"] == "vm-b:/run"
