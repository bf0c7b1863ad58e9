"""Webdataset shards streamed from the bucket (``trainer.data.bucket_shards``), with the real
google-cloud-storage client against gcp-storage-emulator: the samples a local copy gives, in the
same order, through data workers and resumes; a 503 or a reset mid-shard changes nothing; a missing
shard is one line."""
from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from trainer import retry
from trainer.data import bucket_shards
from trainer.data.streaming import Stream, StreamError
from tests.trainer.data.stream_support import read_in_pieces

SHARDS, PER_SHARD = 4, 10
PREFIX = "data"
#: Retries without waiting: the faults here are one-off.
NO_WAIT = retry.Policy(first_s=0.0, cap_s=0.0, jitter=0.0, attempts=5)


def _write(directory: Path) -> list[Path]:
    import webdataset as wds

    directory.mkdir(parents=True, exist_ok=True)
    with wds.ShardWriter(str(directory / "shard-%06d.tar"), maxcount=PER_SHARD, verbose=0) as sink:
        for i in range(SHARDS * PER_SHARD):
            sink.write({"__key__": f"{i:08d}", "x.bin": i.to_bytes(4, "little") * 300})  # 1.2 KB a sample
    return sorted(directory.glob("shard-*.tar"))


@pytest.fixture
def local(tmp_path: Path) -> list[Path]:
    return _write(tmp_path / "shards")


def _upload(client: Any, bucket: str, files: list[Path]) -> str:
    for f in files:
        client.bucket(bucket).blob(f"{PREFIX}/{f.name}").upload_from_filename(str(f))
    return f"gs://{bucket}/{PREFIX}/shard-{{000000..{len(files) - 1:06d}}}.tar"


@pytest.fixture(autouse=True)
def _restore() -> Iterator[None]:
    """Each test's own client (its emulator) and settings; webdataset's table as it was."""
    gopen = importlib.import_module("webdataset.gopen")
    scheme = gopen.gopen_schemes["gs"]
    settings = dataclasses.replace(bucket_shards._settings)
    bucket_shards._clients.clear()
    yield
    gopen.gopen_schemes["gs"] = scheme
    bucket_shards._settings = settings
    bucket_shards._clients.clear()


def _dataset(urls: list[str]) -> Any:
    import webdataset as wds

    return (wds.WebDataset(urls, shardshuffle=False, nodesplitter=wds.split_by_node,
                           workersplitter=wds.split_by_worker, empty_check=False)
            .map(lambda s: (torch.tensor([int(s["__key__"])]),
                            torch.frombuffer(bytearray(s["x.bin"]), dtype=torch.int32).clone())))


def _read(urls: list[str], workers: int = 0, batches: int = SHARDS * PER_SHARD // 4) -> list[int]:
    s = Stream(_dataset(urls), batch_size=4, workers=workers, device=torch.device("cpu"))
    try:
        out = []
        for _ in range(batches):
            keys, data = s.next()
            assert torch.equal(data, keys.view(-1, 1).expand(-1, 300).to(torch.int32))  # every byte as written
            out += keys.view(-1).tolist()
        return out
    finally:
        s.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_shards_in_the_bucket_stream_what_the_local_copy_gives(gcs_emulator: Any, local: list[Path],
                                                                workers: int) -> None:
    spec = _upload(gcs_emulator.client, gcs_emulator.emulator.bucket, local)
    bucket_shards.register(chunk_bytes=4096)  # a shard (~26 KB) in several ranged reads
    urls = bucket_shards.urls(spec)
    assert urls == [f"gs://{gcs_emulator.emulator.bucket}/{PREFIX}/{f.name}" for f in local]
    want = _read([str(f) for f in local], workers)
    assert sorted(want) == list(range(SHARDS * PER_SHARD))
    assert _read(urls, workers) == want  # the same samples in the same order: no local copy made


def test_a_stream_from_the_bucket_resumed_mid_epoch_reads_what_an_uninterrupted_one_reads(
        gcs_emulator: Any, local: list[Path]) -> None:
    urls = bucket_shards.urls(_upload(gcs_emulator.client, gcs_emulator.emulator.bucket, local))
    bucket_shards.register(chunk_bytes=4096)
    cpu = torch.device("cpu")

    whole, _ = read_in_pieces(lambda: Stream(_dataset(urls), batch_size=4, workers=2, device=cpu), (17,))
    # 10 batches an epoch: the last resume crosses into the next epoch.
    got, _ = read_in_pieces(lambda: Stream(_dataset(urls), batch_size=4, workers=2, device=cpu), (3, 5, 9))
    assert got == whole


def test_a_503_and_a_reset_mid_shard_are_retried_from_the_offset_and_change_nothing(
        gcs_proxy: Any, local: list[Path]) -> None:
    client = gcs_proxy.client(direct=True)
    urls = [f"gs://{gcs_proxy.bucket}/{PREFIX}/{f.name}" for f in local]
    _upload(client, gcs_proxy.bucket, local)
    bucket_shards.register(chunk_bytes=4096, policy=NO_WAIT)  # the client reaches the proxy (env)
    want = _read(urls)
    media = r"alt=media.* object={}/shard-00000{}\.tar$"
    fail = gcs_proxy.proxy.add("GET", media.format(PREFIX, 1), "status", status=503, after=2)  # its 3rd read
    reset = gcs_proxy.proxy.add("GET", media.format(PREFIX, 2), "drop", after=4)  # its 5th read
    assert _read(urls) == want
    assert (fail.hits, reset.hits) == (1, 1)  # both faults happened mid-shard, and were got over
    assert fail.seen > 3 and reset.seen > 5  # ... with reads of the same shard after them


def test_a_shard_rewritten_while_it_is_read_is_an_error_not_a_mix(gcs_proxy: Any, local: list[Path]) -> None:
    client = gcs_proxy.client(direct=True)
    urls = [f"gs://{gcs_proxy.bucket}/{PREFIX}/{f.name}" for f in local]
    _upload(client, gcs_proxy.bucket, local)
    bucket_shards.register(chunk_bytes=4096, policy=NO_WAIT)
    f = bucket_shards.gopen_gcs(urls[0])
    head = f.read(5000)
    client.bucket(gcs_proxy.bucket).blob(f"{PREFIX}/shard-000000.tar").upload_from_filename(str(local[1]))
    with pytest.raises(bucket_shards.ShardChanged, match=r"changed while it was read \(412\)"):
        f.read()
    assert head == local[0].read_bytes()[:5000]


def test_reads_that_keep_failing_past_the_retries_are_a_failure_not_bad_input(gcs_proxy: Any,
                                                                            local: list[Path]) -> None:
    client = gcs_proxy.client(direct=True)
    urls = [f"gs://{gcs_proxy.bucket}/{PREFIX}/{f.name}" for f in local]
    _upload(client, gcs_proxy.bucket, local)
    bucket_shards.register(chunk_bytes=4096, policy=dataclasses.replace(NO_WAIT, attempts=3))
    down = gcs_proxy.proxy.add("GET", rf"alt=media.* object={PREFIX}/shard-000003\.tar$", "status", status=503,
                               times=None)
    with pytest.raises(bucket_shards.ShardError) as e:
        _read(urls, workers=2)  # met in a data worker
    assert not isinstance(e.value, StreamError)  # exit 1 (a restart reads again), not 2
    assert str(e.value).startswith(f"gs://{gcs_proxy.bucket}/{PREFIX}/shard-000003.tar bytes 0-4095: ")
    assert "(attempt 3, attempts)" in str(e.value) and "\n" not in str(e.value)
    assert down.hits == 3


def test_a_missing_shard_is_one_line(gcs_emulator: Any, local: list[Path]) -> None:
    bucket = gcs_emulator.emulator.bucket
    _upload(gcs_emulator.client, bucket, local)
    bucket_shards.register(chunk_bytes=4096, policy=NO_WAIT)
    with pytest.raises(StreamError) as e:  # checked before anything trains
        bucket_shards.urls(f"gs://{bucket}/{PREFIX}/shard-{{000000..000005}}.tar")
    assert str(e.value) == (f"data URL: 2 of 6 shards missing in gs://{bucket}/{PREFIX}/: "
                            f"gs://{bucket}/{PREFIX}/shard-000004.tar, gs://{bucket}/{PREFIX}/shard-000005.tar")
    urls = bucket_shards.urls(f"gs://{bucket}/{PREFIX}/shard-{{000000..000003}}.tar")
    gcs_emulator.client.bucket(bucket).blob(f"{PREFIX}/shard-000001.tar").delete()  # gone after the check
    with pytest.raises(StreamError) as e:
        _read(urls, workers=2)  # met in a data worker, told by the main process
    assert str(e.value) == f"gs://{bucket}/{PREFIX}/shard-000001.tar: no such object in the bucket"


def test_urls_refuses_what_is_not_a_bucket_object(gcs_emulator: Any) -> None:
    with pytest.raises(StreamError, match="not a gs:// URI"):
        bucket_shards.urls("/local/shard-{0..3}.tar")
    with pytest.raises(StreamError, match="names no object"):
        bucket_shards.urls(f"gs://{gcs_emulator.emulator.bucket}/")
