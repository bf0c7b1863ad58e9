"""trainer/staging.py: a gs:// prefix staged onto a disk, verified and resumable, through the
fault proxy in front of the storage emulator (real client, real files, real processes)."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import google_crc32c
import pytest

from trainer.observe.goodput import report
from trainer.observe.ledger import LEDGER_DIR, LEDGER_FILE, read_events
from trainer.observe.health import ask
from trainer.checkpoint.crc32c import b64 as crc32c_b64
from trainer.data.staging import MANIFEST, STATE_DIR, Stager, StagingError, StagingHealth, StagingInputError

REPO = Path(__file__).resolve().parents[3]
GUARD_S = 60.0


def _objects(gcs_proxy, prefix: str = "data", sizes=(1000, 20_000, 300_000, 0, 5000)) -> dict[str, bytes]:
    rng = random.Random(7)
    bucket = gcs_proxy.client(direct=True).bucket(gcs_proxy.bucket)
    out = {}
    for i, n in enumerate(sizes):
        key = f"part-{i}.bin" if i % 2 else f"sub/dir/part-{i}.bin"
        data = rng.randbytes(n)
        bucket.blob(f"{prefix}/{key}").upload_from_string(data)
        out[key] = data
    return out


def _stager(gcs_proxy, dest: Path, **kw) -> Stager:
    kw.setdefault("forbidden_first_wait_s", 0.05)
    kw.setdefault("initial_backoff_s", 0.05)
    return Stager(f"gs://{gcs_proxy.bucket}/data", dest, client=gcs_proxy.client(), **kw)


def _downloads(gcs_proxy) -> list[str]:
    """Object names whose bytes were fetched (alt=media GETs that reached the emulator), in order."""
    return [s.path.rsplit("object=", 1)[1] for s in gcs_proxy.proxy.seen("GET", r"alt=media")
            if s.outcome.startswith("forwarded")]


def _staged(dest: Path) -> dict[str, bytes]:
    return {p.relative_to(dest).as_posix(): p.read_bytes() for p in dest.rglob("*")
            if p.is_file() and STATE_DIR not in p.relative_to(dest).parts}


def _stage_cli(gcs_proxy, *args: str) -> subprocess.Popen:
    env = {**os.environ, **gcs_proxy.env, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "trainer", "stage", *args], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_stages_every_object_verified_and_a_second_run_downloads_nothing(gcs_proxy, tmp_path: Path) -> None:
    objects = _objects(gcs_proxy)
    r = _stager(gcs_proxy, tmp_path / "d").run()
    assert _staged(tmp_path / "d") == objects
    assert (r.files, r.bytes, r.downloaded_files) == (5, sum(map(len, objects.values())), 5)
    assert not list((tmp_path / "d" / STATE_DIR / "tmp").glob("*"))  # no temporary left

    before = len(_downloads(gcs_proxy))
    again = _stager(gcs_proxy, tmp_path / "d").run()
    assert (again.files, again.downloaded_files, again.downloaded_bytes) == (5, 0, 0)
    assert len(_downloads(gcs_proxy)) == before


def test_killed_midway_a_second_run_downloads_only_what_is_missing(gcs_proxy, tmp_path: Path) -> None:
    objects = _objects(gcs_proxy)
    dest, port = tmp_path / "d", _free_port()
    stalled = "data/sub/dir/part-4.bin"  # the last in key order
    rule = gcs_proxy.proxy.add("GET", rf"alt=media.* object={stalled}$", "stall", times=None)
    proc = _stage_cli(gcs_proxy, "--from", f"gs://{gcs_proxy.bucket}/data", "--to", str(dest),
                      "--parallel", "2", "--health-port", str(port))
    try:
        assert gcs_proxy.proxy.wait_stalled(rule, timeout=GUARD_S), proc.stderr.read() if proc.poll() else ""
        manifest = dest / STATE_DIR / MANIFEST
        deadline = time.monotonic() + GUARD_S
        while len(manifest.read_text().splitlines()) < 4:  # the other four verified and recorded
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        assert ask("127.0.0.1", port) == "ok staging"  # bytes arrived: the VM is healthy
        proc.send_signal(signal.SIGKILL)
        proc.wait(GUARD_S)
    finally:
        if proc.poll() is None:
            proc.kill()
        rule.times = rule.hits  # match nothing more; the held request stays held, never answered
    # The stalled object never got its final name; its temporary is not a file of the dataset.
    assert "sub/dir/part-4.bin" not in _staged(dest)
    first = _downloads(gcs_proxy)

    again = subprocess.run([sys.executable, "-m", "trainer", "stage", "--from", f"gs://{gcs_proxy.bucket}/data",
                            "--to", str(dest)], env={**os.environ, **gcs_proxy.env, "PYTHONPATH": str(REPO)},
                           cwd=REPO, capture_output=True, text=True, timeout=GUARD_S)
    assert again.returncode == 0, again.stderr
    assert stalled not in first and len(first) == 3  # four verified, the empty one needs no GET
    assert _downloads(gcs_proxy)[len(first):] == [stalled]
    assert _staged(dest) == objects
    assert "downloaded_files=1 " in again.stderr


def test_a_corrupted_local_file_is_downloaded_again(gcs_proxy, tmp_path: Path) -> None:
    objects = _objects(gcs_proxy)
    dest = tmp_path / "d"
    _stager(gcs_proxy, dest).run()
    victim = dest / "part-1.bin"
    with open(victim, "r+b") as f:  # a bit flipped in place
        f.seek(10)
        b = f.read(1)
        f.seek(10)
        f.write(bytes([b[0] ^ 1]))
    (dest / "part-3.bin").write_bytes(b"truncated")  # (was empty) rewritten
    n = len(_downloads(gcs_proxy))
    r = _stager(gcs_proxy, dest).run()
    assert _downloads(gcs_proxy)[n:] == ["data/part-1.bin"]  # part-3 is empty: no bytes to fetch
    assert r.downloaded_files == 2 and _staged(dest) == objects


def test_rehash_catches_a_change_that_kept_size_and_mtime(gcs_proxy, tmp_path: Path) -> None:
    objects = _objects(gcs_proxy)
    dest = tmp_path / "d"
    _stager(gcs_proxy, dest).run()
    victim = dest / "sub" / "dir" / "part-2.bin"
    st = victim.stat()
    with open(victim, "r+b") as f:
        f.write(b"\0\0\0\0")
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert _stager(gcs_proxy, dest).run().downloaded_files == 0  # size and mtime look untouched
    r = _stager(gcs_proxy, dest, rehash=True).run()
    assert r.downloaded_files == 1 and _staged(dest) == objects


def test_an_object_changed_in_the_bucket_is_downloaded_again_and_a_deleted_one_removed(gcs_proxy, tmp_path: Path) -> None:
    objects = _objects(gcs_proxy)
    dest = tmp_path / "d"
    _stager(gcs_proxy, dest).run()
    bucket = gcs_proxy.client(direct=True).bucket(gcs_proxy.bucket)
    bucket.blob("data/part-1.bin").upload_from_string(b"new generation")  # same name, new generation
    bucket.blob("data/part-3.bin").delete()
    n = len(_downloads(gcs_proxy))
    r = _stager(gcs_proxy, dest).run()
    assert _downloads(gcs_proxy)[n:] == ["data/part-1.bin"]
    assert (r.downloaded_files, r.removed_files) == (1, 1)
    objects["part-1.bin"] = b"new generation"
    del objects["part-3.bin"]
    assert _staged(dest) == objects


def test_a_403_while_the_grant_propagates_is_retried_then_succeeds(gcs_proxy, tmp_path: Path) -> None:
    objects = _objects(gcs_proxy)
    gcs_proxy.proxy.add("GET", r"/o\?", "status", status=403, times=3)  # the listing, thrice
    gcs_proxy.proxy.add("GET", r"alt=media.* object=data/part-1.bin$", "status", status=403, times=1)
    r = _stager(gcs_proxy, tmp_path / "d", forbidden_retry_s=30).run()
    assert r.downloaded_files == 5 and _staged(tmp_path / "d") == objects
    assert len(gcs_proxy.proxy.seen("GET", r"/o\?")) >= 4


def test_a_403_that_never_ends_fails_after_the_bound(gcs_proxy, tmp_path: Path) -> None:
    _objects(gcs_proxy)
    gcs_proxy.proxy.add("GET", r"/o\?", "status", status=403, times=None)
    t0 = time.monotonic()
    with pytest.raises(StagingError, match="403"):
        _stager(gcs_proxy, tmp_path / "d", forbidden_retry_s=0.5).run()
    assert time.monotonic() - t0 < GUARD_S


def test_dropped_connections_and_503s_are_retried(gcs_proxy, tmp_path: Path) -> None:
    objects = _objects(gcs_proxy)
    gcs_proxy.proxy.add("GET", r"alt=media.* object=data/sub/dir/part-2.bin$", "drop", times=2)
    gcs_proxy.proxy.add("GET", r"alt=media.* object=data/part-1.bin$", "status", status=503, times=2)
    assert _stager(gcs_proxy, tmp_path / "d").run().downloaded_files == 5
    assert _staged(tmp_path / "d") == objects


def test_large_objects_come_in_verified_slices(gcs_proxy, tmp_path: Path) -> None:
    data = random.Random(3).randbytes((3 << 20) + 12345)
    gcs_proxy.client(direct=True).bucket(gcs_proxy.bucket).blob("data/big.bin").upload_from_string(data)
    r = _stager(gcs_proxy, tmp_path / "d", slice_bytes=1 << 20, parallel=4).run()
    assert r.downloaded_bytes == len(data) and (tmp_path / "d" / "big.bin").read_bytes() == data
    assert len(_downloads(gcs_proxy)) == 4  # four ranged GETs
    entry = json.loads((tmp_path / "d" / STATE_DIR / MANIFEST).read_text().splitlines()[0])
    assert entry["crc32c"] == crc32c_b64(google_crc32c.value(data))


def test_the_ledger_gets_a_staging_event(gcs_proxy, tmp_path: Path) -> None:
    _objects(gcs_proxy)
    proc = subprocess.run([sys.executable, "-m", "trainer", "stage", "--from", f"gs://{gcs_proxy.bucket}/data",
                           "--to", str(tmp_path / "d"), "--run-dir", str(tmp_path / "run")],
                          env={**os.environ, **gcs_proxy.env, "PYTHONPATH": str(REPO)}, cwd=REPO,
                          capture_output=True, text=True, timeout=GUARD_S)
    assert proc.returncode == 0, proc.stderr
    events = read_events(tmp_path / "run" / LEDGER_DIR / LEDGER_FILE)
    assert [e["event"] for e in events] == ["staging"]
    assert events[0]["ok"] is True and events[0]["downloaded_files"] == 5
    assert report(events).staging_s > 0


@pytest.mark.parametrize("case", ["bad-uri", "empty-prefix", "unsafe-name", "dest-is-a-file", "conflict"])
def test_bad_input_exits_2_with_one_clear_line(gcs_proxy, tmp_path: Path, case: str) -> None:
    bucket = gcs_proxy.client(direct=True).bucket(gcs_proxy.bucket)
    source, dest = f"gs://{gcs_proxy.bucket}/data", tmp_path / "d"
    if case == "bad-uri":
        source = "s3://nope/x"
    elif case == "unsafe-name":
        bucket.blob("data/x/./y").upload_from_string(b"x")
    elif case == "dest-is-a-file":
        bucket.blob("data/a").upload_from_string(b"x")
        dest.write_text("a file")
    elif case == "conflict":
        bucket.blob("data/a").upload_from_string(b"x")
        bucket.blob("data/a/b").upload_from_string(b"y")
    proc = subprocess.run([sys.executable, "-m", "trainer", "stage", "--from", source, "--to", str(dest),
                           "--run-dir", str(tmp_path / "run")],
                          env={**os.environ, **gcs_proxy.env, "PYTHONPATH": str(REPO)}, cwd=REPO,
                          capture_output=True, text=True, timeout=GUARD_S)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("command line: ")]
    assert len(lines) == 1 and "allowed:" in lines[0], proc.stderr
    assert not (dest / "x").exists()
    failed = read_events(tmp_path / "run" / LEDGER_DIR / LEDGER_FILE)
    assert failed[0]["event"] == "staging" and failed[0]["ok"] is False


def test_a_dataset_larger_than_the_disk_is_refused_before_downloading(gcs_proxy, small_fs) -> None:
    fs = small_fs("data", 1 << 20)
    gcs_proxy.client(direct=True).bucket(gcs_proxy.bucket).blob("data/big").upload_from_string(b"x" * (2 << 20))
    with pytest.raises(StagingInputError, match="GB free"):
        _stager(gcs_proxy, fs.path).run()
    assert _downloads(gcs_proxy) == []


def test_health_answers_while_staging() -> None:
    now = [0.0]
    h = StagingHealth(stall_timeout_s=10, clock=lambda: now[0])
    assert h.answer() == "starting"
    h.progress()
    now[0] = 9.0
    assert h.answer() == "ok staging"
    now[0] = 20.0
    assert h.answer() == "stalled"


def _free_port() -> int:
    from drill.net import free_port

    return free_port()
