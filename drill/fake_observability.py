"""A fake of Cloud Logging, Cloud Monitoring's time series and the Cloud Billing Catalog on loopback,
speaking their real REST protocols, for the log shipper, `python -m trainer logs`, the metrics the
trainer writes and `make prices`.

It plugs beside `drill.fake_gcp.FakeGcp`: the same bearer token (pass `token=gcp.token`), the same
error bodies (`drill.fake_gcp.Refused`), its own port; the clients are pointed here by
`SPOTTRAIN_LOGGING_API`, `SPOTTRAIN_MONITORING_API` and `SPOTTRAIN_BILLING_API` (`logging_api`,
`monitoring_api`, `billing_api`). Application-default credentials still trade their token at
`FakeGcp.token_uri`.

Protocol kept, and refused where Google refuses:
- every call needs `Authorization: Bearer TOKEN` (401 UNAUTHENTICATED); given a `drill.iam.Policy`
  (`policy`, `principal`: whose token it is), `entries:write` needs `logging.logEntries.create` and
  `timeSeries.create` needs `monitoring.timeSeries.create` on the project (403 otherwise); errors are Google's JSON
  `{"error": {"code", "message", "status", "errors": [...]}}`; a request over 10 MB is refused;
- Logging `POST /v2/entries:write` (cloud.google.com/logging/docs/reference/v2/rest/v2/entries/write):
  the request's `logName`, `resource` and `labels` default each entry's; a `logName` is
  projects/P/logs/LOG_ID (LOG_ID URL-encoded, at most 512 of A-Za-z0-9 / _ - .), of this project
  (403 otherwise); a resource of a known type with the labels it requires; exactly one payload; a
  known severity; an RFC 3339 timestamp (default: now); an entry of at most 256 KB. One bad entry
  fails the request (400, nothing written) unless `partialSuccess`, which writes the others and
  still answers 400. An entry older than the retention (30 days) or more than 24 h ahead is
  accepted and never listed; a repeated insertId with the same timestamp in the same log is kept
  once;
- Logging `POST /v2/entries:list` (.../entries/list): `resourceNames` required (projects/P),
  `filter` in the Logging query language (the subset below; anything else is 400, never a silent
  match-all), `orderBy` "timestamp asc" (default) or "timestamp desc", `pageSize` 1-1000 (default
  50), `pageToken` valid only for the same query;
- Monitoring `POST /v3/projects/P/timeSeries` (cloud.google.com/monitoring/api/ref_v3/rest/v3/
  projects.timeSeries/create): at most 200 series, each with exactly one point, no series twice;
  a user-defined metric type (custom.googleapis.com/...) with at most 30 labels; a resource of a
  known type with its labels; a GAUGE's interval is one instant, a DELTA or CUMULATIVE's has a
  start before its end; the end no more than 25 h old nor 5 min ahead; each point later than the
  series' last and at least 5 s after it (one point each 5 s per series); the kind and value type
  fixed by the first point (the descriptor is created then). Series that fail are named in the 400;
  the others are written;
- Billing Catalog `GET /v1/services` and `GET /v1/services/ID/skus` (cloud.google.com/billing/v1/
  how-tos/catalog-api): `currencyCode`, `pageSize` up to 5000 (the default), `pageToken`, 404 for an
  unknown service.

Filters (cloud.google.com/logging/docs/view/logging-query-language): comparisons `=`, `!=`, `:`
(has: a case-insensitive substring), `<`, `<=`, `>`, `>=` on `logName`, `severity` (ordered by
level), `timestamp`, `insertId`, `textPayload`, `resource.type`, `resource.labels.K`, `labels.K`
and `jsonPayload.PATH` (a key with a dash quoted: `labels."spottrain-experiment"`), joined by
`AND`, `OR`, juxtaposition (AND), `NOT` or `-`, and parentheses. A comparison with a missing field
is false. `matching(filter)` evaluates one over the entries held (the stack's log-based metrics).
"""
from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
import time
from datetime import datetime, timedelta, timezone
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any, Callable
from urllib.parse import parse_qs, unquote, urlsplit

from drill.fake_gcp import Refused
from drill.quiet_http import QuietHTTPServer

MAX_REQUEST = 10 * 1000 * 1000
MAX_ENTRY = 256 * 1024
RETENTION = timedelta(days=30)
SEVERITIES = ("DEFAULT", "DEBUG", "INFO", "NOTICE", "WARNING", "ERROR", "CRITICAL", "ALERT", "EMERGENCY")
#: Monitored resource types -> the labels each requires (and the only ones it takes).
LOG_RESOURCES = {
    "global": {"project_id"},
    "gce_instance": {"project_id", "instance_id", "zone"},
    "generic_node": {"project_id", "location", "namespace", "node_id"},
    "generic_task": {"project_id", "location", "namespace", "job", "task_id"},
    # What Cloud Run writes a job's stdout/stderr under (the control job's entries).
    "cloud_run_job": {"project_id", "job_name", "location"},
}
LOG_ID = re.compile(r"^[A-Za-z0-9/_.\-]{1,512}$")
METRIC_PREFIXES = ("custom.googleapis.com/", "workload.googleapis.com/", "external.googleapis.com/")
METRIC_LABEL = re.compile(r"^[a-z][a-z0-9_]{0,99}$")
MIN_SAMPLE_S = 5.0
MAX_SERIES = 200


def _bad(message: str) -> Refused:
    return Refused(400, "INVALID_ARGUMENT", message, "badRequest")


def parse_time(value: Any) -> datetime:
    """An RFC 3339 timestamp (Z or an offset, any fraction); ValueError otherwise."""
    if not isinstance(value, str):
        raise ValueError(f"not a timestamp: {value!r}")
    m = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)", value)
    if m is None:
        raise ValueError(f"not an RFC 3339 timestamp: {value!r}")
    base = datetime.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S")
    micros = int((m.group(2) or ".0")[1:7].ljust(6, "0"))
    tz = timezone.utc if m.group(3) == "Z" else datetime.strptime(m.group(3).replace(":", ""), "%z").tzinfo
    return base.replace(microsecond=micros, tzinfo=tz).astimezone(timezone.utc)


def _rfc3339(t: datetime) -> str:
    return t.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# --- the Logging query language (the subset we use) -----------------------------------------------
_TOKEN = re.compile(r'\s*(?:(?P<str>"(?:[^"\\]|\\.)*")|(?P<op>>=|<=|!=|=~|!~|[=:<>()])|(?P<word>[^\s=:<>()!"]+))')
_ROOTS = {"logName", "severity", "timestamp", "insertId", "textPayload", "resource", "labels", "jsonPayload",
          "protoPayload"}


class FilterError(Exception):
    pass


def _tokens(text: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            raise FilterError(f"unparseable filter at {pos}: {text[pos:pos + 20]!r}")
        kind = m.lastgroup or ""
        value = m.group(kind)
        out.append((kind, json.loads(value) if kind == "str" else value))
        pos = m.end()
    return out


class Filter:
    """A parsed filter; `matches(entry)` evaluates it."""

    def __init__(self, text: str) -> None:
        self.text = text
        self._t = _tokens(text or "")
        self._i = 0
        self.tree = self._or() if self._t else ("true",)
        if self._i != len(self._t):
            raise FilterError(f"unparseable filter near {self._t[self._i][1]!r}")

    def _peek(self) -> tuple[str, str] | None:
        return self._t[self._i] if self._i < len(self._t) else None

    def _take(self) -> tuple[str, str]:
        tok = self._peek()
        if tok is None:
            raise FilterError("unexpected end of filter")
        self._i += 1
        return tok

    def _or(self) -> tuple:
        node = self._and()
        while self._peek() == ("word", "OR"):
            self._take()
            node = ("or", node, self._and())
        return node

    def _and(self) -> tuple:
        node = self._unary()
        while True:
            tok = self._peek()
            if tok is None or tok == ("op", ")") or tok == ("word", "OR"):
                return node
            if tok == ("word", "AND"):
                self._take()
            node = ("and", node, self._unary())

    def _unary(self) -> tuple:
        tok = self._take()
        if tok == ("word", "NOT"):
            return ("not", self._unary())
        if tok[0] == "word" and tok[1].startswith("-") and len(tok[1]) > 1:
            self._t[self._i - 1] = ("word", tok[1][1:])  # -field=value: NOT field=value
            self._i -= 1
            return ("not", self._unary())
        if tok == ("op", "("):
            node = self._or()
            if self._take() != ("op", ")"):
                raise FilterError("unbalanced parentheses")
            return node
        if tok[0] not in ("word", "str"):
            raise FilterError(f"a comparison cannot start with {tok[1]!r}")
        path = self._path(tok)
        op = self._take()
        if op[0] != "op" or op[1] not in ("=", "!=", ":", "<", "<=", ">", ">=", "=~", "!~"):
            raise FilterError(f"unsupported operator {op[1]!r} after {'.'.join(path)}")
        value = self._take()
        if value[0] == "op":
            raise FilterError(f"no value after {'.'.join(path)} {op[1]}")
        if op[1] in ("=~", "!~"):
            # Regular expressions (RE2) match anywhere in the value unless anchored, and take a
            # quoted pattern (cloud.google.com/logging/docs/view/logging-query-language#regular-expressions).
            if value[0] != "str":
                raise FilterError(f"a regular expression must be quoted after {'.'.join(path)} {op[1]}")
            try:
                re.compile(value[1])
            except re.error as e:
                raise FilterError(f"invalid regular expression {value[1]!r}: {e}") from None
        return ("cmp", path, op[1], value[1], value[0] == "str")

    def _path(self, first: tuple[str, str]) -> list[str]:
        """A field path: dotted words, and quoted keys after a dot (labels."spottrain-experiment")."""
        parts: list[str] = []
        tok = first
        while True:
            parts += [tok[1]] if tok[0] == "str" else [p for p in tok[1].split(".") if p]
            dot = tok[0] == "word" and tok[1].endswith(".")
            nxt = self._peek()
            if nxt is not None and ((dot and nxt[0] in ("str", "word"))
                                    or (nxt[0] == "word" and nxt[1].startswith("."))):
                tok = self._take()
                continue
            break
        if not parts or parts[0] not in _ROOTS:
            raise FilterError(f"unknown field {'.'.join(parts)!r}")
        return parts

    def matches(self, e: dict[str, Any]) -> bool:
        return _eval(self.tree, e)


def field_at(e: dict[str, Any], path: list[str]) -> Any:
    """The value at ``path`` in a log entry (``jsonPayload.event``), or None."""
    value: Any = e
    for part in path:
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _eval(node: tuple, e: dict[str, Any]) -> bool:
    kind = node[0]
    if kind == "true":
        return True
    if kind == "and":
        return _eval(node[1], e) and _eval(node[2], e)
    if kind == "or":
        return _eval(node[1], e) or _eval(node[2], e)
    if kind == "not":
        return not _eval(node[1], e)
    _, path, op, want, quoted = node
    have = field_at(e, path)
    if have is None or isinstance(have, (dict, list)):
        return False
    if op == ":":
        return str(want).lower() in str(have).lower()
    if op in ("=~", "!~"):
        found = re.search(str(want), str(have)) is not None
        return found if op == "=~" else not found
    if path == ["severity"]:
        if want not in SEVERITIES:
            raise FilterError(f"unknown severity {want!r}")
        a, b = SEVERITIES.index(str(have)), SEVERITIES.index(want)
    elif path == ["timestamp"]:
        a, b = parse_time(have), parse_time(want)  # type: ignore[assignment]
    elif isinstance(have, (int, float)) and not isinstance(have, bool) and not quoted:
        try:
            a, b = have, float(want)  # type: ignore[assignment]
        except ValueError:
            a, b = str(have), want  # type: ignore[assignment]
    else:
        a, b = str(have).lower() if isinstance(have, bool) else str(have), str(want)  # type: ignore[assignment]
    return {"=": a == b, "!=": a != b, "<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b}[op]


# --- the fake ------------------------------------------------------------------------------------
class FakeObservability:
    """Cloud Logging, Monitoring's time series and the Billing Catalog of one project."""

    def __init__(self, project: str = "spottrain-drill", *, token: str = "fake-access-token",
                 clock: Callable[[], float] | None = None, policy: Any = None, principal: str = "") -> None:
        self.project = project
        self.token = token
        #: With a `drill.iam.Policy`, the token is `principal`'s and each write needs its permission
        #: on the project, as Google checks it (`_authorize`); without one, the caller holds them.
        self.policy, self.principal = policy, principal
        self.clock = clock or time.time
        self._lock = threading.Condition()
        self.entries: list[dict[str, Any]] = []
        self._seen: set[tuple[str, str, str]] = set()
        #: metric type -> (metric kind, value type), fixed by the first point written
        self.descriptors: dict[str, tuple[str, str]] = {}
        #: (metric type, metric labels, resource) -> points [(end time, value)]
        self.series: dict[tuple[str, str, str], list[tuple[datetime, Any]]] = {}
        #: Billing Catalog: service id -> (display name, SKUs)
        self.catalog: dict[str, tuple[str, list[dict[str, Any]]]] = {}
        #: (method, path regex, status, times left or None) answered with that status instead
        self.faults: list[list[Any]] = []
        self.calls: list[tuple[str, str, int]] = []
        self._httpd: QuietHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # --- lifecycle -------------------------------------------------------------------------
    def start(self) -> "FakeObservability":
        fake = self

        class Handler(_Handler):
            obs = fake

        self._httpd = QuietHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="fake-observability", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def __enter__(self) -> "FakeObservability":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        assert self._httpd is not None, "not started"
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    @property
    def logging_api(self) -> str:
        """SPOTTRAIN_LOGGING_API (what https://logging.googleapis.com/v2 is)."""
        return f"{self.url}/v2"

    @property
    def monitoring_api(self) -> str:
        """SPOTTRAIN_MONITORING_API (what https://monitoring.googleapis.com/v3 is)."""
        return f"{self.url}/v3"

    @property
    def billing_api(self) -> str:
        """SPOTTRAIN_BILLING_API (what https://cloudbilling.googleapis.com/v1 is)."""
        return f"{self.url}/v1"

    # --- for tests -------------------------------------------------------------------------
    def fail(self, method: str, path_regex: str, status: int, times: int | None = 1) -> None:
        """Answer `status` to matching calls (`times` of them; None: for ever): throttling (429),
        an outage (503), a grant still propagating (403)."""
        self.faults.append([method.upper(), path_regex, status, times])

    def matching(self, filter_text: str) -> list[dict[str, Any]]:
        """The entries held that `filter_text` selects, oldest first (a log-based metric's count)."""
        f = Filter(filter_text)
        with self._lock:
            return [e for e in self._listable() if f.matches(e)]

    def wait_for(self, pred: Callable[["FakeObservability"], bool], timeout: float) -> bool:
        """Block until `pred(self)` holds (re-checked after every call answered)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while not pred(self):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
            return True

    def add_service(self, service_id: str, display_name: str, skus: list[dict[str, Any]]) -> None:
        self.catalog[service_id] = (display_name, list(skus))

    # --- dispatch --------------------------------------------------------------------------
    def handle(self, method: str, path: str, query: dict[str, list[str]], body: Any) -> tuple[int, Any]:
        with self._lock:
            try:
                for fault in self.faults:
                    m, rx, status, times = fault
                    if m == method and re.search(rx, path) and (times is None or times > 0):
                        if times is not None:
                            fault[3] = times - 1
                        name = {403: "PERMISSION_DENIED", 429: "RESOURCE_EXHAUSTED", 503: "UNAVAILABLE"}.get(
                            status, "INTERNAL")
                        raise Refused(status, name, f"injected {status} for {path}", name.lower())
                status, answer = 200, self._dispatch(method, path, query, body)
            except Refused as e:
                status, answer = e.code, {"error": {"code": e.code, "message": e.message, "status": e.status,
                                                    "errors": [{"reason": e.reason, "message": e.message,
                                                                "domain": "global"}]}}
            self.calls.append((method, path, status))
            self._lock.notify_all()
            return status, answer

    def _authorize(self, permission: str, project: str) -> None:
        """entries:write needs logging.logEntries.create, timeSeries.create needs
        monitoring.timeSeries.create, on the project (cloud.google.com/logging/docs/reference/v2/rest/
        v2/entries/write and cloud.google.com/monitoring/api/ref_v3/rest/v3/projects.timeSeries/create,
        "Authorization requires the following IAM permission"): a VM account without
        roles/logging.logWriter or roles/monitoring.metricWriter gets 403."""
        if self.policy is None:
            return
        from drill.iam import Resource

        target = Resource(permission.split(".", 1)[0] + ".googleapis.com", "cloudresourcemanager.googleapis.com/Project",
                          f"projects/{project}")
        if not self.policy.allows(self.principal, permission, target):
            raise Refused(403, "PERMISSION_DENIED", f"Permission '{permission}' denied on resource "
                          f"'projects/{project}' (or it may not exist).", "forbidden")

    def _dispatch(self, method: str, path: str, query: dict[str, list[str]], body: Any) -> Any:
        if path == "/v2/entries:write" and method == "POST":
            self._authorize("logging.logEntries.create", self.project)
            return self._write(body if isinstance(body, dict) else {})
        if path == "/v2/entries:list" and method == "POST":
            return self._list(body if isinstance(body, dict) else {})
        m = re.fullmatch(r"/v3/projects/([^/]+)/timeSeries", path)
        if m and method == "POST":
            self._authorize("monitoring.timeSeries.create", m.group(1))
            return self._time_series(m.group(1), body if isinstance(body, dict) else {})
        if path == "/v1/services" and method == "GET":
            return self._page(query, "services", [{"name": f"services/{sid}", "serviceId": sid,
                                                   "displayName": name} for sid, (name, _) in
                                                  sorted(self.catalog.items())], 5000)
        m = re.fullmatch(r"/v1/services/([^/]+)/skus", path)
        if m and method == "GET":
            if m.group(1) not in self.catalog:
                raise Refused(404, "NOT_FOUND", f"Service {m.group(1)} not found.", "notFound")
            currency = query.get("currencyCode", ["USD"])[0]
            if currency != "USD":
                raise _bad(f"Unsupported currency code {currency!r} in this fake")
            return self._page(query, "skus", self.catalog[m.group(1)][1], 5000)
        raise Refused(404, "NOT_FOUND", f"The requested URL {path} was not found on this server.", "notFound")

    # --- Logging ---------------------------------------------------------------------------
    def _log_name(self, name: Any, where: str) -> str:
        m = re.fullmatch(r"projects/([^/]+)/logs/([^/]+)", name) if isinstance(name, str) else None
        if m is None or not LOG_ID.match(unquote(m.group(2))):
            raise _bad(f"{where}: invalid log name {name!r}")
        if m.group(1) != self.project:
            raise Refused(403, "PERMISSION_DENIED", f"Permission 'logging.logEntries.create' denied on "
                          f"resource (or it may not exist): projects/{m.group(1)}", "forbidden")
        return f"projects/{self.project}/logs/{m.group(2)}"

    def _check_entry(self, e: dict[str, Any], where: str) -> dict[str, Any]:
        e = dict(e)
        e["logName"] = self._log_name(e.get("logName"), where)
        res = e.get("resource")
        if not isinstance(res, dict) or res.get("type") not in LOG_RESOURCES:
            raise _bad(f"{where}: a resource of a supported type is required, got {res!r}")
        labels = dict(res.get("labels") or {})
        labels.setdefault("project_id", self.project)
        want = LOG_RESOURCES[res["type"]]
        if set(labels) != want or not all(isinstance(v, str) and v for v in labels.values()):
            raise _bad(f"{where}: resource {res['type']} takes exactly the labels {sorted(want)}, got "
                       f"{sorted(labels)}")
        e["resource"] = {"type": res["type"], "labels": labels}
        payloads = [k for k in ("textPayload", "jsonPayload", "protoPayload") if k in e]
        if len(payloads) != 1:
            raise _bad(f"{where}: exactly one of textPayload, jsonPayload, protoPayload, got {payloads}")
        if "jsonPayload" in e and not isinstance(e["jsonPayload"], dict):
            raise _bad(f"{where}: jsonPayload must be an object")
        severity = e.setdefault("severity", "DEFAULT")
        if severity not in SEVERITIES:
            raise _bad(f"{where}: invalid severity {severity!r}")
        try:
            t = parse_time(e["timestamp"]) if "timestamp" in e else datetime.fromtimestamp(self.clock(), timezone.utc)
        except ValueError as err:
            raise _bad(f"{where}: {err}") from None
        e["timestamp"] = _rfc3339(t)
        for k, v in (e.get("labels") or {}).items():
            if not isinstance(v, str) or len(k.encode()) > 512 or len(v.encode()) > 64 * 1024:
                raise _bad(f"{where}: label {k!r} is not a string within the size limits")
        if len(json.dumps(e).encode()) > MAX_ENTRY:
            raise _bad(f"{where}: Log entry with size {len(json.dumps(e))} bytes exceeds maximum size of 256.0K")
        return e

    def _write(self, body: dict[str, Any]) -> Any:
        entries = body.get("entries")
        if not isinstance(entries, list) or not entries:
            raise _bad("entries: at least one log entry is required")
        good, bad = [], []
        for i, raw in enumerate(entries):
            if not isinstance(raw, dict):
                bad.append(f"entries[{i}]: not an object")
                continue
            e = dict(raw)
            for key in ("logName", "resource"):
                if key not in e and key in body:
                    e[key] = body[key]
            e["labels"] = {**(body.get("labels") or {}), **(e.get("labels") or {})}
            if not e["labels"]:
                e.pop("labels")
            try:
                good.append(self._check_entry(e, f"entries[{i}]"))
            except Refused as err:
                if err.code == 403:
                    raise
                bad.append(err.message)
        if bad and not body.get("partialSuccess"):
            raise _bad("; ".join(bad[:5]))
        now = datetime.fromtimestamp(self.clock(), timezone.utc)
        if not body.get("dryRun"):
            for e in good:
                key = (e["logName"], str(e.get("insertId", "")), e["timestamp"])
                if e.get("insertId") and key in self._seen:
                    continue
                self._seen.add(key)
                e["receiveTimestamp"] = _rfc3339(now)
                e.setdefault("insertId", hashlib.sha256(repr((key, len(self.entries))).encode()).hexdigest()[:16])
                self.entries.append(e)
        if bad:
            raise _bad(f"{len(bad)} of {len(entries)} log entries failed: " + "; ".join(bad[:5]))
        return {}

    def _listable(self) -> list[dict[str, Any]]:
        now = datetime.fromtimestamp(self.clock(), timezone.utc)
        return [e for e in self.entries if now - RETENTION <= parse_time(e["timestamp"]) <= now + timedelta(hours=24)]

    def _list(self, body: dict[str, Any]) -> Any:
        names = body.get("resourceNames")
        if not isinstance(names, list) or not names:
            raise _bad("resourceNames: at least one resource name is required")
        for n in names:
            if n != f"projects/{self.project}":
                raise Refused(403, "PERMISSION_DENIED", f"The caller does not have permission on {n}", "forbidden")
        order = body.get("orderBy", "timestamp asc")
        if order not in ("timestamp asc", "timestamp desc"):
            raise _bad(f"orderBy: only \"timestamp asc\" and \"timestamp desc\" are permitted, got {order!r}")
        size = body.get("pageSize", 50)
        if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= 1000:
            raise _bad(f"pageSize: must be between 0 and 1000, got {size!r}")
        size = size or 50
        try:
            f = Filter(str(body.get("filter", "")))
            found = [e for e in self._listable() if f.matches(e)]
        except (FilterError, ValueError) as err:
            raise _bad(f"Unparseable filter: {err}") from None
        found.sort(key=lambda e: (parse_time(e["timestamp"]), e["insertId"]), reverse=order == "timestamp desc")
        query = hashlib.sha256(json.dumps([names, body.get("filter", ""), order]).encode()).hexdigest()[:12]
        start = self._token_offset(body.get("pageToken"), query)
        page = found[start:start + size]
        out: dict[str, Any] = {"entries": page} if page else {}
        if start + size < len(found):
            out["nextPageToken"] = base64.urlsafe_b64encode(f"{query}:{start + size}".encode()).decode()
        return out

    @staticmethod
    def _token_offset(token: Any, query: str) -> int:
        if not token:
            return 0
        try:
            q, offset = base64.urlsafe_b64decode(str(token).encode()).decode().split(":")
            if q != query:
                raise ValueError("from another query")
            return int(offset)
        except (ValueError, UnicodeDecodeError) as err:
            raise _bad(f"pageToken: invalid page token ({err})") from None

    def _page(self, query: dict[str, list[str]], key: str, items: list[Any], max_size: int) -> Any:
        try:
            size = int(query.get("pageSize", [str(max_size)])[0])
        except ValueError:
            raise _bad("pageSize: not a number") from None
        if not 0 <= size <= max_size:
            raise _bad(f"pageSize: must be between 0 and {max_size}, got {size}")
        size = size or max_size
        digest = hashlib.sha256(key.encode()).hexdigest()[:12]
        start = self._token_offset(query.get("pageToken", [""])[0], digest)
        out: dict[str, Any] = {key: items[start:start + size]}
        if start + size < len(items):
            out["nextPageToken"] = base64.urlsafe_b64encode(f"{digest}:{start + size}".encode()).decode()
        return out

    # --- Monitoring ------------------------------------------------------------------------
    def _time_series(self, project: str, body: dict[str, Any]) -> Any:
        if project != self.project:
            raise Refused(403, "PERMISSION_DENIED", f"Permission monitoring.timeSeries.create denied (or the "
                          f"resource may not exist) on projects/{project}", "forbidden")
        series = body.get("timeSeries")
        if not isinstance(series, list) or not series:
            raise _bad("timeSeries: at least one time series is required")
        if len(series) > MAX_SERIES:
            raise _bad(f"timeSeries: at most {MAX_SERIES} time series per request, got {len(series)}")
        now = datetime.fromtimestamp(self.clock(), timezone.utc)
        failures, keys = [], set()
        for i, ts in enumerate(series):
            try:
                key, point = self._check_series(ts, i, now)
                if key in keys:
                    raise _bad(f"Field timeSeries[{i}] had a duplicate time series")
                keys.add(key)
                kind, vtype = ts.get("metricKind", "GAUGE"), point[2]
                known = self.descriptors.setdefault(key[0], (kind, vtype))
                if known != (kind, vtype):
                    raise _bad(f"timeSeries[{i}]: Value type for metric {key[0]} must be {known[1]} and its kind "
                               f"{known[0]}, but is {vtype} {kind}")
                points = self.series.setdefault(key, [])
                if points and point[0] <= points[-1][0]:
                    raise _bad(f"timeSeries[{i}]: Points must be written in order. One or more of the points "
                               "specified had an older start time than the most recent point.")
                if points and (point[0] - points[-1][0]).total_seconds() < MIN_SAMPLE_S:
                    raise _bad(f"timeSeries[{i}]: One or more points were written more frequently than the "
                               "maximum sampling period configured for the metric.")
                points.append((point[0], point[1]))
            except Refused as err:
                failures.append(err.message)
        if failures:
            raise _bad(f"One or more TimeSeries could not be written: {'; '.join(failures[:5])}")
        return {}

    def _check_series(self, ts: Any, i: int, now: datetime) -> tuple[tuple[str, str, str], tuple[datetime, Any, str]]:
        where = f"timeSeries[{i}]"
        if not isinstance(ts, dict):
            raise _bad(f"{where}: not an object")
        metric = ts.get("metric") or {}
        mtype = metric.get("type", "")
        if not isinstance(mtype, str) or not mtype.startswith(METRIC_PREFIXES) or not re.fullmatch(
                r"[a-z]+\.googleapis\.com/[A-Za-z0-9_/.\-]{1,200}", mtype):
            raise _bad(f"{where}: metric type {mtype!r} is not a user-defined metric")
        labels = metric.get("labels") or {}
        if len(labels) > 30 or not all(METRIC_LABEL.match(k) and isinstance(v, str) and len(v) <= 1024
                                       for k, v in labels.items()):
            raise _bad(f"{where}: metric labels must be at most 30 keys of [a-z][a-z0-9_]* with string values")
        res = ts.get("resource") or {}
        want = LOG_RESOURCES.get(res.get("type", ""))
        if want is None or set(res.get("labels") or {}) != want:
            raise _bad(f"{where}: resource {res.get('type')!r} needs exactly the labels {sorted(want or ())}")
        kind = ts.get("metricKind", "GAUGE")
        if kind not in ("GAUGE", "DELTA", "CUMULATIVE"):
            raise _bad(f"{where}: metricKind {kind!r}")
        points = ts.get("points")
        if not isinstance(points, list) or len(points) != 1:
            raise _bad(f"{where}: Expected exactly one point per time series, got "
                       f"{len(points) if isinstance(points, list) else 0}")
        p = points[0]
        value = p.get("value") or {}
        kinds = [k for k in ("boolValue", "int64Value", "doubleValue", "stringValue", "distributionValue")
                 if k in value]
        if len(kinds) != 1:
            raise _bad(f"{where}: a point has exactly one typed value, got {kinds}")
        vtype = {"boolValue": "BOOL", "int64Value": "INT64", "doubleValue": "DOUBLE", "stringValue": "STRING",
                 "distributionValue": "DISTRIBUTION"}[kinds[0]]
        interval = p.get("interval") or {}
        try:
            end = parse_time(interval.get("endTime"))
            start = parse_time(interval["startTime"]) if "startTime" in interval else None
        except ValueError as err:
            raise _bad(f"{where}: {err}") from None
        if kind == "GAUGE" and start is not None and start != end:
            raise _bad(f"{where}: a GAUGE point's start time must equal its end time")
        if kind != "GAUGE" and (start is None or start >= end):
            raise _bad(f"{where}: a {kind} point needs a start time before its end time")
        if end < now - timedelta(hours=25) or end > now + timedelta(minutes=5):
            raise _bad(f"{where}: The end time must not be more than 25 hours in the past or more than five "
                       "minutes in the future.")
        key = (mtype, json.dumps(labels, sort_keys=True), json.dumps(res, sort_keys=True))
        return key, (end, value[kinds[0]], vtype)


class _Handler(BaseHTTPRequestHandler):
    obs: FakeObservability
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib signature
        pass  # `FakeObservability.calls` is the record

    def _send(self, status: int, answer: Any) -> None:
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=UTF-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, code: int, status: str, message: str) -> None:
        self._send(code, {"error": {"code": code, "status": status, "message": message}})

    def _serve(self) -> None:
        url = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_REQUEST:
            self.rfile.read(length)
            self._error(400, "INVALID_ARGUMENT", f"Request payload size exceeds the limit: {MAX_REQUEST} bytes.")
            return
        raw = self.rfile.read(length)
        query = parse_qs(url.query)
        key = query.get("key", [None])[0]  # the Catalog API also takes an API key
        bearer = self.headers.get("Authorization") == f"Bearer {self.obs.token}"
        if not bearer and not (key and url.path.startswith("/v1/services")):
            self._send(HTTPStatus.UNAUTHORIZED, {"error": {
                "code": 401, "status": "UNAUTHENTICATED",
                "message": "Request is missing required authentication credential.",
                "errors": [{"reason": "required", "message": "Login Required", "domain": "global"}]}})
            return
        try:
            body = json.loads(raw) if raw.strip() else None
        except ValueError:
            self._error(400, "INVALID_ARGUMENT", "Invalid JSON payload received.")
            return
        self._send(*self.obs.handle(self.command, url.path, query, body))

    do_GET = do_POST = _serve
