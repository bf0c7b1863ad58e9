"""trainer.checkpoint.stores: directory and GCS stores (real files, real client against the emulator)."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest
from google.api_core import exceptions as gexc

from trainer.checkpoint.stores import DirStore, GcsStore, UploadAborted, is_retryable, parse_gcs_uri


def test_dirstore_roundtrip_and_listing(tmp_path: Path) -> None:
    s = DirStore(tmp_path / "root", "persistent")
    s.put_bytes("a/x.bin", b"one")
    s.put_bytes("a/b/y.bin", b"two")
    s.put_bytes("top", b"3")
    assert s.get_bytes("a/x.bin") == b"one"
    assert s.list("a/") == ["a/b/y.bin", "a/x.bin"]
    assert s.list("") == ["a/b/y.bin", "a/x.bin", "top"]
    assert s.sizes("a/") == {"a/b/y.bin": 3, "a/x.bin": 3}
    dst = tmp_path / "out" / "copy.bin"
    s.get_file("a/b/y.bin", dst)
    assert dst.read_bytes() == b"two"
    with pytest.raises(KeyError):
        s.get_bytes("nope")
    with pytest.raises(KeyError):
        s.get_file("nope", tmp_path / "n")
    s.delete_prefix("a/")
    assert s.list("") == ["top"]
    assert not (tmp_path / "root" / "a").exists()
    # No temporary or trash names are left behind after successful operations.
    assert not [p for p in (tmp_path / "root").rglob("*") if p.name.startswith((".tmp-", ".trash-"))]


def test_dirstore_create_only(tmp_path: Path) -> None:
    s = DirStore(tmp_path, "local")
    s.put_bytes("k", b"v1")
    s.put_bytes("k", b"v1")  # identical: idempotent
    with pytest.raises(FileExistsError):
        s.put_bytes("k", b"v2")
    assert s.get_bytes("k") == b"v1"
    s.put_bytes("k", b"v2", overwrite=True)
    assert s.get_bytes("k") == b"v2"
    src = tmp_path / "src.bin"
    src.write_bytes(b"payload")
    s.put_file(src, "f/p.bin")
    s.put_file(src, "f/p.bin")
    src.write_bytes(b"different")
    with pytest.raises(FileExistsError):
        s.put_file(src, "f/p.bin")
    assert s.get_bytes("f/p.bin") == b"payload"


def test_dirstore_hides_and_cleans_temporaries(tmp_path: Path) -> None:
    s = DirStore(tmp_path, "persistent")
    (tmp_path / ".tmp-step-00000001-abcd").mkdir()
    (tmp_path / ".tmp-step-00000001-abcd" / "manifest.json").write_text("{}")
    (tmp_path / ".trash-x").write_text("x")
    s.put_bytes("real", b"1")
    assert s.list("") == ["real"]
    assert sorted(s.clean_temporaries()) == [".tmp-step-00000001-abcd", ".trash-x"]
    assert sorted(os.listdir(tmp_path)) == ["real"]


@pytest.mark.parametrize("key", ["", "/abs", "a/../b", "a//b", "./a"])
def test_dirstore_rejects_bad_keys(tmp_path: Path, key: str) -> None:
    with pytest.raises(ValueError):
        DirStore(tmp_path, "local").put_bytes(key, b"x")


def test_parse_gcs_uri() -> None:
    assert parse_gcs_uri("gs://my-bucket/runs/exp1") == ("my-bucket", "runs/exp1")
    assert parse_gcs_uri("gs://my-bucket/runs/exp1/") == ("my-bucket", "runs/exp1")
    assert parse_gcs_uri("gs://my-bucket") == ("my-bucket", "")
    for bad in ["s3://b/x", "gs://", "gs://UPPER/x", "gs://a/x", "gs://b-/x", "gs://bucket/a/../b",
                "/local/path", "gs://bucket/a//b"]:
        with pytest.raises(ValueError):
            parse_gcs_uri(bad)


def test_retryable_classification() -> None:
    assert is_retryable(gexc.ServiceUnavailable("x"))
    assert is_retryable(gexc.TooManyRequests("x"))
    assert is_retryable(gexc.InternalServerError("x"))
    assert is_retryable(ConnectionError("x"))
    assert not is_retryable(gexc.PreconditionFailed("x"))
    assert not is_retryable(gexc.Forbidden("x"))
    assert not is_retryable(gexc.NotFound("x"))
    assert not is_retryable(UploadAborted("x"))


def test_gcs_roundtrip(gcs_emulator, tmp_path: Path) -> None:
    s = GcsStore(gcs_emulator.uri, client=gcs_emulator.client)
    s.put_bytes("step-1/a", b"alpha")
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom((GcsStore.CHUNK_SIZE >> 4) + 123))
    s.put_file(big, "step-1/big.bin")
    assert s.list("step-1/") == ["step-1/a", "step-1/big.bin"]
    assert s.sizes("step-")["step-1/big.bin"] == big.stat().st_size
    assert s.get_bytes("step-1/a") == b"alpha"
    out = tmp_path / "dl" / "big.bin"
    s.get_file("step-1/big.bin", out)
    assert out.read_bytes() == big.read_bytes()
    with pytest.raises(KeyError):
        s.get_bytes("step-1/missing")
    with pytest.raises(KeyError):
        s.get_file("step-1/missing", tmp_path / "m")
    assert not (tmp_path / "m").exists()
    # Another prefix in the same bucket is invisible.
    other = GcsStore(gcs_emulator.uri + "-other", client=gcs_emulator.client)
    assert other.list("") == []
    s.delete_prefix("step-1/")
    assert s.list("") == []


def test_gcs_retries_503_then_succeeds(faulty_gcs, gcs_emulator, logwatch) -> None:
    s = GcsStore(gcs_emulator.uri, client=faulty_gcs, initial_backoff_s=0.01)
    faulty_gcs.plan.add("upload", "*/k", "503", times=2)
    s.put_bytes("k", b"v")
    assert s.get_bytes("k") == b"v"
    assert faulty_gcs.plan.calls.count(("upload", s._object("k"))) == 3
    assert "retrying" in logwatch.text()


def test_gcs_uploads_leave_the_global_random_state_alone(faulty_gcs, gcs_emulator) -> None:
    # The global generator is part of the training process's exact-resume state; neither a
    # multipart upload (its boundary) nor a retry (its jitter) on a background thread may draw from it.
    s = GcsStore(gcs_emulator.uri, client=faulty_gcs, initial_backoff_s=0.01)
    faulty_gcs.plan.add("upload", "*/jitter", "503", times=2)
    random.seed(1234)
    before = random.getstate()
    s.put_bytes("jitter", b"v")
    assert faulty_gcs.plan.calls.count(("upload", s._object("jitter"))) == 3
    assert random.getstate() == before


def test_gcs_412_on_identical_object_counts_as_done(faulty_gcs, gcs_emulator, tmp_path, logwatch) -> None:
    # The upload reached the server but the response was lost; the retry gets 412.
    s = GcsStore(gcs_emulator.uri, client=faulty_gcs, initial_backoff_s=0.01)
    src = tmp_path / "p.bin"
    src.write_bytes(b"payload" * 1000)
    faulty_gcs.plan.add("upload", "*/obj", "412-after")
    s.put_file(src, "obj")
    assert s.get_bytes("obj") == src.read_bytes()
    assert "identical content" in logwatch.text()


def test_gcs_412_on_different_object_is_an_error(faulty_gcs, gcs_emulator, tmp_path) -> None:
    s = GcsStore(gcs_emulator.uri, client=faulty_gcs)
    s.put_bytes("obj", b"first")
    with pytest.raises(FileExistsError):
        s.put_bytes("obj", b"second")  # create-only, enforced by the wrapper like real GCS
    src = tmp_path / "f"
    src.write_bytes(b"other")
    with pytest.raises(FileExistsError):
        s.put_file(src, "obj")
    assert s.get_bytes("obj") == b"first"
    s.put_bytes("obj", b"first")  # identical: done
    s.put_bytes("obj", b"second", overwrite=True)
    assert s.get_bytes("obj") == b"second"


def test_gcs_gives_up_when_unreachable(gcs_emulator, logwatch) -> None:
    s = GcsStore(gcs_emulator.uri, client=gcs_emulator.client, retry_timeout_s=1.0,
                 initial_backoff_s=0.05, request_timeout_s=2.0)
    gcs_emulator.emulator.stop()
    with pytest.raises(Exception) as ei:
        s.put_bytes("k", b"v")
    assert is_retryable(ei.value)
    assert "retrying" in logwatch.text()


def test_gcs_deadline_and_abort_stop_uploads(gcs_emulator, tmp_path) -> None:
    s = GcsStore(gcs_emulator.uri, client=gcs_emulator.client)
    src = tmp_path / "f"
    src.write_bytes(b"x" * 1000)
    with s.deadline(time.monotonic() - 1), pytest.raises(UploadAborted):
        s.put_file(src, "late")
    s.abort.set()
    with pytest.raises(UploadAborted):
        s.put_file(src, "aborted")
    s.abort.clear()
    assert s.list("") == []
