"""Suite-wide setup: a private temporary folder per pytest process.

cdktn's `Testing.app()` leaves a `cdktf.outdir.*` folder behind in the jsii runtime's temporary
folder for every synthesis. Each pytest process (every xdist worker is one) points TMPDIR at a
folder of its own before anything starts that runtime, and removes it whole at the end, so one
worker's cleanup can never delete a folder another worker is still synthesizing into.
"""

from __future__ import annotations

import os
import shutil
import tempfile

pytest_plugins = ["tests.cpu_ledger", "tests.scheduling"]

_PRIVATE_TMP = tempfile.mkdtemp(prefix="spottrain-tests-")
os.environ["TMPDIR"] = _PRIVATE_TMP  # read by child processes, the jsii runtime among them

# One checkpoint key for the suite (`trainer.checkpoint.key`): trainer subprocesses, in-process runs
# and `status` all resolve SPOTTRAIN_CHECKPOINT_KEY_FILE, so no test creates or reads the per-user
# ~/.config/spottrain/checkpoint.key. The same bytes in every pytest process: xdist workers share
# some checkpoints (tests/trainer/checkpoint/test_sharded.py's saved_ws2).
TEST_KEY = b"spottrain test suite checkpoint key, not a secret"
_key_file = os.path.join(_PRIVATE_TMP, "checkpoint.key")
with open(os.open(_key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as _f:
    _f.write(TEST_KEY)
os.environ["SPOTTRAIN_CHECKPOINT_KEY_FILE"] = _key_file


# Synthesis ships the committed locks' real wheels (stacks/wheels.py), fetched by hash from the
# index pip is configured with (CI reaches it) into the wheel cache, build/wheels/, where each lock's
# wheels live under the digest of its pins: the first run downloads them once (the controller, in
# `pytest_sessionstart`, before any worker synthesizes), every later run is offline. Tests that need
# a controlled index (the resolver's, the two-index proof) make local ones and say so themselves.
os.environ.pop("SPOTTRAIN_WHEEL_INDEX", None)

# A drill's uninterrupted reference run is kept in build/drill-reference/ under the digest of what
# determines it (`drill.drill.reference_key`: the scripts, archives, trainer, drill code, Python,
# torch, settings): a later run of the suite with nothing of it changed takes the digest from there
# instead of training a whole deployment again. An empty build/ (a fresh clone) runs it.
os.environ.setdefault("SPOTTRAIN_DRILL_REFERENCE_CACHE",
                      os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "build",
                                   "drill-reference"))


def pytest_sessionstart(session) -> None:
    if hasattr(session.config, "workerinput"):  # an xdist worker: the controller fetched them
        return
    import sys as _sys

    from stacks.errors import InputError
    from stacks.wheels import LOCK_DIR, locked_wheels, read_lock

    for lock in sorted(LOCK_DIR.glob("*.lock")):
        try:
            locked_wheels(read_lock(lock))
        except InputError as err:  # the synthesizing tests fail with the same line
            print(f"conftest: {err}", file=_sys.stderr)


def pytest_sessionfinish(session, exitstatus) -> None:
    shutil.rmtree(_PRIVATE_TMP, ignore_errors=True)


# ------------------------------------------------------------------------------------------------
# Faults as they happen: Cloud Storage behind a misbehaving proxy, disks that fill or go read-only
# ------------------------------------------------------------------------------------------------

import uuid  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Iterator  # noqa: E402

import pytest  # noqa: E402


@dataclass
class ProxiedGcs:
    """gcp-storage-emulator behind `drill.fault_proxy.FaultProxy`; `env` points clients (and
    trainer subprocesses) at the proxy, `direct` at the emulator itself."""

    emulator: Any
    proxy: Any
    bucket: str
    uri: str
    env: dict[str, str] = field(default_factory=dict)

    def client(self, direct: bool = False) -> Any:
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        host = self.emulator.host if direct else self.proxy.host
        return storage.Client(project="spottrain-test", credentials=AnonymousCredentials(),
                              client_options={"api_endpoint": host})


#: The default bucket of the worker's emulator (`gcs_emulator`, `gcs_proxy`).
TEST_BUCKET = "spottrain-test"


@pytest.fixture(scope="session")
def worker_emulator() -> Iterator[Any]:
    """One gcp-storage-emulator for this pytest process (an xdist worker runs one test at a time),
    instead of one a test: starting one costs 0.5-0.75 s. Tests get it through `fresh_emulator`."""
    from drill.gcs_emulator import StorageEmulator

    emu = StorageEmulator(TEST_BUCKET, quiet=True).start()
    try:
        yield emu
    finally:
        emu.stop()


def fresh_emulator(emu: Any) -> Any:
    """The worker's emulator as a test's own would be at its start: running (a test before may have
    stopped it to stage an outage), its data wiped (the emulator's `/wipe`: objects, buckets,
    bucket policies, soft-deleted objects), holding only its empty default bucket."""
    import json
    import urllib.request

    if emu.proc is None or emu.proc.poll() is not None:
        emu.start()  # in-memory: it comes back empty, with the default bucket
        return emu
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback, never a proxy
    with opener.open(f"{emu.host}/wipe", timeout=30) as r:
        assert r.status == 200, r.status
    create = urllib.request.Request(f"{emu.host}/storage/v1/b?project=spottrain-test", method="POST",
                                    data=json.dumps({"name": emu.bucket}).encode(),
                                    headers={"Content-Type": "application/json"})
    with opener.open(create, timeout=30) as r:
        assert r.status == 200, r.status
    return emu


@pytest.fixture
def fresh_gcs(worker_emulator: Any) -> Any:
    """The worker's emulator, fresh for this test (`fresh_emulator`)."""
    return fresh_emulator(worker_emulator)


@pytest.fixture
def gcs_proxy(monkeypatch: pytest.MonkeyPatch) -> Iterator[ProxiedGcs]:
    """An emulator of the test's own behind a fault proxy: a request the proxy stalled may reach the
    emulator after the test (when the proxy stops), so these never share the worker's."""
    from drill.fault_proxy import FaultProxy
    from drill.gcs_emulator import StorageEmulator

    bucket = TEST_BUCKET
    emu = StorageEmulator(bucket, quiet=True).start()
    proxy = FaultProxy(emu.host).start()
    env = {"STORAGE_EMULATOR_HOST": proxy.host, "GOOGLE_CLOUD_PROJECT": "spottrain-test"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    try:
        yield ProxiedGcs(emu, proxy, bucket, f"gs://{bucket}/runs/{uuid.uuid4().hex[:8]}", env)
    finally:
        proxy.stop()
        emu.stop()


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """`small_fs(name, size_bytes, fstype="tmpfs")`: a real filesystem of that size mounted under
    tmp_path (a tmpfs, or an ext4 on a loop device; root only: the test is skipped otherwise).
    Unmounted at teardown."""
    from drill.small_fs import SmallFs

    mounted: list[SmallFs] = []

    def make(name: str = "disk", size_bytes: int = 64 << 20, fstype: str = "tmpfs") -> SmallFs:
        if not SmallFs.possible(fstype):
            pytest.skip(f"a real small filesystem needs root (mount -t {fstype})")
        fs = SmallFs(tmp_path / name, size_bytes, fstype=fstype).__enter__()
        mounted.append(fs)
        return fs

    try:
        yield make
    finally:
        for fs in reversed(mounted):
            fs.__exit__(None, None, None)
