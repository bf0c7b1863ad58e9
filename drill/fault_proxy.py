"""A loopback HTTP proxy in front of gcp-storage-emulator that misbehaves on purpose, the way Cloud
Storage and the network do: for the reliability tests, `make chaos` and the drill.

The real `google-cloud-storage` client talks to it exactly as to the emulator
(`STORAGE_EMULATOR_HOST=proxy.host`); every request is forwarded to the emulator unless a rule
matches it first. What it can do:

- **rules** (`add()`), each matching a method and a regular expression searched in the request's
  *target*: its path with the query string, then ` object=NAME` when the request names an object
  (in the path, in `name=`, in a multipart upload's metadata part or in the JSON that starts a
  resumable upload; not in a resumable upload's later chunks), so that
  `r"object=runs/x/step-00000010/manifest.json"` picks one upload. A rule acts on the first
  `times` matching requests (None: all), after skipping `after` of them:
  - `status`: answer with that HTTP status and a GCS-shaped JSON error, without forwarding
    (403 while an IAM grant propagates, 429, 503, 500...);
  - `stall`: hold the request without an answer until `release()` (or `stop()`): a request
    stalled in the network. `stalled(rule)` says how many are held;
  - `drop`: close the connection without an answer (a reset mid-request);
  - `after-forward`: forward it, then answer with `status` instead of the emulator's answer
    (the write happened but its response was lost);
  - `flip`: forward it, then flip one byte in the middle of a successful answer's body, headers
    untouched (bits corrupted in transit: the stored object is intact, a re-read gets it whole);
  - `flip-request`: flip one byte in the middle of the request's body, then forward it (bits
    corrupted on the way up: a multipart upload's payload, whose crc32c in the request's metadata
    part the server checks, as Cloud Storage does);
- **down** (`down()` / `up()`): nothing listens; connections are refused;
- **blackhole** (`blackhole()`): every new request is held without an answer until `up()`;
- **generation preconditions**, which the emulator ignores: `ifGenerationMatch` on uploads,
  composes, metadata patches, deletes and reads (a download pinned to a generation) is checked
  against the object's current generation (412 when it differs; 0 means "must not exist"), and
  so is the generation a compose names for each source (404 when it is no longer there), and
  the check and its request are atomic against every write, so that two writers racing for one
  object, or a reader racing a writer, see what Cloud Storage would show them;
- **bandwidth** (`limit(bytes_per_s)`): every connection carries request and response bodies at
  no more than that rate each way, as Cloud Storage limits one stream; parallel connections each
  get the whole rate. Bodies are stored and forwarded, so the emulator (one thread) never waits
  on a slow client;
- **IAM**, which the emulator ignores too: with `authorize` set (e.g. `FakeGcp.storage_gate`),
  every request is first asked of it, and a refusal is answered 403 as Cloud Storage would.

`requests` records every request seen, `(method, path, outcome)`, for assertions.
"""
from __future__ import annotations

import http.client
import json
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Callable, NamedTuple
from urllib.parse import parse_qs, quote, unquote, urlsplit

from drill.net import free_port
from drill.quiet_http import QuietHTTPServer

__all__ = ["FaultProxy", "Rule", "Seen"]

_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "trailer", "upgrade",
        "content-length", "host"}
_REASONS = {400: "invalid", 401: "required", 403: "forbidden", 404: "notFound", 408: "requestTimeout",
            412: "conditionNotMet", 429: "rateLimitExceeded", 500: "backendError", 502: "badGateway",
            503: "backendError", 504: "gatewayTimeout"}


class Seen(NamedTuple):
    method: str
    path: str
    outcome: str  # "forwarded 200", "status 403", "stalled", "dropped", "precondition 412", ...


@dataclass
class Rule:
    """One misbehaviour; see the module docstring."""

    method: str          # "GET", "POST", "PUT", "PATCH", "DELETE" or "*"
    pattern: str         # re.search over the target: path?query object=NAME
    action: str          # "status", "stall", "drop", "after-forward", "flip", "flip-request"
    status: int = 503
    times: int | None = 1
    after: int = 0
    hits: int = 0        # requests this rule acted on
    seen: int = 0        # matching requests, acted on or skipped
    released: threading.Event = field(default_factory=threading.Event)
    held: int = 0        # requests currently stalled by this rule
    settled: int = 0     # stalled requests since let go and answered (forwarded, refused or dropped)

    def matches(self, method: str, path: str) -> bool:
        return (self.method in ("*", method)) and re.search(self.pattern, path) is not None


def _until(condition: Callable[[], bool], timeout: float) -> bool:
    """Poll `condition` (another thread's requests move it) until true; False after `timeout`."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.01)
    return False


def gcs_error(status: int, message: str) -> bytes:
    reason = _REASONS.get(status, "error")
    return json.dumps({"error": {"code": status, "message": message,
                                 "errors": [{"message": message, "domain": "global", "reason": reason}]}}).encode()


class FaultProxy:
    """The proxy; a context manager. `host` is the value for STORAGE_EMULATOR_HOST."""

    def __init__(self, upstream: str, *, port: int | None = None) -> None:
        #: Bytes per second of each connection, each way (None: as fast as loopback goes).
        self.rate: float | None = None
        u = urlsplit(upstream)
        self.upstream_host, self.upstream_port = u.hostname or "127.0.0.1", u.port or 80
        self.port = port or free_port()
        self.rules: list[Rule] = []
        self.requests: list[Seen] = []
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()  # serialises precondition checks with their writes
        self._blackhole = threading.Event()
        self._unblock = threading.Event()
        self._server: QuietHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._open: set[socket.socket] = set()
        #: (method, path, headers, body) -> a 403 message, or None to let the request through.
        self.authorize: Callable[[str, str, dict[str, str], bytes], str | None] | None = None

    # -- lifecycle -------------------------------------------------------------------------
    @property
    def host(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "FaultProxy":
        proxy = self

        class Handler(_Handler):
            owner = proxy

        server = QuietHTTPServer(("127.0.0.1", self.port), Handler)
        server.allow_reuse_address = True
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name="fault-proxy", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop listening, release every held request and cut open connections."""
        self._release_all()
        self.down()

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- faults ----------------------------------------------------------------------------
    def add(self, method: str, pattern: str, action: str, *, status: int = 503, times: int | None = 1,
            after: int = 0) -> Rule:
        if action not in ("status", "stall", "drop", "after-forward", "flip", "flip-request"):
            raise ValueError(f"unknown action {action!r}")
        rule = Rule(method, pattern, action, status=status, times=times, after=after)
        with self._lock:
            self.rules.append(rule)
        return rule

    def limit(self, bytes_per_s: float | None) -> None:
        """Carry each connection's bodies at ``bytes_per_s`` at most, each way (None: no limit)."""
        if bytes_per_s is not None and bytes_per_s <= 0:
            raise ValueError(f"bytes_per_s {bytes_per_s}; allowed: more than 0, or None")
        self.rate = bytes_per_s

    def clear(self) -> None:
        """Remove every rule and release what they hold."""
        with self._lock:
            rules, self.rules = self.rules, []
        for r in rules:
            r.released.set()

    def release(self, rule: Rule) -> None:
        """Let the requests `rule` holds go on (forwarded) and stop it from holding more."""
        with self._lock:
            rule.times = rule.hits
        rule.released.set()

    def wait_stalled(self, rule: Rule, count: int = 1, timeout: float = 60.0) -> bool:
        """Block until `rule` holds at least `count` requests at once; False after `timeout`."""
        return _until(lambda: rule.held >= count, timeout)

    def wait_settled(self, rule: Rule, count: int = 1, timeout: float = 60.0) -> bool:
        """Block until `count` requests `rule` held have gone on to their end (a request let go
        still reaches the server after its client gave up, as on the real network); False after
        `timeout`."""
        return _until(lambda: rule.settled >= count, timeout)

    def down(self) -> None:
        """Nothing listens on the port: every connection is refused until `up()`."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        with self._lock:
            conns = list(self._open)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def blackhole(self) -> None:
        """Accept and read every new request, answer none, until `up()`."""
        self._unblock.clear()
        self._blackhole.set()

    def up(self) -> None:
        """Back to normal: listening, and no blackhole (held requests then go on)."""
        self._blackhole.clear()
        self._unblock.set()
        if self._server is None:
            self.start()

    def _release_all(self) -> None:
        self._blackhole.clear()
        self._unblock.set()
        with self._lock:
            rules = list(self.rules)
        for r in rules:
            r.released.set()

    def seen(self, method: str = "*", pattern: str = "") -> list[Seen]:
        with self._lock:
            return [s for s in self.requests if method in ("*", s.method) and re.search(pattern, s.path)]

    # -- the request path ------------------------------------------------------------------
    def _match(self, method: str, path: str) -> Rule | None:
        with self._lock:
            for r in self.rules:
                if not r.matches(method, path):
                    continue
                r.seen += 1
                if r.seen <= r.after:
                    continue
                if r.times is not None and r.hits >= r.times:
                    continue
                r.hits += 1
                return r
        return None

    def _record(self, method: str, path: str, outcome: str) -> None:
        # The record's path is the target (with the object name), what rules and tests match.
        with self._lock:
            self.requests.append(Seen(method, path, outcome))

    def forward(self, method: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, list, bytes]:
        conn = http.client.HTTPConnection(self.upstream_host, self.upstream_port, timeout=120)
        try:
            hdrs = {k: v for k, v in headers.items() if k.lower() not in _HOP}
            hdrs["Host"] = f"{self.upstream_host}:{self.upstream_port}"
            hdrs["Content-Length"] = str(len(body))
            conn.request(method, path, body=body, headers=hdrs)
            resp = conn.getresponse()
            data = resp.read()
            out_headers = [(k, v) for k, v in resp.getheaders() if k.lower() not in _HOP]
            return resp.status, out_headers, data
        finally:
            conn.close()

    # -- generation preconditions ---------------------------------------------------------
    def _generation(self, bucket: str, name: str) -> str | None:
        status, _, data = self.forward("GET", f"/storage/v1/b/{quote(bucket, safe='')}/o/{quote(name, safe='')}",
                                       {}, b"")
        if status == 404:
            return None
        if status != 200:
            raise RuntimeError(f"cannot read the generation of {name}: {status}")
        return str(json.loads(data).get("generation"))

    def precondition(self, method: str, path: str, body: bytes, headers: dict[str, str]) -> str | None:
        """The 412 message when this request's ifGenerationMatch does not hold, else None."""
        u = urlsplit(path)
        q = parse_qs(u.query)
        want = q.get("ifGenerationMatch", [None])[0]
        if want is None:
            return None
        if q.get("upload_id"):
            return None  # checked when the resumable upload was started
        parts = u.path.split("/")
        try:
            b = parts.index("b")
        except ValueError:
            return None
        bucket = unquote(parts[b + 1])
        name = _path_object(method, parts)
        if name is None:
            name = q.get("name", [None])[0] or _multipart_name(body, headers)
            if name is None:
                return None
        current = self._generation(bucket, name)
        if want == "0":
            return None if current is None else f"{name} exists (generation {current}); ifGenerationMatch=0"
        if current != want:
            return f"{name} is at generation {current}, not {want}"
        return None

    def compose_sources(self, method: str, path: str, body: bytes) -> str | None:
        """The 404 message when a compose names a source at a generation it no longer has (the
        emulator composes whatever is there now), else None."""
        bucket = _compose_bucket(method, path)
        if bucket is None:
            return None
        try:
            sources = json.loads(body or b"{}").get("sourceObjects") or []
        except ValueError:
            return None
        for src in sources:
            want = src.get("generation")
            if want is not None and self._generation(bucket, src["name"]) != str(want):
                return f"No such object: {bucket}/{src['name']}#{want}"
        return None


def _compose_bucket(method: str, path: str) -> str | None:
    parts = urlsplit(path).path.split("/")
    if method != "POST" or parts[-1:] != ["compose"] or "b" not in parts:
        return None
    return unquote(parts[parts.index("b") + 1])


def _path_object(method: str, parts: list[str]) -> str | None:
    """The object a JSON API path names (`.../b/B/o/NAME`), or None; a compose
    (`POST .../o/NAME/compose`) names the object it creates."""
    if "b" not in parts:
        return None
    b = parts.index("b")
    if len(parts) <= b + 3 or parts[b + 2] != "o":
        return None
    rest = parts[b + 3:]
    if method == "POST" and len(rest) > 1 and rest[-1] == "compose":
        rest = rest[:-1]
    return unquote("/".join(rest))


def target(path: str, body: bytes, headers: dict[str, str], method: str = "GET") -> str:
    """What rules match: the path, then ` object=NAME` when the request names an object."""
    u = urlsplit(path)
    name = _path_object(method, u.path.split("/"))
    if name is None:
        name = parse_qs(u.query).get("name", [None])[0]
    if name is None and ("uploadType=multipart" in u.query
                         or ("uploadType=resumable" in u.query and "upload_id=" not in u.query)):
        name = _multipart_name(body, headers)  # a resumable upload names it in its first request's JSON
    return path if name is None else f"{path} object={name}"


def _multipart_name(body: bytes, headers: dict[str, str]) -> str | None:
    """The object name in a multipart upload's JSON part."""
    m = re.search(rb'"name"\s*:\s*"((?:[^"\\]|\\.)*)"', body[:65536])
    return json.loads(b'"' + m.group(1) + b'"') if m else None


#: Bodies move in blocks of this size, each followed by the wait the rate asks for.
_PACE_BLOCK = 64 << 10


class _Pace:
    """Holds one body's transfer to ``rate`` bytes per second (None: no waits): after each block,
    a wait until the time that many bytes take at that rate since the body began."""

    def __init__(self, rate: float | None, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], object] = time.sleep) -> None:
        self.rate, self._clock, self._sleep = rate, clock, sleep
        self.start, self.moved = clock(), 0

    def after(self, n: int) -> None:
        self.moved += n
        if self.rate:
            wait = self.start + self.moved / self.rate - self._clock()
            if wait > 0:
                self._sleep(wait)


class _Handler(BaseHTTPRequestHandler):
    owner: FaultProxy
    protocol_version = "HTTP/1.1"

    def log_message(self, *a: object) -> None:
        pass

    def setup(self) -> None:
        super().setup()
        with self.owner._lock:
            self.owner._open.add(self.connection)

    def finish(self) -> None:
        with self.owner._lock:
            self.owner._open.discard(self.connection)
        try:
            super().finish()
        except OSError:
            pass

    def _read(self, n: int, pace: "_Pace") -> bytes:
        out = bytearray()
        while len(out) < n:
            chunk = self.rfile.read(min(_PACE_BLOCK, n - len(out)))
            if not chunk:
                break
            out += chunk
            pace.after(len(chunk))
        return bytes(out)

    def _body(self) -> bytes:
        pace = _Pace(self.owner.rate)
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = b""
            while True:
                size = int(self.rfile.readline().strip().split(b";")[0], 16)
                if size == 0:
                    while self.rfile.readline().strip():
                        pass
                    return out
                out += self._read(size, pace)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self._read(n, pace) if n else b""

    def _send(self, status: int, headers: list, body: bytes) -> None:
        self.send_response(status)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        pace = _Pace(self.owner.rate)
        view = memoryview(body)
        for at in range(0, len(view), _PACE_BLOCK):
            self.wfile.write(view[at:at + _PACE_BLOCK])
            pace.after(min(_PACE_BLOCK, len(view) - at))

    def _drop(self) -> None:
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _handle(self) -> None:
        p, method, path = self.owner, self.command, self.path
        body = self._body()
        headers = {k: v for k, v in self.headers.items()}
        tgt = target(path, body, headers, method)
        if p._blackhole.is_set():
            p._record(method, tgt, "blackholed")
            p._unblock.wait()
            self._drop()
            return
        refused = p.authorize(method, path, headers, body) if p.authorize is not None else None
        if refused is not None:
            p._record(method, tgt, "iam 403")
            self._send(403, [("Content-Type", "application/json")], gcs_error(403, refused))
            return
        rule = p._match(method, tgt)
        if rule is not None and rule.action == "stall":
            p._record(method, tgt, "stalled")
            with p._lock:
                rule.held += 1
            rule.released.wait()
            with p._lock:
                rule.held -= 1
            try:
                if p._server is None:  # stopped while the request was held
                    self._drop()
                else:
                    self._go_on(p, method, path, body, headers, tgt, None)
            finally:
                with p._lock:
                    rule.settled += 1
            return
        if rule is not None and rule.action == "status":
            p._record(method, tgt, f"status {rule.status}")
            self._send(rule.status, [("Content-Type", "application/json")],
                       gcs_error(rule.status, f"injected {rule.status} by the fault proxy"))
            return
        elif rule is not None and rule.action == "drop":
            p._record(method, tgt, "dropped")
            self._drop()
            return
        self._go_on(p, method, path, body, headers, tgt, rule)

    def _go_on(self, p: "FaultProxy", method: str, path: str, body: bytes, headers: dict[str, str],
               tgt: str, rule: Rule | None) -> None:
        """The request past the rules that answer at once: checked, forwarded, maybe altered."""
        flipped = ""
        if rule is not None and rule.action == "flip-request" and body:
            at = len(body) // 2
            body = body[:at] + bytes([body[at] ^ 0x5A]) + body[at + 1:]
            flipped = f"request byte {at} flipped, "
        # Every write, and every request with a precondition, holds the lock from its check to
        # its answer: no write lands between a precondition's check and its request.
        conditional = "ifGenerationMatch" in path
        lock = p._write_lock if method in ("POST", "PUT", "PATCH", "DELETE") or conditional else None
        try:
            if lock is not None:
                lock.acquire()
            try:
                why = p.precondition(method, path, body, headers) if conditional else None
            except RuntimeError as e:
                why = None
                p._record(method, tgt, f"precondition unchecked ({e})")
            if why is not None:
                p._record(method, tgt, "precondition 412")
                self._send(412, [("Content-Type", "application/json")], gcs_error(412, why))
                return
            try:
                gone = p.compose_sources(method, path, body)
            except RuntimeError as e:
                gone = None
                p._record(method, tgt, f"compose sources unchecked ({e})")
            if gone is not None:
                p._record(method, tgt, "compose source 404")
                self._send(404, [("Content-Type", "application/json")], gcs_error(404, gone))
                return
            try:
                status, out_headers, data = p.forward(method, path, headers, body)
            except OSError as e:
                p._record(method, tgt, f"upstream down ({type(e).__name__})")
                self._send(502, [("Content-Type", "application/json")], gcs_error(502, "emulator unreachable"))
                return
        finally:
            if lock is not None:
                lock.release()
        if rule is not None and rule.action == "after-forward":
            p._record(method, tgt, f"forwarded {status}, answered {rule.status}")
            self._send(rule.status, [("Content-Type", "application/json")],
                       gcs_error(rule.status, f"injected {rule.status} after the request reached the server"))
            return
        if rule is not None and rule.action == "flip" and 200 <= status < 300 and data:
            at = len(data) // 2
            data = data[:at] + bytes([data[at] ^ 0x5A]) + data[at + 1:]
            p._record(method, tgt, f"forwarded {status}, byte {at} flipped")
            self._send(status, out_headers, data)
            return
        p._record(method, tgt, f"{flipped}forwarded {status}")
        up = f"{p.upstream_host}:{p.upstream_port}"
        me = f"127.0.0.1:{p.port}"
        out_headers = [(k, v.replace(up, me) if k.lower() == "location" else v) for k, v in out_headers]
        if "alt=media" not in path and not path.startswith("/download/"):
            data = data.replace(up.encode(), me.encode())
        self._send(status, out_headers, data)

    def _guarded(self) -> None:
        try:
            self._handle()
        except (ConnectionError, BrokenPipeError, socket.timeout, OSError):
            self.close_connection = True

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _guarded
