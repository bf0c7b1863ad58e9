"""trainer/preemption.py: signals only set the flag; the metadata watcher against a fake server."""
from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from typing import Iterator

import pytest

from drill.metadata_server import MetadataServer
from trainer.loop.preemption import MetadataWatcher, Preemption
from tests.trainer.support import closed_metadata_host


@pytest.fixture
def metadata() -> Iterator[MetadataServer]:
    with MetadataServer() as srv:
        yield srv


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


def test_a_notice_remembered_during_start_up_is_adopted_with_its_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Start-up's own handlers (trainer.startup_notice) caught a real SIGTERM before the trainer's
    existed: installing the trainer's handlers sets the flag from it, with the notice's own time."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers need the main thread")
    from trainer import startup_notice

    monkeypatch.setattr(startup_notice, "_notice", None)
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        startup_notice.install()
        os.kill(os.getpid(), signal.SIGTERM)  # handled in this thread before the next line runs
        noticed = startup_notice.pending()
        assert noticed is not None and noticed[0] == "SIGTERM"
        p = Preemption()
        p.install_signal_handlers()
        try:
            assert p.requested and p.reason == "SIGTERM" and p.notice_monotonic == noticed[1]
        finally:
            p.close()
        assert signal.getsignal(signal.SIGTERM) is startup_notice._remember  # start-up's, until exit
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_watcher_follows_wait_for_change(metadata: MetadataServer) -> None:
    not_preempted = metadata.etag("instance/preempted")
    p = Preemption()
    w = p.watch_metadata(metadata.host)
    try:
        assert w.connected.wait(30)
        assert metadata.wait_waiters(1, 30)  # the watcher is blocked in wait_for_change
        assert not p.requested
        metadata.preempt()
        assert p.wait(30)
        assert p.reason == "metadata instance/preempted=TRUE"
    finally:
        p.close()
    paths = [r.path for r in metadata.requests]
    assert paths[0] == "/computeMetadata/v1/instance/preempted"
    assert "wait_for_change=true" in paths[1] and f"last_etag={not_preempted}" in paths[1]
    assert all(r.flavor == "Google" for r in metadata.requests)


def test_a_stopped_watcher_whose_long_poll_then_reads_true_calls_nothing(metadata: MetadataServer) -> None:
    """A session that closed while its watcher's long poll was open (an own loop's process that
    goes on after it) hears no notice that came after: the answer is dropped, the thread ends."""
    got = threading.Event()
    w = MetadataWatcher(metadata.host, got.set, logging.getLogger("t"), max_backoff_s=0.2)
    w.start()
    assert metadata.wait_waiters(1, 30)
    w.stop()
    metadata.preempt()  # answers the open long poll: TRUE
    w.join(30)
    assert not w.is_alive() and not got.is_set()


def test_watcher_reconnects_after_server_restart(metadata: MetadataServer) -> None:
    """A metadata hiccup: the watcher backs off and reconnects; a later TRUE still counts."""
    got = threading.Event()
    w = MetadataWatcher(metadata.host, got.set, logging.getLogger("t"), max_backoff_s=0.2)
    w.start()
    try:
        assert metadata.wait_waiters(1, 30)
        n = len(metadata.requests)
        metadata.stop()  # the blocked wait_for_change is cut; nothing listens for a while
        assert metadata.waiting == 0
        metadata.start()  # back on the same port
        assert metadata.wait_waiters(1, 30) and len(metadata.requests) > n
        assert not got.is_set()
        metadata.preempt()
        assert got.wait(30)
    finally:
        w.stop()


def test_watcher_survives_an_answer_cut_off_mid_body() -> None:
    """A metadata server that dies mid-answer (IncompleteRead is no OSError) must not kill the watcher."""
    got = threading.Event()
    with socket.create_server(("127.0.0.1", 0)) as srv:
        srv.settimeout(30)  # a dead watcher never reconnects: accept() then fails the test
        w = MetadataWatcher(f"127.0.0.1:{srv.getsockname()[1]}", got.set, logging.getLogger("t"),
                            max_backoff_s=0.05)
        w.start()
        try:
            bodies = [None, "TRUE"]  # first a promise of 5 bytes and a hang-up, then the notice
            for body in bodies:
                conn, _ = srv.accept()
                with conn:
                    conn.recv(65536)
                    if body is None:
                        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nMetadata-Flavor: Google\r\n\r\n")
                    else:
                        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\nMetadata-Flavor: Google\r\n"
                                     b"ETag: e1\r\nConnection: close\r\n\r\nTRUE")
            assert got.wait(30)
        finally:
            w.stop()
            w.join(30)
    assert not w.is_alive()  # it returned after the notice, as it does on a clean TRUE


def test_off_gce_fails_quietly(caplog: pytest.LogCaptureFixture) -> None:
    got = threading.Event()
    w = MetadataWatcher(closed_metadata_host(), got.set, logging.getLogger("t.quiet"), max_backoff_s=0.05)
    with caplog.at_level(logging.INFO, logger="t.quiet"):
        w.start()
        w.stop()
        w.join(30)
    assert not w.is_alive() and not got.is_set() and not w.connected.is_set()
    assert not [r for r in caplog.records if r.levelno >= logging.INFO]
