"""Every node of a pool tells its log shipper that it trains: rank 0 by its step lines, every
other node's leader by a heartbeat at most once a minute, and a coordinator that only hosts the
rendezvous store by its own heartbeat (trainer/cloud/log_shipper.py resets the stall clock on both)."""
from __future__ import annotations

import signal

import logging
from types import SimpleNamespace

import pytest

from drill.net import free_port
from trainer.cloud.log_shipper import PROGRESS_EVENTS, TRAINER_LINE, parse_message
from trainer.observe.progress import HEARTBEAT_S, Heartbeat


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _logger(name: str) -> tuple[logging.Logger, Lines]:
    log = logging.getLogger(name)
    log.setLevel(logging.INFO)
    h = Lines()
    log.handlers[:] = [h]
    log.propagate = False
    return log, h


def test_a_heartbeat_at_the_first_step_then_at_most_once_a_minute() -> None:
    log, h = _logger("test.heartbeat")
    now = [100.0]
    beat = Heartbeat(log, clock=lambda: now[0])
    for step in range(1, 200):  # a step a second
        beat.beat(step)
        now[0] += 1.0
    assert [parse_message(f"2026-01-02T03:04:05.000 INFO trainer {m}")["step"] for m in h.lines] == [1, 61, 121, 181]
    assert all(parse_message(f"2026-01-02T03:04:05.000 INFO trainer {m}")["event"] in PROGRESS_EVENTS
               for m in h.lines)
    assert HEARTBEAT_S * 5 <= 300  # well inside the shortest stall alert (stall_minutes >= 5)


@pytest.mark.parametrize(("is_main", "is_node_leader", "beats"), [(True, True, 0), (False, True, 1), (False, False, 0)])
def test_only_the_leader_of_a_node_without_rank_0_beats(is_main, is_node_leader, beats) -> None:
    from trainer.loop.session import Session

    log, h = _logger(f"test.session.{is_main}.{is_node_leader}")
    fake = SimpleNamespace(
        done=0, world=SimpleNamespace(is_main=is_main, is_node_leader=is_node_leader), log=log, _heartbeat=None,
        _window=None, preempt=SimpleNamespace(step_completed=lambda step: None),
        health=SimpleNamespace(beat=lambda step: None), cfg=SimpleNamespace(steps=10, heartbeat_every_s=7.0),
        bus=SimpleNamespace(emit=lambda ev: None))
    Session.completed(fake, 3, 1.0, 1e-3, {})  # type: ignore[arg-type]
    assert len([m for m in h.lines if m.startswith("event=heartbeat step=3")]) == beats
    assert (fake._heartbeat.every_s if beats else fake._heartbeat) == (7.0 if beats else None)  # the config's


def test_a_coordinator_that_only_hosts_the_store_beats_until_it_stops(capfd) -> None:
    from trainer.rendezvous import serve

    class Stop:  # "not yet" twice, then stopped: two heartbeats, no clock involved
        def __init__(self) -> None:
            self.waits: list[float] = []

        def wait(self, timeout: float) -> bool:
            self.waits.append(timeout)
            return len(self.waits) > 2

        def set(self) -> None:
            pass

    stop = Stop()
    # serve() is a process's main: it takes SIGTERM and SIGINT for itself. Given back afterwards, so
    # that this worker's later tests (the trainer's own handlers) find the defaults.
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        assert serve("127.0.0.1", free_port(), stop=stop) == 0  # type: ignore[arg-type]
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    lines = [m for m in capfd.readouterr().err.splitlines() if TRAINER_LINE.match(m)]
    beats = [parse_message(m) for m in lines if "event=heartbeat" in m]
    assert len(beats) == 2 and all(b["event"] in PROGRESS_EVENTS for b in beats)
    assert stop.waits == [HEARTBEAT_S] * 3
