"""drill/quiet_http.py: the loopback servers print real errors, not clients hanging up."""
from __future__ import annotations

from http.server import BaseHTTPRequestHandler

import pytest

from drill.quiet_http import QuietHTTPServer


def test_a_client_hanging_up_is_silent_and_anything_else_is_printed(capsys: pytest.CaptureFixture[str]) -> None:
    srv = QuietHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    try:
        for error in (ConnectionResetError(104, "Connection reset by peer"), BrokenPipeError(32, "Broken pipe"),
                      ValueError("a bug in a handler")):
            try:
                raise error
            except Exception:
                srv.handle_error(None, ("127.0.0.1", 1))
    finally:
        srv.server_close()
    err = capsys.readouterr().err
    assert "ConnectionResetError" not in err and "BrokenPipeError" not in err
    assert "ValueError: a bug in a handler" in err
