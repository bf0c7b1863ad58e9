"""trainer/health.py: the states and the TCP protocol the managed instance group uses."""
from __future__ import annotations

import socket

from trainer.observe.health import Health, HealthServer, ask


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_states() -> None:
    clock = Clock()
    h = Health(stall_timeout_s=30, clock=clock)
    assert h.answer() == "starting"
    clock.t += 1000  # a long restore is still start-up, not a stall
    assert h.answer() == "starting"
    h.beat()
    assert h.answer() == "ok"
    clock.t += 30
    assert h.answer() == "ok"
    clock.t += 0.5
    assert h.answer() == "stalled"
    h.beat()
    assert h.answer() == "ok"
    h.finished()
    clock.t += 1000
    assert h.answer() == "ok finished"  # a finished VM is never recreated


def test_server_answers_the_configured_request_only() -> None:
    clock = Clock()
    h = Health(stall_timeout_s=5, clock=clock)
    srv = HealthServer(h, host="127.0.0.1", port=0).start()
    try:
        assert ask("127.0.0.1", srv.port) == "starting"
        h.beat()
        assert ask("127.0.0.1", srv.port) == "ok"
        clock.t += 6
        assert ask("127.0.0.1", srv.port) == "stalled"
        assert ask("127.0.0.1", srv.port, request="GET / HTTP/1.0\r\n\r\n") == "unknown"
        # A check that sends the request in pieces still gets its answer.
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
            s.sendall(b"spottrain-")
            s.sendall(b"health")
            assert s.makefile().readline() == "stalled\n"
    finally:
        srv.close()


def test_a_bounded_start_up_wait_passes_the_check_and_says_for_what() -> None:
    from stacks.group import HEALTH_RESPONSE

    h = Health(stall_timeout_s=30, clock=Clock())
    h.waiting("for gcs (unknown for 42s,\ngiving up at 2026-01-01T00:15:00Z)")
    answer = h.answer()
    assert answer.startswith(HEALTH_RESPONSE)  # the group's check passes: no recreation meanwhile
    assert answer == "ok waiting for gcs (unknown for 42s, giving up at 2026-01-01T00:15:00Z)"
    h.starting()
    assert not h.answer().startswith(HEALTH_RESPONSE)


def test_a_port_in_use_is_bad_input_naming_the_port_and_its_holder() -> None:
    import os

    import pytest

    from trainer.observe.health import PortInUse

    first = HealthServer(Health(stall_timeout_s=5), host="127.0.0.1", port=0).start()
    try:
        with pytest.raises(PortInUse) as e:
            HealthServer(Health(stall_timeout_s=5), host="127.0.0.1", port=first.port)
        msg = str(e.value)
        assert msg.startswith(f"health_port: port {first.port} on 127.0.0.1 is already in use by pid {os.getpid()} (")
        assert "--health-port" in msg
    finally:
        first.close()


def test_a_failing_tier_and_the_final_save_still_pass_the_check() -> None:
    from trainer.checkpoint.checkpointer import describe_failing

    clock = Clock()
    failing = {"gcs": {"since": 1795000000.0, "failures": 2, "error": "Forbidden: 403"}}
    h = Health(stall_timeout_s=30, clock=clock, degraded=lambda: describe_failing(failing))
    h.beat()
    want = "gcs failing since 2026-11-18T11:06:40Z (2 failed writes; last: Forbidden: 403)"
    assert h.answer() == f"ok degraded: {want}"  # still training: autohealing must leave the VM alone
    clock.t += 31
    assert h.answer() == "stalled"  # a hung loop still fails the check
    h.finishing(40)
    assert h.answer() == f"ok finishing: making the checkpoint of step 40 durable on every tier; degraded: {want}"
    failing.clear()
    h.beat()
    assert h.answer() == "ok"
    srv = HealthServer(h, host="127.0.0.1", port=0).start()
    try:
        failing["persistent"] = {"since": 1795000000.0, "failures": 1, "error": "OSError: [Errno 28] No space"}
        assert ask("127.0.0.1", srv.port).startswith("ok degraded: persistent failing since")
    finally:
        srv.close()


def test_start_up_passes_the_check_for_its_grace_then_fails_it() -> None:
    """A trainer restarted in place restoring a big model is not a dead VM (the group's
    initial_delay_sec spares new VMs only); a start-up that hangs past the grace still is."""
    from stacks.group import HEALTH_RESPONSE

    clock = Clock()
    h = Health(stall_timeout_s=30, clock=clock, startup_grace_s=900)
    assert h.answer() == "ok starting" and h.answer().startswith(HEALTH_RESPONSE)
    clock.t += 899
    assert h.answer() == "ok starting"
    clock.t += 1
    assert h.answer() == "starting"
    h.beat()
    assert h.answer() == "ok"
    h.starting()  # torchrun re-forms the world in the same process tree: a new start-up
    assert h.answer() == "starting"  # the grace counts from the process's start, once
