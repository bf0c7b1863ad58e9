"""Webdataset shards read straight from the bucket: no local copy, for data larger than the disk.

``urls("gs://BUCKET/PREFIX/shard-{000000..000007}.tar")`` expands the braces (webdataset's own
``braceexpand``), lists the objects once and refuses a missing shard with one line
(``StreamError``: exit 2) before anything trains; ``register()`` plugs :func:`gopen_gcs` into
webdataset's opener table (``webdataset.gopen.gopen_schemes["gs"]``, the library's seam for a URL
scheme), so that ``webdataset.WebDataset(urls, ...)`` reads ``gs://`` shards exactly as it reads
local ones::

    from trainer.data import bucket_shards
    shard_urls = bucket_shards.urls("gs://my-data/train/shard-{000000..000999}.tar")
    bucket_shards.register()
    dataset = wds.WebDataset(shard_urls, shardshuffle=False, nodesplitter=wds.split_by_node,
                             workersplitter=wds.split_by_worker)

How a shard is read:

- through the real ``google-cloud-storage`` client the trainer's storage tiers use
  (``trainer.checkpoint.stores.default_gcs_client``: the VM's service account; the emulator when
  ``STORAGE_EMULATOR_HOST`` is set), one per process: each data worker (forked) makes its own, never
  sharing the parent's pooled connections. Not ``gsutil`` or ``gcloud`` (webdataset's default for
  ``gs://``), which a VM image need not have;
- **streamed**: ranged reads of ``chunk_bytes`` (8 MiB by default) as tarfile asks for bytes, so a
  worker holds one chunk of a shard, never the shard;
- **pinned** to the generation seen when the shard was opened (``ifGenerationMatch``): a shard
  rewritten while it is read is an error, not a silent mix of two versions;
- **retried from the byte offset**: each ranged read is one call retried by ``trainer.retry``'s
  rule (``STORAGE``: 408, 429, 5xx, connection resets and timeouts, jittered backoff for five
  minutes), then the read goes on from the first byte it does not have yet. A 403 is retried
  within ``IAM_GRANT``'s grace (ten minutes): a VM can start before its read grant on the data
  bucket has propagated, and no staging waited for it;
- **a missing shard** (404) is ``ShardMissing`` and a shard rewritten while read ``ShardChanged``,
  both ``StreamError`` (bad input, exit 2: a restart would meet them again); reads that still fail
  past the retries are ``ShardError`` (exit 1: the next start reads again). Each is one line naming
  the object, also when a data worker met it.

Resume exactness is ``trainer.data.streaming``'s: the stream is a function of the shard list and
its split, so a resume replays the epoch from the bucket and drops the batches before its position.
This holds as long as the shards do not change between runs (keep a dataset's objects immutable;
write a new prefix for new data).
"""
from __future__ import annotations

import dataclasses
import io
import logging
import os
import posixpath
import threading
from typing import Any, Callable

from trainer import retry
from trainer.checkpoint.stores import default_gcs_client, is_retryable, parse_gcs_uri
from trainer.data.streaming import StreamError, worker_line

log = logging.getLogger("trainer.data")

#: Bytes of one ranged read.
CHUNK_BYTES = 8 << 20
#: One read's HTTP timeout: (connect, read) seconds.
REQUEST_TIMEOUT = (20.0, 120.0)
#: Transient errors as ``STORAGE`` retries them; a 403 within the IAM grant's grace.
POLICY = dataclasses.replace(retry.STORAGE, grace_s=retry.IAM_GRANT.grace_s,
                             grace_first_s=retry.IAM_GRANT.grace_first_s, grace_cap_s=retry.IAM_GRANT.grace_cap_s)


class _OneLine(Exception):
    """One line, also when raised in a data worker (``streaming.worker_line``), and webdataset
    appends the URL to ``args``."""

    def __init__(self, message: str) -> None:
        super().__init__(worker_line(message))

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class ShardMissing(_OneLine, StreamError):
    """A shard named by the data URL is not in the bucket (bad input: exit 2)."""


class ShardChanged(_OneLine, StreamError):
    """A shard was rewritten while it was read (bad input: exit 2; the data must not change)."""


class ShardError(_OneLine):
    """A shard could not be read: transient errors past the retries, a 403 past the grant's grace,
    another 4xx (exit 1: a restart reads it again)."""


@dataclasses.dataclass
class _Settings:
    client_factory: Callable[[], Any] = default_gcs_client
    chunk_bytes: int = CHUNK_BYTES
    policy: retry.Policy = POLICY


_settings = _Settings()
_clients: dict[int, Any] = {}  # pid -> this process's client
_lock = threading.Lock()


def _after_fork() -> None:  # a data worker: a lock some other thread held at the fork is not held here
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork)


def register(*, client_factory: Callable[[], Any] | None = None, chunk_bytes: int | None = None,
             policy: retry.Policy | None = None) -> None:
    """Make webdataset open ``gs://`` URLs with :func:`gopen_gcs` (in this process and the data
    workers it forks later). ``client_factory``: makes one process's client (default: the
    trainer's); ``chunk_bytes``: bytes of one ranged read; ``policy``: the retries (tests)."""
    import importlib

    gopen = importlib.import_module("webdataset.gopen")  # the module (the package exports a function by its name)
    if chunk_bytes is not None and chunk_bytes < 1:
        raise ValueError(f"chunk_bytes {chunk_bytes}; allowed: 1 or more")
    with _lock:
        if client_factory is not None and client_factory is not _settings.client_factory:
            _settings.client_factory = client_factory
            _clients.clear()
        if chunk_bytes is not None:
            _settings.chunk_bytes = chunk_bytes
        if policy is not None:
            _settings.policy = policy
    gopen.gopen_schemes["gs"] = gopen_gcs


def _client() -> Any:
    pid = os.getpid()
    with _lock:
        c = _clients.get(pid)
        if c is None:
            _clients.clear()  # a forked worker: the parent's client (and its sockets) is not ours
            c = _clients[pid] = _settings.client_factory()
        return c


def _call(what: str, fn: Callable[[], Any]) -> Any:
    """``fn()`` under the retry policy; a final error becomes ``ShardError`` (404: ``ShardMissing``)."""
    from google.api_core import exceptions as gexc

    def said(t: retry.Try) -> None:
        log.warning("event=stream_retry what=%r attempt=%d error=%r retry_in_s=%.1f", what, t.attempt,
                    f"{type(t.error).__name__}: {str(t.error)[:200]}", t.wait_s)

    def gave_up(t: retry.Try) -> None:
        if isinstance(t.error, gexc.NotFound):
            raise ShardMissing(f"{what}: no such object in the bucket (404)") from None
        if isinstance(t.error, gexc.PreconditionFailed):
            raise ShardChanged(f"{what}: the object changed while it was read (412): shards must not be rewritten "
                             "during a run") from None
        if t.why == "forbidden":
            raise ShardError(f"{what}: still HTTP 403 after {t.elapsed_s:.0f} s: this VM's service account cannot "
                             "read the data bucket (it needs roles/storage.objectViewer on it)") from None
        raise ShardError(f"{what}: {type(t.error).__name__}: {str(t.error)[:300]} "
                         f"(attempt {t.attempt}, {t.why})") from None

    return retry.Retry(_settings.policy, transient=is_retryable, on_retry=said, on_give_up=gave_up).call(fn, what)


class _Ranged(io.RawIOBase):
    """A read-only file over one object: each ``readinto`` is one ranged read, retried, going on
    from the first byte not yet read."""

    def __init__(self, url: str, blob: Any, size: int, generation: int | None) -> None:
        self.url, self.blob, self.size, self.generation = url, blob, size, generation
        self.name = url  # in webdataset's messages, which name the open file
        self.pos = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        if self.pos >= self.size:
            return 0
        n = min(len(b), self.size - self.pos)
        start, end = self.pos, self.pos + n - 1

        def read() -> bytes:
            data = self.blob.download_as_bytes(start=start, end=end, raw_download=True, checksum=None,
                                               if_generation_match=self.generation, retry=None,
                                               timeout=REQUEST_TIMEOUT)
            if not data:  # an answer cut before its body: another try, from the same offset
                raise ConnectionResetError(f"no bytes at offset {start}")
            return bytes(data[:n])

        data = _call(f"{self.url} bytes {start}-{end}", read)
        b[:len(data)] = data
        self.pos += len(data)
        return len(data)

    def __repr__(self) -> str:
        return f"<shard {self.url} at {self.pos}/{self.size}>"


def gopen_gcs(url: str, mode: str = "rb", bufsize: int = 8192, **kw: Any) -> io.BufferedReader:
    """webdataset's opener for ``gs://BUCKET/NAME``: the object, streamed (see the module docstring)."""
    if mode != "rb":
        raise ValueError(f"{url}: only reading is supported from the bucket (mode {mode!r})")
    bucket_name, name = parse_gcs_uri(url)
    if not name:
        raise ShardMissing(f"{url}: names no object")
    bucket = _client().bucket(bucket_name)
    blob = _call(f"open {url}", lambda: bucket.get_blob(name, retry=None, timeout=REQUEST_TIMEOUT))
    if blob is None:
        raise ShardMissing(f"{url}: no such object in the bucket")
    raw = _Ranged(url, blob, int(blob.size or 0), blob.generation)
    return io.BufferedReader(raw, buffer_size=_settings.chunk_bytes)


def urls(spec: str | list[str]) -> list[str]:
    """The shards a data URL names, braces expanded, each checked to be in the bucket (one listing
    per folder; ``StreamError`` names the missing ones). ``spec``: a URL or a list of URLs."""
    import braceexpand  # type: ignore[import-untyped]  # webdataset's own dependency

    out: list[str] = []
    for s in [spec] if isinstance(spec, str) else list(spec):
        out += list(braceexpand.braceexpand(s))
    if not out:
        raise StreamError(f"data URL {spec!r} names no shard")
    folders: dict[tuple[str, str], list[str]] = {}
    for u in out:
        try:
            bucket, name = parse_gcs_uri(u)
        except ValueError as e:
            raise StreamError(f"data URL: {e}; allowed: gs://BUCKET/PREFIX/NAME, braces for ranges") from None
        if not name or name.endswith("/"):
            raise StreamError(f"data URL: {u!r} names no object; allowed: gs://BUCKET/PREFIX/NAME")
        folders.setdefault((bucket, posixpath.dirname(name)), []).append(name)
    client = _client()
    for (bucket, folder), names in folders.items():
        prefix = f"{folder}/" if folder else ""
        where = f"gs://{bucket}/{prefix}"
        try:
            have = _call(f"list {where}", lambda: {b.name for b in client.list_blobs(
                bucket, prefix=prefix, delimiter="/", retry=None, timeout=REQUEST_TIMEOUT)})
        except ShardMissing:
            raise StreamError(f"data URL: bucket gs://{bucket} does not exist") from None
        missing = [n for n in names if n not in have]
        if missing:
            shown = ", ".join(f"gs://{bucket}/{n}" for n in missing[:3]) + (" ..." if len(missing) > 3 else "")
            raise StreamError(f"data URL: {len(missing)} of {len(names)} shards missing in {where}: {shown}")
    return out
