"""trainer/preemption.py: signals only set the flag; the metadata watcher against a fake server."""
from __future__ import annotations

import logging
import os
import signal
import threading

import pytest

from trainer.preemption import MetadataWatcher, Preemption
from tests.trainer.support import FakeMetadataServer, closed_metadata_host


@pytest.fixture
def metadata() -> FakeMetadataServer:
    srv = FakeMetadataServer()
    yield srv
    srv.close()


def test_sigterm_and_sigint_only_set_the_flag() -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers need the main thread")
    p = Preemption()
    p.install_signal_handlers()
    try:
        assert not p.requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert p.wait(30)
        assert p.reason == "SIGTERM" and p.notice_monotonic is not None
        first = p.notice_monotonic
        os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt, the first notice time stays
        assert p.notice_monotonic == first and p.reason == "SIGTERM"
    finally:
        p.close()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_watcher_follows_wait_for_change(metadata: FakeMetadataServer) -> None:
    p = Preemption()
    w = p.watch_metadata(metadata.host)
    try:
        assert w.connected.wait(30)
        assert metadata.waiting.wait(30)  # the watcher is blocked in wait_for_change
        assert not p.requested
        metadata.set("TRUE")
        assert p.wait(30)
        assert p.reason == "metadata instance/preempted=TRUE"
    finally:
        p.close()
    paths = [path for path, _ in metadata.requests]
    assert paths[0] == "/computeMetadata/v1/instance/preempted"
    assert "wait_for_change=true" in paths[1] and "last_etag=etag-0" in paths[1]
    assert all(flavor == "Google" for _, flavor in metadata.requests)


def test_watcher_reconnects_after_server_restart(metadata: FakeMetadataServer) -> None:
    """A metadata hiccup: the watcher backs off and reconnects; a later TRUE still counts."""
    got = threading.Event()
    w = MetadataWatcher(metadata.host, got.set, logging.getLogger("t"), max_backoff_s=0.2)
    w.start()
    try:
        assert metadata.waiting.wait(30)
        n = len(metadata.requests)
        metadata.set("FALSE")  # a change that is not a preemption (e.g. an etag bump)
        metadata.waiting.clear()
        assert metadata.waiting.wait(30) and len(metadata.requests) > n
        assert not got.is_set()
        metadata.set("TRUE")
        assert got.wait(30)
    finally:
        w.stop()


def test_off_gce_fails_quietly(caplog: pytest.LogCaptureFixture) -> None:
    got = threading.Event()
    w = MetadataWatcher(closed_metadata_host(), got.set, logging.getLogger("t.quiet"), max_backoff_s=0.05)
    with caplog.at_level(logging.INFO, logger="t.quiet"):
        w.start()
        w.stop()
        w.join(30)
    assert not w.is_alive() and not got.is_set() and not w.connected.is_set()
    assert not [r for r in caplog.records if r.levelno >= logging.INFO]
