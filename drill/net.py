"""Loopback ports for the fakes (metadata server, storage emulator) and the processes under test."""
from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now.

    The port is released before it is returned, so another process may take it first; the fakes
    bind it at once to keep that window short.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
