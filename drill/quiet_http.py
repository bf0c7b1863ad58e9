"""The loopback HTTP servers' base (the fault proxy, the metadata server, the fake Compute API):
a client that hangs up mid-request is normal here, not an error to print."""
from __future__ import annotations

import sys
from http.server import ThreadingHTTPServer


class QuietHTTPServer(ThreadingHTTPServer):
    """``ThreadingHTTPServer`` whose handler threads never keep the process alive, and that stays
    silent when a client resets or drops its connection (a trainer killed while it waits, a proxy
    cutting connections on purpose); anything else is printed as usual."""

    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)
