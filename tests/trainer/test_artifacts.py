"""trainer/artifacts.py: a run's artifacts directory and its copy in GCS (the real client against
gcp-storage-emulator behind the fault proxy, which enforces generation preconditions)."""
from __future__ import annotations

from pathlib import Path

import trainer.artifacts as artifacts_mod
from trainer.artifacts import Artifacts, atomic
from trainer.checkpoint.stores import GcsStore


def make(tmp_path: Path, gcs, name: str = "run") -> Artifacts:
    run = tmp_path / name
    return Artifacts(run / "artifacts", GcsStore(gcs.uri, client=gcs.client()), staging=run)


def uploads(gcs, name: str) -> int:
    return len([s for s in gcs.proxy.seen("POST", rf"object=runs/.*/artifacts/{name}$")
                if s.outcome.startswith("forwarded 200")])


def blob(gcs, name: str) -> bytes:
    uri = gcs.uri.removeprefix(f"gs://{gcs.bucket}/")
    return gcs.client(direct=True).bucket(gcs.bucket).blob(f"{uri}/artifacts/{name}").download_as_bytes()


def test_new_and_changed_files_are_copied_once_and_come_back_to_a_blank_disk(gcs_proxy, tmp_path: Path) -> None:
    a = make(tmp_path, gcs_proxy)
    (a.root / "samples").mkdir()
    (a.root / "samples" / "a.txt").write_text("first")
    with atomic(a.root / "best.pt") as tmp:
        tmp.write_bytes(b"weights v1")
    (a.root / ".tmp-half-written").write_text("never copied")
    r = a.sync()
    assert sorted(r.uploaded) == ["best.pt", "samples/a.txt"] and not r.failed
    assert a.sync().uploaded == []  # unchanged: nothing sent again
    assert uploads(gcs_proxy, "best.pt") == 1
    with atomic(a.root / "best.pt") as tmp:
        tmp.write_bytes(b"weights v2")
    assert a.sync().uploaded == ["best.pt"]
    assert blob(gcs_proxy, "best.pt") == b"weights v2" and blob(gcs_proxy, "samples/a.txt") == b"first"

    # A fresh disk gets them back; a file the disk already has is kept (it is newer).
    b = make(tmp_path, gcs_proxy, "fresh")
    (b.root / "best.pt").write_bytes(b"local and newer")
    assert b.restore() == 1
    assert (b.root / "samples" / "a.txt").read_text() == "first"
    assert (b.root / "best.pt").read_bytes() == b"local and newer"
    assert not [p for p in b.root.rglob("*") if p.name.startswith(".tmp-")]


def test_a_file_written_during_the_copy_is_not_uploaded_torn(gcs_proxy, tmp_path: Path, monkeypatch) -> None:
    a = make(tmp_path, gcs_proxy)
    path = a.root / "log.txt"
    path.write_text("line 1\n")
    real = artifacts_mod._copy_with_crc

    def copy_while_the_task_writes(src: Path, dst: Path) -> str:
        crc = real(src, dst)
        with open(src, "a") as f:  # the task appends while the copy is read
            f.write("line 2\n")
        return crc

    monkeypatch.setattr(artifacts_mod, "_copy_with_crc", copy_while_the_task_writes)
    r = a.sync()
    assert r.busy == ["log.txt"] and r.uploaded == []
    assert uploads(gcs_proxy, "log.txt") == 0
    monkeypatch.setattr(artifacts_mod, "_copy_with_crc", real)
    assert a.sync().uploaded == ["log.txt"]  # the next copy takes the finished file
    assert blob(gcs_proxy, "log.txt") == b"line 1\nline 2\n"


def test_an_object_changed_by_another_writer_is_not_overwritten(gcs_proxy, tmp_path: Path, monkeypatch) -> None:
    a = make(tmp_path, gcs_proxy)
    (a.root / "best.pt").write_bytes(b"v1")
    a.sync()
    (a.root / "best.pt").write_bytes(b"v2 from this run")
    listed = a.store.objects

    def listing_then_someone_else_writes(prefix: str):
        seen = listed(prefix)
        other = make(tmp_path, gcs_proxy, "other")
        (other.root / "best.pt").write_bytes(b"v2 from another VM")
        assert other.sync().uploaded == ["best.pt"]
        return seen

    monkeypatch.setattr(a.store, "objects", listing_then_someone_else_writes)
    r = a.sync()
    assert r.uploaded == [] and r.failed and "changed since it was listed" in r.failed[0]
    assert blob(gcs_proxy, "best.pt") == b"v2 from another VM"
    assert any(s.outcome.startswith("precondition 412") for s in gcs_proxy.proxy.seen("POST"))


def test_sync_never_raises_when_gcs_is_down(gcs_proxy, tmp_path: Path) -> None:
    a = make(tmp_path, gcs_proxy)
    a.store.retry_timeout_s = 1.0
    (a.root / "x").write_text("x")
    gcs_proxy.proxy.down()
    r = a.sync()
    assert r.uploaded == [] and r.failed and "listing" in r.failed[0]
    assert a.restore() == 0
    gcs_proxy.proxy.up()
    assert a.sync().uploaded == ["x"]


def test_without_gcs_nothing_is_copied(tmp_path: Path) -> None:
    a = Artifacts(tmp_path / "run" / "artifacts", None, staging=tmp_path / "run")
    (a.root / "x").write_text("x")
    assert a.sync().uploaded == [] and a.restore() == 0


def test_an_emergency_never_waits_for_a_copy_in_flight(gcs_proxy, tmp_path: Path) -> None:
    """abort() at a preemption notice returns at once; a copy stalled in the network keeps its lock,
    so the emergency's own copy gives up at its deadline instead of waiting; no copy starts again."""
    import time

    a = make(tmp_path, gcs_proxy)
    (a.root / "big.bin").write_bytes(b"x" * 1000)
    stall = gcs_proxy.proxy.add("POST", r"object=runs/.*/artifacts/big.bin", "stall")
    a.sync_soon()
    assert gcs_proxy.proxy.wait_stalled(stall)
    a.abort()
    r = a.sync(deadline=time.monotonic() + 0.5)
    assert r.failed == ["another copy was still running at the deadline"]
    gcs_proxy.proxy.release(stall)
    assert a.wait(60)
    (a.root / "later.txt").write_text("after the notice")
    a.sync_soon()
    assert not a.busy and uploads(gcs_proxy, "later.txt") == 0


def test_a_full_or_read_only_run_dir_never_stops_a_run_from_starting(small_fs, caplog) -> None:
    for broken in ("fill", "readonly"):
        fs = small_fs(f"run-{broken}", 8 << 20, fstype="ext4")  # a directory needs a block there
        getattr(fs, broken)()
        a = Artifacts(fs.path / "artifacts", None, staging=fs.path)  # cannot create its directory
        assert a.restore() == 0 and a.sync().failed == []
        assert f"event=artifacts_dir ok=0 path={fs.path / 'artifacts'} error=" in caplog.text
        caplog.clear()
