"""Fixtures for the checkpoint tests: a real gcp-storage-emulator and a fault-injecting client.

``gcs_emulator`` is the worker's ``gcp-storage-emulator`` (``drill.gcs_emulator.StorageEmulator``,
the drill's own, on a free 127.0.0.1 port, in-memory; ``tests/conftest.py``'s ``worker_emulator``)
as a test's own would be: running, wiped, holding only its empty default bucket. It can be stopped
and restarted on the same port mid-test (``stop()``/``start()``) to simulate an outage; the next
test's ``gcs_emulator`` starts it again if it was left stopped.

``FaultyClient`` wraps the real ``google.cloud.storage.Client``: every call goes to the emulator,
but a plan can make chosen calls fail with 503 or 412 before (or after) reaching it, run a hook
(e.g. stop the emulator) at a chosen upload, and enforce create-only preconditions, which the
emulator ignores.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import pytest
import torch

from drill.gcs_emulator import StorageEmulator

torch.set_num_threads(1)


@dataclass
class GcsEnv:
    emulator: StorageEmulator
    uri: str
    client: Any
    env: dict = field(default_factory=dict)


def _client(host: str) -> Any:
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    return storage.Client(project="spottrain-test", credentials=AnonymousCredentials(),
                          client_options={"api_endpoint": host})


@pytest.fixture
def gcs_emulator(monkeypatch: pytest.MonkeyPatch, fresh_gcs: StorageEmulator) -> Iterator[GcsEnv]:
    """The worker's emulator (tests/conftest.py), fresh: running, wiped, its empty default bucket."""
    emu = fresh_gcs
    env = {"STORAGE_EMULATOR_HOST": emu.host, "GOOGLE_CLOUD_PROJECT": "spottrain-test"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    yield GcsEnv(emu, f"gs://{emu.bucket}/runs/{uuid.uuid4().hex[:8]}", _client(emu.host), env)


# ------------------------------------------------------------------------------------------
# Fault injection around the real client
# ------------------------------------------------------------------------------------------


@dataclass
class Fault:
    """Make calls of ``method`` on objects matching ``pattern`` misbehave ``times`` times.

    ``kind``: "503" raises ServiceUnavailable before the call, "412" raises PreconditionFailed
    before it, "412-after" performs the call and then raises PreconditionFailed (a lost response
    followed by a retry), "hook" runs ``hook`` before the call (then performs it).
    """

    method: str
    pattern: str
    kind: str
    times: int = 1
    hook: Callable[[], None] | None = None
    hits: int = 0


class FaultPlan:
    def __init__(self) -> None:
        self.faults: list[Fault] = []
        self.calls: list[tuple[str, str]] = []
        self.lock = threading.Lock()

    def add(self, *a: Any, **kw: Any) -> Fault:
        f = Fault(*a, **kw)
        self.faults.append(f)
        return f

    def match(self, method: str, name: str) -> Fault | None:
        with self.lock:
            self.calls.append((method, name))
            for f in self.faults:
                if f.method == method and fnmatch.fnmatch(name, f.pattern) and f.hits < f.times:
                    f.hits += 1
                    return f
        return None


class FaultyBlob:
    def __init__(self, blob: Any, plan: FaultPlan, enforce: bool) -> None:
        self._blob, self._plan, self._enforce = blob, plan, enforce

    def __getattr__(self, name: str) -> Any:
        return getattr(self._blob, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._blob, name, value)

    def _call(self, method: str, fn: Callable[[], Any], kwargs: dict) -> Any:
        from google.api_core import exceptions as gexc

        f = self._plan.match(method, self._blob.name)
        if f is not None and f.kind == "503":
            raise gexc.ServiceUnavailable("injected 503")
        if f is not None and f.kind == "412":
            raise gexc.PreconditionFailed("injected 412")
        if f is not None and f.kind == "hook" and f.hook is not None:
            f.hook()
        if self._enforce and kwargs.get("if_generation_match") == 0 and self._blob.bucket.get_blob(self._blob.name, retry=None, timeout=10) is not None:
            raise gexc.PreconditionFailed("object exists (create-only precondition, enforced by the test wrapper)")
        out = fn()
        if f is not None and f.kind == "412-after":
            raise gexc.PreconditionFailed("injected 412 after the upload reached the server")
        return out

    def upload_from_file(self, *a: Any, **kw: Any) -> Any:
        return self._call("upload", lambda: self._blob.upload_from_file(*a, **kw), kw)

    def upload_from_string(self, *a: Any, **kw: Any) -> Any:
        return self._call("upload", lambda: self._blob.upload_from_string(*a, **kw), kw)

    def upload_from_filename(self, *a: Any, **kw: Any) -> Any:
        return self._call("upload", lambda: self._blob.upload_from_filename(*a, **kw), kw)

    def download_as_bytes(self, *a: Any, **kw: Any) -> Any:
        return self._call("download", lambda: self._blob.download_as_bytes(*a, **kw), kw)

    def download_to_file(self, *a: Any, **kw: Any) -> Any:
        return self._call("download", lambda: self._blob.download_to_file(*a, **kw), kw)


class FaultyBucket:
    def __init__(self, bucket: Any, plan: FaultPlan, enforce: bool) -> None:
        self._bucket, self._plan, self._enforce = bucket, plan, enforce

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bucket, name)

    def blob(self, name: str, *a: Any, **kw: Any) -> FaultyBlob:
        return FaultyBlob(self._bucket.blob(name, *a, **kw), self._plan, self._enforce)


class FaultyClient:
    """The real client with a ``FaultPlan`` applied to blob uploads/downloads."""

    def __init__(self, client: Any, *, enforce_preconditions: bool = True) -> None:
        self._client = client
        self.plan = FaultPlan()
        self._enforce = enforce_preconditions

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def bucket(self, name: str, *a: Any, **kw: Any) -> FaultyBucket:
        return FaultyBucket(self._client.bucket(name, *a, **kw), self.plan, self._enforce)

    def list_blobs(self, bucket: Any, *a: Any, **kw: Any) -> Any:
        real = bucket._bucket if isinstance(bucket, FaultyBucket) else bucket
        return self._client.list_blobs(real, *a, **kw)


@pytest.fixture
def faulty_gcs(gcs_emulator: GcsEnv) -> FaultyClient:
    return FaultyClient(gcs_emulator.client)


# ------------------------------------------------------------------------------------------
# Log capture with waiting
# ------------------------------------------------------------------------------------------


class LogWatch(logging.Handler):
    """Collects records of a logger; ``wait_for(substring)`` blocks until one matches."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[str] = []
        self.cond = threading.Condition()

    def emit(self, record: logging.LogRecord) -> None:
        with self.cond:
            self.records.append(record.getMessage())
            self.cond.notify_all()

    def text(self) -> str:
        with self.cond:
            return "\n".join(self.records)

    def wait_for(self, needle: str, timeout: float = 60.0) -> str:
        with self.cond:
            ok = self.cond.wait_for(lambda: any(needle in r for r in self.records), timeout)
        if not ok:
            raise AssertionError(f"log line containing {needle!r} never came; got:\n{self.text()}")
        return next(r for r in self.records if needle in r)


@pytest.fixture
def logwatch() -> Iterator[LogWatch]:
    h = LogWatch()
    loggers = [logging.getLogger(n) for n in ("spottrain.checkpoint", "trainer.checkpoint")]
    old = [(lg.level, lg.propagate) for lg in loggers]
    for lg in loggers:
        lg.addHandler(h)
        lg.setLevel(logging.DEBUG)
    try:
        yield h
    finally:
        for lg, (lvl, _) in zip(loggers, old):
            lg.removeHandler(h)
            lg.setLevel(lvl)


@pytest.fixture(scope="session", autouse=True)
def _worker_zygote_closed() -> Iterator[None]:
    """The pytest process's zygote (`support.worker_zygote`: the fork server most trainer launches
    come from, started on first use) stops with the session."""
    from tests.trainer.support import close_worker_zygote

    yield
    close_worker_zygote()


@pytest.fixture
def zygote(_worker_zygote_closed: None) -> Any:
    """The pytest process's fork server for the default environment (see support.Zygote), for tests
    that fork from it by hand. Looked up for each test, never kept: which zygote that is can change
    within a session (an in-process test may set a TORCH_* variable, and a test may close the
    zygotes of other environments), and a kept one was found closed."""
    from tests.trainer.support import worker_zygote

    return worker_zygote()


@pytest.fixture(autouse=True)
def _no_trainer_outlives_its_test() -> Iterator[None]:
    from tests.trainer.support import power_off_leftovers

    yield
    power_off_leftovers()


@pytest.fixture(autouse=True)
def _own_cache_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the trainer caches (token shards' checks) stays in the test's own directory."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))


@pytest.fixture(autouse=True)
def _single_thread_torch() -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


# ------------------------------------------------------------------------------------------
# The synthesized stack whose IAM the fake Google APIs enforce (drill.iam, drill.fake_gcp)
# ------------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def stack_json() -> Callable[..., dict]:
    """`stack_json(name, overrides={}, base=experiments/example.toml)`: that experiment's stack as
    `cdktn synth` writes it (cached per session): its grants are what the fakes let callers do."""
    import copy
    import json
    import tomllib
    from pathlib import Path

    from stacks.stack import synthesized
    from stacks.load import parse

    repo = Path(__file__).resolve().parents[2]
    cache: dict[str, dict] = {}

    def merge(data: dict, overrides: dict) -> dict:
        out = copy.deepcopy(data)
        for key, value in overrides.items():
            out[key] = merge(out.get(key, {}), value) if isinstance(value, dict) else value
        return {k: v for k, v in out.items() if v is not None}

    def synth(name: str, overrides: dict | None = None, base: str = "experiments/example.toml") -> dict:
        key = json.dumps([name, overrides or {}, base], sort_keys=True)
        if key not in cache:
            data = merge(tomllib.loads((repo / base).read_text()), overrides or {})
            cache[key] = synthesized(name, parse(data, name, f"{name}.toml"))
        return cache[key]

    return synth
