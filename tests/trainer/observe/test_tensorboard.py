"""trainer/metrics.py: event files TensorBoard reads, superseded points purged locally and in the
bucket, a lost disk recovered from the bucket, a torn tail survived, a bucket outage tolerated.
(The bucket here is a DirStore, the same Store interface as GCS; tests/trainer/e2e/
test_e2e_metrics.py runs the trainer against the storage emulator.)"""
from __future__ import annotations

from pathlib import Path

import pytest

from trainer.observe.tensorboard import TB_DIR, Metrics, records, step_of
from trainer.checkpoint.stores import DirStore


def _read(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(logdir))
    ea.Reload()
    return {t: [(e.step, e.value) for e in ea.Scalars(t)] for t in ea.Tags()["scalars"]}


def _session(run_dir: Path, bucket: DirStore | None, start: int, end: int, value: float, session: str) -> Metrics:
    m = Metrics(run_dir, start_step=start, store=bucket, session=session, upload_every_s=3600)
    for step in range(start + 1, end + 1):
        m.scalars(step, {"train/loss": value + step, "lr": 0.5})
    return m


def test_tensorboard_reads_the_points_back_exactly(tmp_path: Path) -> None:
    m = _session(tmp_path, None, 0, 5, 0.25, "a")
    m.scalars(5, {"eval/loss": 1.5})
    m.scalars(6, None)
    assert m.close()
    got = _read(tmp_path / TB_DIR)
    assert got["train/loss"] == [(s, 0.25 + s) for s in range(1, 6)]
    assert got["eval/loss"] == [(5, 1.5)] and len(got["lr"]) == 5


def test_a_restore_purges_the_points_it_supersedes_here_and_in_the_bucket(tmp_path: Path) -> None:
    bucket = DirStore(tmp_path / "bucket", "gcs")
    _session(tmp_path / "run", bucket, 0, 10, 0.0, "1").close()  # crashed after 10; checkpoint 6
    _session(tmp_path / "run", bucket, 6, 12, 100.0, "2").close()
    expected = [(s, float(s)) for s in range(1, 7)] + [(s, 100.0 + s) for s in range(7, 13)]
    for logdir in (tmp_path / "run" / TB_DIR, tmp_path / "bucket" / TB_DIR):
        assert _read(logdir)["train/loss"] == expected
        first = sorted(logdir.iterdir())[0]  # rewritten, not only hidden by the purge marker
        assert max(step_of(r) for r in records(first.read_bytes())) <= 6


def test_a_lost_disk_gets_the_curves_back_from_the_bucket(tmp_path: Path) -> None:
    bucket = DirStore(tmp_path / "bucket", "gcs")
    _session(tmp_path / "old-disk", bucket, 0, 8, 0.0, "1").close()
    _session(tmp_path / "new-disk", bucket, 5, 9, 100.0, "2").close()
    expected = [(s, float(s)) for s in range(1, 6)] + [(s, 100.0 + s) for s in range(6, 10)]
    assert _read(tmp_path / "new-disk" / TB_DIR)["train/loss"] == expected
    assert _read(tmp_path / "bucket" / TB_DIR)["train/loss"] == expected


def test_a_torn_tail_is_dropped_and_a_bucket_outage_only_warns(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    _session(tmp_path, None, 0, 4, 0.0, "1").close()
    first = next((tmp_path / TB_DIR).iterdir())
    first.write_bytes(first.read_bytes()[:-7])  # SIGKILL mid-write

    class Down(DirStore):
        def put_bytes(self, key: str, data: bytes, *, overwrite: bool = False) -> None:
            raise ConnectionError("bucket unreachable")

    m = _session(tmp_path, Down(tmp_path / "bucket", "gcs"), 4, 6, 10.0, "2")
    assert not m.close(timeout=5)
    assert "event=metrics_upload ok=0" in caplog.text
    assert _read(tmp_path / TB_DIR)["train/loss"] == [(1, 1.0), (2, 2.0), (3, 3.0), (5, 15.0), (6, 16.0)]


def test_a_long_session_goes_to_the_bucket_in_parts_each_uploaded_until_it_is_full(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bucket's soft delete keeps every object an upload replaces: parts bound that to one
    part per upload instead of the whole session's file."""
    import trainer.observe.tensorboard as metrics

    monkeypatch.setattr(metrics, "PART_BYTES", 2000)
    puts: list[tuple[str, int]] = []

    class Counting(DirStore):
        def put_bytes(self, key: str, data: bytes, *, overwrite: bool = False) -> None:
            puts.append((key, len(data)))
            super().put_bytes(key, data, overwrite=overwrite)

    bucket = Counting(tmp_path / "bucket", "gcs")
    m = Metrics(tmp_path / "run", start_step=0, store=bucket, session="s", upload_every_s=3600)
    for step in range(1, 101):
        m.scalars(step, {"train/loss": float(step), "lr": 0.1})
        if step % 10 == 0:
            assert m._upload()
    assert m.close()
    parts = sorted(p.name for p in (tmp_path / "bucket" / TB_DIR).iterdir())
    assert len(parts) == 3 and parts == sorted(p.name for p in (tmp_path / "run" / TB_DIR).iterdir())
    assert max(n for _, n in puts) < 2000 + 200  # never a whole session's file
    assert _read(tmp_path / "bucket" / TB_DIR)["train/loss"] == [(s, float(s)) for s in range(1, 101)]


def test_a_run_dir_that_fills_never_stops_the_run_and_the_curve_goes_on_once_there_is_room(
        small_fs, caplog: pytest.LogCaptureFixture) -> None:
    fs = small_fs("run", 1 << 20)
    bucket = DirStore(fs.path.parent / "bucket", "gcs")
    m = Metrics(fs.path, start_step=0, store=bucket, session="s", upload_every_s=3600)
    m.scalars(1, {"train/loss": 1.0})
    fs.fill()
    for step in range(2, 200):  # a point per step on a full disk: each write fails
        m.scalars(step, {"train/loss": float(step), "lr": 0.5})
    assert "event=metrics_error where=local count=1 " in caplog.text and m.errors >= 100
    fs.free()
    m.scalars(200, {"train/loss": 200.0})
    assert m.close()
    for logdir in (fs.path / TB_DIR, bucket.root / TB_DIR):  # no torn record hides the later points
        got = _read(logdir)["train/loss"]
        kept = len(got) - 1  # what fitted in the file's last page before the disk was full, then 200
        assert got == [(s, float(s)) for s in range(1, kept + 1)] + [(200, 200.0)] and kept < 100


def test_a_read_only_run_dir_at_start_never_stops_the_run(small_fs, caplog: pytest.LogCaptureFixture) -> None:
    fs = small_fs("run", 1 << 20)
    _session(fs.path, None, 0, 3, 0.0, "1").close()  # an earlier session's curve, superseded below
    fs.readonly()
    bucket = DirStore(fs.path.parent / "bucket", "gcs")
    m = _session(fs.path, bucket, 2, 6, 10.0, "2")
    m.close(timeout=5)
    assert "event=metrics_error where=local count=1 " in caplog.text
    assert _read(bucket.root / TB_DIR)["train/loss"] == [(1, 1.0), (2, 2.0)]  # superseded there all the same
