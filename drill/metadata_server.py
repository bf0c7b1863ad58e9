"""A fake GCE metadata server on loopback that speaks the real protocol, for the drill and tests.

Only what cannot exist off GCE is faked; clients (curl in the boot scripts, google-auth, the
trainer's preemption watcher) talk plain HTTP to it exactly as they would to
`metadata.google.internal`, pointed here by `GCE_METADATA_HOST=127.0.0.1:PORT`.

Protocol kept (https://cloud.google.com/compute/docs/metadata/querying-metadata):
- every request must carry `Metadata-Flavor: Google` (else 403) and must not carry
  `X-Forwarded-For` (else 403); every answer carries `Metadata-Flavor: Google` and an `ETag`;
- `GET .../instance/preempted` answers `FALSE` until `preempt()`, then `TRUE`;
- `?wait_for_change=true` blocks until the value differs from the one at request time (or from
  `last_etag=`), up to `timeout_sec=` (then answers the unchanged value, as GCE does);
- `instance/attributes/KEY` (custom metadata, 404 when absent; `?recursive=true` on the folder
  gives JSON), a few fixed instance/project values, a service-account token;
- guest attributes: `PUT/GET instance/guest-attributes/NAMESPACE/KEY`, and the folder as JSON.

`stop()` then `start()` is a metadata server outage: the port stays the same, open connections
are cut, and the values (and guest attributes) survive, as they do on GCE.
"""
from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import NamedTuple
from urllib.parse import parse_qs, urlsplit

from drill.quiet_http import QuietHTTPServer

PREFIX = "/computeMetadata/v1/"


def _etag(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()[:16]


class Request(NamedTuple):
    """One request as the server saw it (before any check), for tests and the drill log."""
    method: str
    path: str            # with the query string
    flavor: str | None   # the Metadata-Flavor header sent, None when absent


class MetadataServer:
    """The metadata server of one fake VM.

    Use as a context manager, or `start()`/`stop()`. `host` is what goes into
    `GCE_METADATA_HOST`. State changes (`preempt()`, `set_attribute()`, guest attributes written
    by the VM) wake every blocked `wait_for_change` request. It listens on `port` (default: a free
    one, chosen by the first `start()` and kept by later ones).
    """

    def __init__(self, *, attributes: dict[str, str] | None = None, instance_name: str = "spottrain-drill-vm",
                 zone: str = "europe-west4-a", project_id: str = "spottrain-drill", port: int = 0,
                 token: str = "drill-fake-token", email: str | None = None) -> None:
        self._cond = threading.Condition()
        self._closing = False
        self._generation = 0   # bumped by stop(): requests of an earlier run stop waiting
        self._port = port
        self._connections: set[socket.socket] = set()
        # Path under PREFIX -> value; directories are derived from the keys.
        self._values: dict[str, str] = {
            "instance/preempted": "FALSE",
            "instance/maintenance-event": "NONE",
            "instance/name": instance_name,
            "instance/hostname": f"{instance_name}.c.{project_id}.internal",
            "instance/id": "4242424242424242",
            "instance/zone": f"projects/424242/zones/{zone}",
            "project/project-id": project_id,
            "project/numeric-project-id": "424242",
            "instance/service-accounts/default/email": email or f"trainer@{project_id}.iam.gserviceaccount.com",
            "instance/service-accounts/default/scopes": "https://www.googleapis.com/auth/cloud-platform",
        }
        for key, value in (attributes or {}).items():
            self._values[f"instance/attributes/{key}"] = value
        self._guest: dict[str, str] = {}
        #: The access token of the instance's service account (the fake APIs map it to a principal).
        self.token = token
        self.waiting = 0   # requests blocked in wait_for_change right now
        self.requests: list[Request] = []   # every request seen, for tests and the drill log
        self._httpd: QuietHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # --- lifecycle -------------------------------------------------------------------------
    def start(self) -> "MetadataServer":
        """Listen (again, on the same port after a `stop()`); values are kept."""
        server = self

        class Handler(_Handler):
            metadata = server

        with self._cond:
            self._closing = False
        self._httpd = QuietHTTPServer(("127.0.0.1", self._port), Handler)
        self._port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="metadata-server", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10) -> None:
        """Stop listening and cut every open connection, as a server that goes away does.

        Requests blocked in wait_for_change are released first (each answers the unchanged value
        or finds its connection cut); `stop()` returns once none is left waiting (`timeout` guards).
        """
        if self._httpd is not None:
            self._httpd.shutdown()   # no new connections are accepted from here on
        with self._cond:
            self._closing = True
            self._generation += 1
            self._cond.notify_all()
            self._cond.wait_for(lambda: self.waiting == 0, timeout)
            connections = list(self._connections)
        for conn in connections:  # keep-alive clients must not go on talking to a stopped server
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._httpd is not None:
            self._httpd.server_close()
            self._httpd = None
        if self._thread is not None:
            self._thread.join(timeout=timeout)
            self._thread = None

    def __enter__(self) -> "MetadataServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        assert self._port, "server not started"
        return self._port

    @property
    def host(self) -> str:
        """`127.0.0.1:PORT`, the value for GCE_METADATA_HOST."""
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.host}{PREFIX}"

    # --- what the drill does to the VM -----------------------------------------------------
    def preempt(self) -> None:
        """The preemption notice: `instance/preempted` turns TRUE (waking waiters)."""
        self.set_value("instance/preempted", "TRUE")

    def reset(self) -> None:
        """A fresh VM from the template: not preempted, guest attributes gone."""
        with self._cond:
            self._values["instance/preempted"] = "FALSE"
            self._guest.clear()
            self._cond.notify_all()

    def set_attribute(self, key: str, value: str) -> None:
        """Custom instance metadata (`instance/attributes/KEY`)."""
        self.set_value(f"instance/attributes/{key}", value)

    def set_value(self, path: str, value: str) -> None:
        """Set the value at `path` (relative to /computeMetadata/v1/), waking its waiters."""
        with self._cond:
            self._values[path.strip("/")] = value
            self._cond.notify_all()

    def etag(self, path: str) -> str:
        """The ETag a GET of `path` answers right now (what a client sends back as `last_etag`)."""
        with self._cond:
            status, body, _ = self._lookup(path.strip("/"), recursive=False)
        assert status == 200, f"{path}: {status}"
        return _etag(body)

    def wait_waiters(self, n: int, timeout: float) -> bool:
        """Block until at least `n` requests are blocked in wait_for_change (for tests)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.waiting < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def guest_attributes(self) -> dict[str, str]:
        """`NAMESPACE/KEY` -> value written by the VM."""
        with self._cond:
            return dict(self._guest)

    def wait_guest_attribute(self, key: str, timeout: float) -> str | None:
        """Block until the VM has written guest attribute `NAMESPACE/KEY`; None on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while key not in self._guest:
                left = deadline - time.monotonic()
                if left <= 0 or self._closing:
                    return None
                self._cond.wait(left)
            return self._guest[key]

    # --- protocol internals ----------------------------------------------------------------
    def _lookup(self, path: str, recursive: bool) -> tuple[int, str, str]:
        """(status, body, content type) for a GET of `path` (relative to PREFIX)."""
        if path.startswith("instance/guest-attributes"):
            sub = path[len("instance/guest-attributes"):].strip("/")
            if sub in self._guest:
                return 200, self._guest[sub], "application/text"
            keys = sorted(k for k in self._guest if not sub or k.startswith(sub + "/"))
            if not keys:
                return 404, "guest attribute not found\n", "text/plain"
            listing = [{"namespace": k.split("/", 1)[0], "key": k.split("/", 1)[1], "value": self._guest[k]}
                       for k in keys]
            return 200, json.dumps({"queryValue": {"items": listing}}), "application/json"
        if path == "instance/service-accounts/default/token":
            return 200, json.dumps({"access_token": self.token, "expires_in": 3599,
                                    "token_type": "Bearer"}), "application/json"
        if path in self._values:
            return 200, self._values[path], "application/text"
        folder = path.rstrip("/")
        children = {k[len(folder) + 1:]: v for k, v in self._values.items()
                    if not folder or k.startswith(folder + "/")}
        if not children:
            return 404, "not found\n", "text/html"
        if recursive:
            tree: dict = {}
            for key, value in children.items():
                node = tree
                *dirs, leaf = key.split("/")
                for d in dirs:
                    node = node.setdefault(d, {})
                node[leaf] = value
            return 200, json.dumps(tree), "application/json"
        names = sorted({k.split("/", 1)[0] + ("/" if "/" in k else "") for k in children})
        return 200, "\n".join(names) + "\n", "application/text"

    def _get(self, path: str, query: dict[str, list[str]]) -> tuple[int, str, str]:
        recursive = query.get("recursive", ["false"])[0].lower() == "true"
        wait = query.get("wait_for_change", ["false"])[0].lower() == "true"
        with self._cond:
            status, body, ctype = self._lookup(path, recursive)
            if not wait or status != 200:
                return status, body, ctype
            generation = self._generation
            last = query.get("last_etag", [None])[0] or _etag(body)
            timeout = float(query.get("timeout_sec", ["3600"])[0])
            deadline = time.monotonic() + timeout
            self.waiting += 1
            self._cond.notify_all()
            try:
                while True:
                    status, body, ctype = self._lookup(path, recursive)
                    if status != 200 or _etag(body) != last or self._generation != generation:
                        return status, body, ctype
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return status, body, ctype
                    self._cond.wait(left)
            finally:
                self.waiting -= 1
                self._cond.notify_all()   # stop() waits for the last waiter to leave

    def _put_guest(self, path: str, value: str) -> int:
        sub = path[len("instance/guest-attributes"):].strip("/")
        if sub.count("/") != 1:
            return 400
        with self._cond:
            self._guest[sub] = value
            self._cond.notify_all()
        return 200


class _Handler(BaseHTTPRequestHandler):
    metadata: MetadataServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib signature
        pass  # the drill keeps its own record in `requests`

    def setup(self) -> None:
        super().setup()
        with self.metadata._cond:
            self.metadata._connections.add(self.connection)

    def finish(self) -> None:
        with self.metadata._cond:
            self.metadata._connections.discard(self.connection)
        super().finish()

    def _answer(self, status: int, body: str = "", ctype: str = "application/text", etag: bool = True) -> None:
        data = body.encode()
        self.send_response(status)
        self.send_header("Metadata-Flavor", "Google")
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        if etag and status == 200:
            self.send_header("ETag", _etag(body))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _route(self) -> tuple[str, dict[str, list[str]]] | None:
        if self.metadata._closing:  # accepted just before stop(): a server that is gone does not answer
            self.close_connection = True
            return None
        self.metadata.requests.append(Request(self.command, self.path, self.headers.get("Metadata-Flavor")))
        if self.headers.get("Metadata-Flavor") != "Google" or self.headers.get("X-Forwarded-For"):
            self._answer(HTTPStatus.FORBIDDEN, "Missing Metadata-Flavor:Google header.\n", "text/html", etag=False)
            return None
        url = urlsplit(self.path)
        listing = {"/": "computeMetadata/\n", "/computeMetadata/": "v1/\n"}.get(url.path)
        if listing is not None:  # google-auth's ping() GETs the root
            self._answer(HTTPStatus.OK, listing)
            return None
        if not url.path.startswith(PREFIX) and url.path != PREFIX.rstrip("/"):
            self._answer(HTTPStatus.NOT_FOUND, "not found\n", "text/html", etag=False)
            return None
        return url.path[len(PREFIX):], parse_qs(url.query)

    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        routed = self._route()
        if routed is not None:
            self._answer(*self.metadata._get(*routed))

    do_HEAD = do_GET

    def do_PUT(self) -> None:  # noqa: N802 - stdlib name
        routed = self._route()
        if routed is None:
            return
        path, _ = routed
        value = self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode()
        if not path.startswith("instance/guest-attributes/"):
            self._answer(HTTPStatus.METHOD_NOT_ALLOWED, "only guest attributes are writable\n", "text/plain", etag=False)
            return
        self._answer(self.metadata._put_guest(path, value), "", etag=False)
