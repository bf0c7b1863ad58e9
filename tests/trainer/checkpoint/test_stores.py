"""trainer.checkpoint.stores: directory and GCS stores (real files, real client against the emulator)."""

from __future__ import annotations

import os
import random
import threading
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
    assert s.names("a/") == ["a/b/y.bin", "a/x.bin"]
    assert s.names("") == ["a/b/y.bin", "a/x.bin", "top"]
    assert s.sizes("a/") == {"a/b/y.bin": 3, "a/x.bin": 3}
    dst = tmp_path / "out" / "copy.bin"
    s.get_file("a/b/y.bin", dst)
    assert dst.read_bytes() == b"two"
    with pytest.raises(KeyError):
        s.get_bytes("nope")
    with pytest.raises(KeyError):
        s.get_file("nope", tmp_path / "n")
    s.delete_prefix("a/")
    assert s.names("") == ["top"]
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
    assert s.names("") == ["real"]
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
                "/local/path", "gs://bucket/a//b", "gs://b\u00fccket/x", "gs://bucket\u0663/x"]:
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
    assert s.names("step-1/") == ["step-1/a", "step-1/big.bin"]
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
    assert other.names("") == []
    s.delete_prefix("step-1/")
    assert s.names("") == []


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
    assert s.names("") == []


# ---- every stream: sliced downloads and composite uploads, through the fault proxy ----------
# Objects from 1 MiB up move in 4 streams here (64 MiB in a run), parts of 256 KiB chunks.

def _streamed(gcs_proxy, **kw) -> GcsStore:
    s = GcsStore(gcs_proxy.uri, client=gcs_proxy.client(), streams=4, initial_backoff_s=0.01, **kw)
    s.PARALLEL_MIN_BYTES = 1 << 20
    s.CHUNK_SIZE = 256 << 10
    return s


def _source(tmp_path: Path, size: int = (3 << 20) + 12345, seed: int = 3) -> Path:
    src = tmp_path / f"src-{seed}.bin"
    src.write_bytes(random.Random(seed).randbytes(size))
    return src


def _parts(gcs_proxy) -> list[str]:
    """Every temporary part in the bucket, as the emulator itself lists them."""
    return [b.name for b in gcs_proxy.client(direct=True).list_blobs(gcs_proxy.bucket) if "/.tmp-parts/" in b.name]


def test_a_large_object_is_uploaded_in_parts_composed_and_downloaded_in_slices(gcs_proxy, tmp_path: Path) -> None:
    s, src = _streamed(gcs_proxy), _source(tmp_path, size=(34 << 20) + 12345)  # parts over 8 MiB: resumable
    failed = gcs_proxy.proxy.add("POST", r"object=.*/\.tmp-parts/.*/02$", "status", status=503)  # one part: once
    s.put_file(src, "step-1/state.bin")
    p = gcs_proxy.proxy
    assert failed.hits == 1  # and retried alone
    assert len(p.seen("POST", r"/compose\?ifGenerationMatch=0.* object=.*step-1/state.bin$")) == 1
    assert len({x.path.rpartition("/")[2] for x in p.seen("POST", r"object=.*/\.tmp-parts/")}) == 4
    assert len(p.seen("PUT", r"upload_id=")) > 4 * 8  # the parts, resumable, in 256 KiB chunks
    stored = gcs_proxy.client(direct=True).bucket(gcs_proxy.bucket).blob(s._object("step-1/state.bin"))
    assert stored.download_as_bytes() == src.read_bytes()
    assert _parts(gcs_proxy) == [] and s.names("") == ["step-1/state.bin"]

    out = tmp_path / "dl" / "state.bin"
    s.get_file("step-1/state.bin", out)
    assert out.read_bytes() == src.read_bytes()
    slices = p.seen("GET", r"alt=media.*ifGenerationMatch=\d+.* object=.*step-1/state.bin$")
    assert len(slices) == 4 and all(x.outcome == "forwarded 206" for x in slices)
    assert sorted(os.listdir(out.parent)) == ["state.bin"]  # no temporary file left

    mem = random.Random(4).randbytes(2 << 20)  # an emergency save from host memory
    s.put_memory("step-1/memory.bin", memoryview(bytearray(mem)))
    assert s.get_bytes("step-1/memory.bin") == mem and _parts(gcs_proxy) == []


def test_a_failed_slice_is_retried_alone_and_a_small_object_stays_one_request(gcs_proxy, tmp_path: Path) -> None:
    s, src = _streamed(gcs_proxy), _source(tmp_path)
    s.put_file(src, "big")
    s.put_bytes("small", b"x" * 1000)
    gcs_proxy.proxy.add("GET", r"alt=media.* object=.*/big$", "status", status=503, times=1)
    s.get_file("big", tmp_path / "big")
    s.get_file("small", tmp_path / "small")
    assert (tmp_path / "big").read_bytes() == src.read_bytes() and (tmp_path / "small").read_bytes() == b"x" * 1000
    media = gcs_proxy.proxy.seen("GET", r"alt=media")
    assert [x.outcome for x in media if x.path.endswith("/big")].count("status 503") == 1
    assert len([x for x in media if x.path.endswith("/big")]) == 5  # 4 slices, one of them twice
    assert len([x for x in media if x.path.endswith("/small")]) == 1


def test_an_object_replaced_during_a_sliced_download_fails_it_with_412_not_a_mixed_file(gcs_proxy, tmp_path) -> None:
    s, src = _streamed(gcs_proxy), _source(tmp_path)
    s.put_file(src, "obj")
    held = gcs_proxy.proxy.add("GET", r"alt=media.* object=.*/obj$", "stall", times=1, after=2)
    out = tmp_path / "dl" / "obj"
    errors: list[BaseException] = []

    def download() -> None:
        try:
            s.get_file("obj", out)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=download)
    t.start()
    assert gcs_proxy.proxy.wait_stalled(held)
    # Another writer replaces it (same size, other bytes) while one slice is in flight.
    other = _source(tmp_path, size=src.stat().st_size, seed=9).read_bytes()
    gcs_proxy.client(direct=True).bucket(gcs_proxy.bucket).blob(s._object("obj")).upload_from_string(other)
    gcs_proxy.proxy.release(held)
    t.join(60)
    assert len(errors) == 1 and isinstance(errors[0], gexc.PreconditionFailed), errors
    assert not out.exists() and os.listdir(out.parent) == []


def test_a_composite_upload_is_create_only_and_a_lost_compose_answer_counts_when_identical(gcs_proxy, tmp_path,
                                                                                           logwatch) -> None:
    s, src = _streamed(gcs_proxy), _source(tmp_path)
    gcs_proxy.proxy.add("POST", r"/compose\?", "after-forward", status=503)  # composed; the answer lost
    s.put_file(src, "k")
    assert "identical content" in logwatch.text()
    s.put_file(src, "k")  # again, identical: done
    with pytest.raises(FileExistsError):
        s.put_file(_source(tmp_path, seed=5), "k")
    assert s.get_bytes("k") == src.read_bytes()
    assert [x.outcome for x in gcs_proxy.proxy.seen("POST", "/compose")][-1] == "precondition 412"
    assert _parts(gcs_proxy) == []  # none left by the refused upload either


def test_a_composed_object_that_is_not_its_parts_is_refused_and_deleted(gcs_proxy, tmp_path: Path) -> None:
    s = _streamed(gcs_proxy)
    s.put_bytes("p0", b"a" * 1000)
    s.put_bytes("p1", b"b" * 1000)
    gens = {k: o.generation for k, o in s.objects("p").items()}
    from trainer.checkpoint import crc32c
    from trainer.checkpoint.gcs_streams import CompositeMismatch

    wrong = crc32c.b64(crc32c.of_bytes(b"b" * 1000 + b"a" * 1000))  # what the parts in the other order make
    with pytest.raises(CompositeMismatch):
        s._compose("whole", [("p0", gens["p0"]), ("p1", gens["p1"])], 2000, wrong, generation=0)
    assert "whole" not in s.names("")


def _upload_stopped(s: GcsStore, src: Path, held, gcs_proxy, stop) -> BaseException:
    """Upload ``src`` while the proxy holds one part; ``stop()`` once it does, then let it go."""
    errors: list[BaseException] = []

    def upload() -> None:
        try:
            s.put_file(src, "stopped")
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=upload)
    t.start()
    assert gcs_proxy.proxy.wait_stalled(held)
    stop()
    gcs_proxy.proxy.release(held)
    t.join(60)
    assert gcs_proxy.proxy.wait_settled(held)  # the part let go lands after its client gave up
    assert len(errors) == 1
    return errors[0]


def test_an_aborted_composite_upload_composes_nothing_and_leaves_its_parts_to_the_clean_up(gcs_proxy, tmp_path) -> None:
    s, src = _streamed(gcs_proxy), _source(tmp_path)
    held = gcs_proxy.proxy.add("*", r"object=.*/\.tmp-parts/.*/01$", "stall")
    abort = threading.Event()
    real = s.put_file
    s.put_file = lambda *a, **kw: _aborting(s, abort, real, *a, **kw)  # type: ignore[method-assign]
    assert isinstance(_upload_stopped(s, src, held, gcs_proxy, abort.set), UploadAborted)
    assert gcs_proxy.proxy.seen("POST", "/compose") == []
    assert s.names("") == [] and _parts(gcs_proxy)  # parts left, never listed
    removed = s.clean_temporaries()
    assert removed and all(k.startswith(".tmp-parts/stopped.") for k in removed)
    assert _parts(gcs_proxy) == []


def _aborting(s: GcsStore, abort: threading.Event, fn, *a, **kw):
    with s.aborting(abort):
        return fn(*a, **kw)


def test_a_composite_upload_past_its_deadline_composes_nothing(gcs_proxy, tmp_path: Path) -> None:
    s, src = _streamed(gcs_proxy), _source(tmp_path)
    held = gcs_proxy.proxy.add("*", r"object=.*/\.tmp-parts/.*/01$", "stall")
    deadline = time.monotonic() + 5.0
    real = s.put_file

    def bounded(*a, **kw):
        with s.deadline(deadline):
            return real(*a, **kw)

    def past_the_deadline() -> None:
        while time.monotonic() <= deadline:  # the condition itself, not a stand-in for one
            time.sleep(0.05)

    s.put_file = bounded  # type: ignore[method-assign]
    error = _upload_stopped(s, src, held, gcs_proxy, past_the_deadline)
    assert isinstance(error, UploadAborted) or is_retryable(error), error  # the part's request timed out
    assert gcs_proxy.proxy.seen("POST", "/compose") == []
    assert s.names("") == []
    s.clean_temporaries()
    assert _parts(gcs_proxy) == []


_EXITS = """
import sys, threading
from pathlib import Path
from trainer.checkpoint.stores import GcsStore
s = GcsStore(sys.argv[1], streams=4)
s.PARALLEL_MIN_BYTES, s.CHUNK_SIZE = 1 << 20, 256 << 10
threading.Thread(target=s.put_file, args=(Path(sys.argv[2]), "k"), daemon=True).start()
sys.stdin.readline()
"""


def test_a_stream_stuck_in_a_request_never_holds_the_process_at_its_exit(gcs_proxy, tmp_path: Path) -> None:
    # An emergency upload's thread is abandoned at its deadline and the trainer exits: its streams
    # must not keep the process alive (an executor's threads are joined at exit).
    import subprocess
    import sys

    held = gcs_proxy.proxy.add("*", r"object=.*/\.tmp-parts/.*/01$", "stall")
    proc = subprocess.Popen([sys.executable, "-c", _EXITS, gcs_proxy.uri, str(_source(tmp_path))],
                            env={**os.environ, **gcs_proxy.env, "PYTHONPATH": str(Path(__file__).resolve().parents[3])},
                            stdin=subprocess.PIPE, text=True)
    try:
        assert gcs_proxy.proxy.wait_stalled(held)
        proc.communicate("exit\n", timeout=60)
        assert proc.returncode == 0 and held.held == 1  # gone while its request is still held
    finally:
        proc.kill()
        gcs_proxy.proxy.release(held)


def test_the_clean_up_deletes_parts_only_under_the_writer_lease_and_never_raises(gcs_proxy, tmp_path, logwatch) -> None:
    s = _streamed(gcs_proxy)
    left = gcs_proxy.client(direct=True).bucket(gcs_proxy.bucket).blob(s._object(".tmp-parts/k.abc/00"))
    left.upload_from_string(b"a part of an upload cut short")

    def not_ours() -> None:
        raise RuntimeError("the writer lease is another trainer's")

    s.guard = not_ours
    assert s.clean_temporaries() == [] and len(_parts(gcs_proxy)) == 1
    s.guard = None
    gcs_proxy.proxy.down()
    assert s.clean_temporaries() == [] and "the next start tries again" in logwatch.text()
    gcs_proxy.proxy.up()
    assert s.clean_temporaries() == [".tmp-parts/k.abc/00"] and _parts(gcs_proxy) == []
