#!/usr/bin/env python3
"""The VM's log shipper: the trainer's and the boot scripts' journal lines as structured entries in
Cloud Logging (`entries:write`), so that every session's log outlives its VM.

It runs on the VM as `spottrain-logs.service`, which the startup script writes and starts before
anything else of the boot can fail; the file it runs is this module, verbatim (stdlib only, no
import of the trainer package, any python3 >= 3.8), so it ships the boot's own lines before the
trainer is even installed. `python -m trainer logs` reads the entries back and reads local files
(a journal export, a trainer's own log) with the same rules: `entry`, `parse_message`.

What it reads: `journalctl --follow --output=json --no-tail` over the trainer unit (its output and
systemd's lines about it), the other spottrain units and the metadata script runner (the startup
and shutdown scripts), from this boot's start, or after the cursor of the last entry Cloud Logging
accepted (a file on the boot disk, beside the journal: a VM started again with its boot disk ships
what the previous boot could not).

What one journal line becomes (one LogEntry):
- `logName` projects/P/logs/spottrain, `resource` gce_instance (project, instance id, zone), the
  label `spottrain-experiment` (what alerts and `logs` filter on), the journal's timestamp, an
  `insertId` derived from the journal cursor (a batch sent twice is deduplicated);
- `jsonPayload`: experiment, run (the checkpoint prefix, runs/NAME), node (the VM), boot (its boot
  id), session (the trainer unit's invocation id: one start of the trainer; absent on a boot
  script's line), source (trainer, systemd, startup, shutdown, the unit name, or logs for the
  shipper's own entries) and message (the line as written); and, only where the line is one the
  trainer or a boot script wrote itself (below), level, logger, rank, event, step and fields (the
  line's `key=value`s, numbers as numbers);
- `severity` from such a line's level (a boot script's "FAILED:" is ERROR), else the journal's
  priority.

Whose line it is. Alerts, log-based metrics, `logs` and the stall watchdog act on `event`, `step`
and `fields`, so those come only from text nobody else can write:
- the trainer unit's lines: only a line the trainer signed (`sign`: `TRAINER_LINE` followed by
  ` ~sig:` and an HMAC of the line under the VM's log key, `KEY_FILE`, which this shipper creates at
  start and the trainer reads, `SPOTTRAIN_LOG_KEY_FILE`). The trainer signs the first line of each
  record its own loggers write; what its task prints, what a library or a subprocess writes, a
  traceback's lines, and any line that text from a bucket, the data or an exception split off with
  a newline carry no valid signature and stay a plain message. The signature is taken off the
  message before it is shipped;
- a boot script's lines (`SCRIPT_LINE`, from the metadata script runner only);
- nothing else (systemd's lines, the other units').
Within such a line, `event=NAME` must be the first word after the prefix, then `key=value` words up
to the first word that is not one; a value is either one word or a double-quoted string with JSON
escapes (`quote`: how the trainer shows text from outside it, so that no `key=`, blank or newline in
that text is read as the line's own), and the first of two same keys wins.

The parse rule is this module's: `parse_message` (the format: `TRAINER_LINE`, `trainer.observe.
progress`'s TIME LEVEL LOGGER [rank=N] event=NAME key=value ...; `SCRIPT_LINE`, TIME
spottrain-startup: ...; then `fields`), `verify` (the signature) and `entry` (which lines may be
parsed). The entries' fields, the stack's log-based metrics (which filter on `jsonPayload.event`
and extract `jsonPayload.fields.*`) and `logs` all depend on it. `logs --file` reads a local file
(a trainer's own log, with no key) by the format alone: a person's view, which nothing acts on.

Delivery: batches of at most `MAX_ENTRIES` entries or `MAX_BYTES` once a second. The journal is
the buffer: the cursor advances only once Cloud Logging accepted a batch, and the reader stops
reading while `QUEUE_MAX` entries wait (journalctl then blocks; journald keeps the lines).
Throttling, server errors, a lost connection, an expired token and PERMISSION_DENIED (the
account's grant propagating after a deploy) are retried with a backoff doubling to a minute
(`trainer.retry`'s rule, mirrored: this file imports nothing of the trainer); a
batch the API refuses as invalid (400) is written with partialSuccess, reported on stderr, and
passed over: it would be refused forever.

The stall watchdog: while the trainer unit is active, the time since its last signed `event=step`
or `event=heartbeat` line (`PROGRESS_EVENTS`: the other nodes of a pool and a coordinator that does
not train log heartbeats, since only global rank 0 logs step lines) accumulates; past `stall_s` the
shipper writes its own entry `event=stalled` (again every `stall_s`
while it lasts). A trainer that hangs writes nothing, so nothing else could say it; the stack's
stall alert counts these entries ("no training progress for N minutes while a VM is up").

Stopping (SIGTERM, at power-off): it keeps shipping until the trainer unit is no longer active and
the journal is quiet, at most `drain_s`, then sends the rest: the emergency save's and the shutdown
script's lines reach Cloud Logging inside the shutdown window (the unit is also ordered to stop
after the trainer and the shutdown script).
"""
from __future__ import annotations

import collections
import hashlib
import hmac
import http.client
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from datetime import datetime, timezone
from typing import Any, Callable, Dict, List, Optional

DEFAULT_LOGGING_API = "https://logging.googleapis.com/v2"
LOG_ID = "spottrain"
LABEL = "spottrain-experiment"
#: The metadata script runner's journal identifier, and its prefixes of each script line.
SCRIPT_RUNNER = "google_metadata_script_runner"
SCRIPT_PREFIX = re.compile(r"^(?P<kind>startup|shutdown)-script: ")

#: The trainer's log line (`trainer.progress.setup_logging`).
TRAINER_LINE = re.compile(
    r"^(?P<time>\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:\.\d+)?Z?) "
    r"(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) "
    r"(?P<logger>[A-Za-z_][\w.]*) "
    r"(?:rank=(?P<rank>\d+) )?"
    r"(?P<text>.*)$")
#: A boot script's log line (`log` in templates/startup.sh.j2 and shutdown.sh.j2).
SCRIPT_LINE = re.compile(
    r"^(?P<time>\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:\.\d+)?Z) "
    r"(?P<logger>spottrain-(?:startup|shutdown)): "
    r"(?P<text>.*)$")
#: One `key=value` word of a line's text: a bare word, or a quoted string (`quote`).
PAIR = re.compile(r'(?P<key>[a-z][a-z0-9_]*)=(?P<value>"(?:[^"\\\n]|\\.)*"|[^\s"]\S*)(?=\s|$)')
#: The trainer's signature at the end of a line's first line (`sign`): 128 bits of HMAC-SHA256.
SIGNATURE = re.compile(r" ~sig:(?P<sig>[0-9a-f]{32})$")
#: Where the trainer finds the VM's log key (`spottrain.service` sets it) and the shipper keeps it:
#: /run is a tmpfs, so every boot has a new key, which the shipper creates before the trainer runs.
KEY_ENV = "SPOTTRAIN_LOG_KEY_FILE"
KEY_FILE = "/run/spottrain/log.key"
#: How much of one outside value a line shows (`quote`).
QUOTE_MAX = 512
_INT = re.compile(r"^-?\d{1,18}$")
_FLOAT = re.compile(r"^-?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?$")
_STEP = re.compile(r"^(\d{1,18})(?:/(\d{1,18}))?$")

#: What the watchdog counts as training progress: rank 0's step lines, and the heartbeat of every
#: other node of a pool and of a coordinator that only hosts the rendezvous store
#: (`trainer.observe.progress.Heartbeat`, `trainer.rendezvous.serve`), whose own lines would
#: otherwise never reset their node's stall clock.
PROGRESS_EVENTS = ("step", "heartbeat")
STALL_EVENT = "stalled"
#: journald PRIORITY -> LogEntry severity.
PRIORITY = {"0": "EMERGENCY", "1": "ALERT", "2": "CRITICAL", "3": "ERROR", "4": "WARNING",
            "5": "NOTICE", "6": "INFO", "7": "DEBUG"}
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
#: entries:write limits (cloud.google.com/logging/quotas): 10 MB a request, 256 KB an entry;
#: ours stay well inside both.
MAX_ENTRIES = 500
MAX_BYTES = 1 << 20
MAX_MESSAGE = 64 << 10
QUEUE_MAX = 20_000
#: Answers the shipper writes again: `trainer.retry`'s `RETRY_STATUS`, plus 401 (an expired token:
#: fetched again) and 403 (the account's grant propagating: retried for as long as the shipper
#: runs, since a passed-over batch is lost and the journal holds the rest meanwhile). The shipper
#: runs without the trainer package, so it mirrors these; a test holds them equal.
RETRY = (401, 403, 408, 429, 500, 502, 503, 504)
#: The longest wait between two writes (the first is the config's `retry_s`); as `trainer.retry`'s
#: waits for a grant (`IAM_GRANT.grace_cap_s`).
RETRY_CAP_S = 60.0
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


# --- the parse rule ----------------------------------------------------------------------------
def _number(value: str) -> Any:
    if _INT.match(value):
        return int(value)
    if _FLOAT.match(value):
        return float(value)
    return value


def quote(value: Any) -> str:
    """`value` as a line shows text from outside the trainer (a bucket object, the task, the data,
    an exception): one double-quoted word with JSON escapes, ASCII only, at most `QUOTE_MAX`
    characters of it. No blank, newline, quote or `key=` in it can end the word, start a line or
    become a field of the line it is in (`fields` reads it back as the text)."""
    text = str(value)
    if len(text) > QUOTE_MAX:
        text = text[:QUOTE_MAX] + f"... ({len(text) - QUOTE_MAX} more characters)"
    return json.dumps(text, ensure_ascii=True)


def _sig(key: bytes, line: str) -> str:
    return hmac.new(key, line.encode("utf-8", "surrogateescape"), hashlib.sha256).hexdigest()[:32]


def sign(key: bytes, text: str) -> str:
    """`text` (a log record, possibly of several lines) with its first line signed: the one line
    `entry` takes fields from. The lines after it (a traceback) stay plain messages."""
    first, nl, rest = text.partition("\n")
    return f"{first} ~sig:{_sig(key, first)}{nl}{rest}"


def verify(key: Optional[bytes], line: str) -> Optional[str]:
    """`line` without its signature when `key` signed it, else None."""
    m = SIGNATURE.search(line)
    if key is None or m is None:
        return None
    body = line[:m.start()]
    return body if hmac.compare_digest(m.group("sig"), _sig(key, body)) else None


def load_key(path: str, *, create: bool) -> Optional[bytes]:
    """The VM's log key from `path`; the shipper (`create`) makes one when there is none yet
    (exclusively: two starts never write two keys). None when there is none to read."""
    if create:
        try:
            os.makedirs(os.path.dirname(path) or ".", mode=0o755, exist_ok=True)
            fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(os.urandom(32).hex() + "\n")
            try:
                os.link(path + ".tmp", path)  # fails when a key exists: that one stays
            except FileExistsError:
                pass
            finally:
                os.unlink(path + ".tmp")
        except OSError:
            pass  # read below what is there, if anything
    try:
        with open(path) as f:
            key = f.read().strip()
    except OSError:
        return None
    return key.encode() if len(key) >= 32 else None


def fields(body: str) -> Dict[str, Any]:
    """The `key=value` words at the start of `body`, up to the first word that is not one (the
    first of two same keys wins; a quoted value is its text, a bare one a number where it is one)."""
    out: Dict[str, Any] = {}
    pos = 0
    while True:
        m = PAIR.match(body, pos)
        if m is None:
            return out
        value = m.group("value")
        if value.startswith('"'):
            try:
                parsed: Any = json.loads(value)
            except ValueError:
                return out
        else:
            parsed = _number(value)
        out.setdefault(m.group("key"), parsed)
        pos = m.end()
        if pos < len(body) and body[pos] == " ":
            pos += 1


def parse_message(text: str) -> Dict[str, Any]:
    """The structured fields of one log line by its format (a trainer's or a boot script's): level,
    logger, rank, event, step and `fields`; keys absent where the line has none. An event is the
    first word after the line's prefix, or there is none (and no fields). Which lines may be read
    this way at all is `entry`'s rule."""
    out: Dict[str, Any] = {}
    m = TRAINER_LINE.match(text)
    if m:
        out["level"], out["logger"] = m.group("level"), m.group("logger")
        if m.group("rank") is not None:
            out["rank"] = int(m.group("rank"))
        body = m.group("text")
    else:
        m = SCRIPT_LINE.match(text)
        if not m:
            return out
        out["logger"] = m.group("logger")
        body = m.group("text")
        if body.startswith("FAILED:") or " FAILED: " in body:
            out["level"] = "ERROR"
    if not body.startswith("event="):
        return out
    found = fields(body)
    if not isinstance(found.get("event"), str):
        return out
    out["event"] = found["event"]
    step = found.get("step")
    sm = _STEP.match(str(step)) if step is not None and not isinstance(step, float) else None
    if sm:
        out["step"] = int(sm.group(1))
        if sm.group(2):
            found["total_steps"] = int(sm.group(2))
    out["fields"] = found
    return out


def _timestamp(micros: str) -> str:
    t = datetime.fromtimestamp(int(micros) / 1e6, tz=timezone.utc)
    return t.strftime("%Y-%m-%dT%H:%M:%S.") + f"{t.microsecond:06d}Z"


def source_of(record: Dict[str, str], trainer_unit: str) -> str:
    """Which part of the VM wrote a journal record."""
    unit = record.get("_SYSTEMD_UNIT", "")
    if unit == trainer_unit:
        return "trainer"
    if record.get("SYSLOG_IDENTIFIER") == SCRIPT_RUNNER:
        m = SCRIPT_PREFIX.match(record.get("MESSAGE", ""))
        return m.group("kind") if m else "boot"
    if record.get("UNIT") and record.get("_PID") == "1":
        return "systemd"
    return unit.rsplit(".", 1)[0] if unit else record.get("SYSLOG_IDENTIFIER", "journal")


def entry(record: Dict[str, str], cfg: Dict[str, Any], resource: Dict[str, Any],
          key: Optional[bytes] = None, *, by_format: bool = False) -> Dict[str, Any]:
    """The LogEntry of one journal record (`journalctl --output=json`); `key` is the VM's log key,
    without which no trainer line is read for fields (see the module docstring). `by_format`: a
    journal export a person reads with `logs --file`, whose trainer lines are read by their format
    alone (there is no key to check them with; nothing acts on what that shows)."""
    trainer_unit = cfg.get("trainer_unit", "spottrain.service")
    message = record.get("MESSAGE", "")
    if not isinstance(message, str):  # journald gives non-UTF-8 messages as a list of bytes
        message = bytes(int(b) & 0xFF for b in message).decode("utf-8", "replace")
    message = message[:MAX_MESSAGE]
    source = source_of(record, trainer_unit)
    line = SCRIPT_PREFIX.sub("", message) if source in ("startup", "shutdown") else message
    payload: Dict[str, Any] = {"experiment": cfg["experiment"], "run": cfg["run"],
                               "node": record.get("_HOSTNAME", ""), "boot": record.get("_BOOT_ID", "")}
    invocation = record.get("_SYSTEMD_INVOCATION_ID") if record.get("_SYSTEMD_UNIT") == trainer_unit \
        else record.get("INVOCATION_ID") if record.get("UNIT") == trainer_unit else None
    if invocation:
        payload["session"] = invocation[:12]
    if source == "trainer":
        signed = SIGNATURE.sub("", line) if by_format else verify(key, line)
        if signed is not None and TRAINER_LINE.match(signed):
            line = signed
            payload.update(parse_message(line))
    elif source in ("startup", "shutdown") and SCRIPT_LINE.match(line):
        payload.update(parse_message(line))
    payload["source"] = source
    payload["message"] = line
    level = payload.get("level")
    severity = level if level in LEVELS else PRIORITY.get(str(record.get("PRIORITY", "")), "DEFAULT")
    cursor = record.get("__CURSOR", "")
    out = {"logName": f"projects/{cfg['project']}/logs/{cfg.get('log_id', LOG_ID)}",
           "resource": resource, "labels": {LABEL: cfg["experiment"]}, "severity": severity,
           "jsonPayload": payload}
    if record.get("__REALTIME_TIMESTAMP"):
        out["timestamp"] = _timestamp(record["__REALTIME_TIMESTAMP"])
    if cursor:
        out["insertId"] = hashlib.sha256(cursor.encode()).hexdigest()[:24]
    return out


def local_entry(line: str, cfg: Dict[str, Any], *, node: str = "", session: str = "") -> Dict[str, Any]:
    """The entry a plain log line (not a journal record) stands for: a trainer's own log file, read
    by the format alone (`logs --file`: a person's view, which nothing acts on)."""
    payload: Dict[str, Any] = {"experiment": cfg.get("experiment", ""), "run": cfg.get("run", ""), "node": node}
    if session:
        payload["session"] = session
    line = SIGNATURE.sub("", line)  # a VM's signed line, read by its format alone like any other here
    parsed = parse_message(line)
    payload.update(parsed)
    payload["source"] = "trainer" if "level" in parsed else "file"
    payload["message"] = line
    m = TRAINER_LINE.match(line) or SCRIPT_LINE.match(line)
    out = {"jsonPayload": payload, "severity": payload.get("level", "DEFAULT")}
    if m:
        out["timestamp"] = m.group("time") if m.group("time").endswith("Z") else m.group("time") + "Z"
    return out


# --- the VM's side -----------------------------------------------------------------------------
def metadata(path: str, timeout: float = 5.0) -> str:
    host = os.environ.get("GCE_METADATA_HOST") or "metadata.google.internal"
    req = urllib.request.Request(f"http://{host}/computeMetadata/v1/{path}", headers={"Metadata-Flavor": "Google"})
    with _DIRECT.open(req, timeout=timeout) as resp:
        return resp.read().decode()


class ApiRefused(Exception):
    def __init__(self, code: int, text: str) -> None:
        super().__init__(f"HTTP {code}: {text[:300]}")
        self.code = code


class Shipper:
    """Follows the journal and writes what it reads to Cloud Logging; see the module docstring."""

    def __init__(self, cfg: Dict[str, Any], *, api: Optional[str] = None,
                 say: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True)) -> None:
        self.cfg = cfg
        self.api = (api or os.environ.get("SPOTTRAIN_LOGGING_API") or DEFAULT_LOGGING_API).rstrip("/")
        self.say = say
        self.trainer_unit = cfg.get("trainer_unit", "spottrain.service")
        self.stall_s = float(cfg.get("stall_s", 1800))
        self.drain_s = float(cfg.get("drain_s", 10))
        self.retry_s = float(cfg.get("retry_s", 1.0))  # the first wait after a failed write
        self.cursor_file = cfg.get("cursor_file", "/var/lib/spottrain/logs.cursor")
        #: The VM's log key: what tells the trainer's own lines from any text in its output.
        self.key_file = cfg.get("key_file", KEY_FILE)
        self.key = load_key(self.key_file, create=True)
        if self.key is None:
            say(f"spottrain-logs: no log key in {self.key_file}: the trainer's lines are shipped as plain "
                "messages (no events, no fields) and the stall watchdog cannot see its steps")
        self.queue: "queue.Queue[Dict[str, str]]" = queue.Queue(maxsize=QUEUE_MAX)
        self.stopping = threading.Event()
        #: monotonic time by which a stopping shipper gives up (set once SIGTERM is seen)
        self.deadline: Optional[float] = None
        self.proc: Optional[subprocess.Popen] = None
        #: the cursors of the newest records the reader has queued (the reader thread appends)
        self._read: "collections.deque[str]" = collections.deque(maxlen=10_000)
        #: when stopping: the journal's newest matching record once the trainer is inactive,
        #: which must be queued and sent before the drain ends ("" when the journal has none)
        self._drain_to: Optional[str] = None
        self._token: Optional[str] = None
        self._token_expires = 0.0
        self.resource: Dict[str, Any] = {}
        # The watchdog: seconds the trainer unit was active since its last step line.
        self._active_s = 0.0
        self._last_poll = time.monotonic()
        self._next_poll = 0.0
        self._reported_at = 0.0
        self._last_step: Optional[int] = None
        self._session: Optional[str] = None
        self._node, self._boot = "", ""

    # --- journal ---------------------------------------------------------------------------
    def journal_command(self, cursor: Optional[str], *, follow: bool = True) -> List[str]:
        cmd = ["journalctl", *(["--follow", "--no-tail"] if follow else []), "--output=json", "--all"]
        cmd.append(f"--after-cursor={cursor}" if cursor else "--boot")
        matches: List[str] = []
        for unit in self.cfg.get("units", [self.trainer_unit]):
            matches += [f"_SYSTEMD_UNIT={unit}", "+", f"UNIT={unit}", "+"]
        for ident in self.cfg.get("identifiers", [SCRIPT_RUNNER]):
            matches += [f"SYSLOG_IDENTIFIER={ident}", "+"]
        return cmd + matches[:-1]

    def _read_cursor(self) -> Optional[str]:
        try:
            with open(self.cursor_file) as f:
                return f.read().strip() or None
        except OSError:
            return None

    def _write_cursor(self, cursor: str) -> None:
        try:
            os.makedirs(os.path.dirname(self.cursor_file), exist_ok=True)
            tmp = f"{self.cursor_file}.tmp"
            with open(tmp, "w") as f:
                f.write(cursor + "\n")
            os.replace(tmp, self.cursor_file)
        except OSError as e:
            self.say(f"spottrain-logs: cannot keep the journal cursor in {self.cursor_file}: {e}")

    def _reader(self) -> None:
        cursor = self._read_cursor()
        caught_up = False
        while not caught_up:
            # Once stopping, journalctl may be gone before it handed over the last lines (the
            # power-off's SIGTERM can reach it too): one read to the journal's end, from the last
            # record queued, is what the drain then waits for.
            caught_up = self.stopping.is_set()
            cmd = self.journal_command(cursor, follow=not caught_up)
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         stdin=subprocess.DEVNULL)
            assert self.proc.stdout is not None
            for raw in iter(self.proc.stdout.readline, b""):
                try:
                    record = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(record, dict):
                    self.queue.put(record)
                    cursor = record.get("__CURSOR") or cursor
                    if cursor:
                        self._read.append(cursor)
            rc = self.proc.wait()
            if self.stopping.is_set():
                continue
            err = (self.proc.stderr.read() if self.proc.stderr else b"").decode(errors="replace").strip()
            self.say(f"spottrain-logs: journalctl exited {rc}: {err[:300]}; reading again"
                     + ("" if cursor is None else " from the last entry read"))
            if rc != 0 and cursor is not None and "cursor" in err.lower():
                cursor = None  # a cursor journald no longer knows: this boot from its start
            self.stopping.wait(2.0)

    # --- Cloud Logging ---------------------------------------------------------------------
    def _bearer(self) -> str:
        if self._token is None or time.monotonic() > self._token_expires - 60:
            answer = json.loads(metadata("instance/service-accounts/default/token"))
            self._token = answer["access_token"]
            self._token_expires = time.monotonic() + float(answer.get("expires_in", 300))
        return self._token  # type: ignore[return-value]

    def _resource(self) -> Dict[str, Any]:
        if not self.resource:
            zone = metadata("instance/zone").rsplit("/", 1)[-1]
            self.resource = {"type": "gce_instance", "labels": {
                "project_id": self.cfg["project"], "instance_id": metadata("instance/id"), "zone": zone}}
        return self.resource

    def write(self, entries: List[Dict[str, Any]]) -> None:
        """One entries:write; ApiRefused for an answer that is not 200."""
        body = json.dumps({"entries": entries, "partialSuccess": True}).encode()
        req = urllib.request.Request(f"{self.api}/entries:write", data=body, method="POST", headers={
            "Authorization": f"Bearer {self._bearer()}", "Content-Type": "application/json"})
        opener = _DIRECT if urllib.parse.urlsplit(self.api).hostname in ("127.0.0.1", "localhost") \
            else urllib.request.build_opener()
        try:
            with opener.open(req, timeout=30) as resp:
                resp.read()
        except urllib.error.HTTPError as e:
            if e.code == 401:
                self._token = None
            raise ApiRefused(e.code, e.read().decode(errors="replace")) from None
        except (OSError, http.client.HTTPException) as e:
            raise ApiRefused(0, str(e)) from None

    def _stop_deadline(self) -> Optional[float]:
        if self.stopping.is_set() and self.deadline is None:
            self.deadline = time.monotonic() + self.drain_s
        return self.deadline

    def send(self, entries: List[Dict[str, Any]], cursor: Optional[str]) -> bool:
        """Write `entries` until Cloud Logging takes them (or refuses them for good); False when
        the stopping deadline passed first."""
        wait = self.retry_s
        while True:
            try:
                self.write(entries)
                break
            except (ApiRefused, OSError, ValueError, KeyError) as e:
                # KeyError, ValueError, OSError: no token from the metadata server (yet)
                code = e.code if isinstance(e, ApiRefused) else 0
                if code not in RETRY and code != 0:
                    self.say(f"spottrain-logs: Cloud Logging refused {len(entries)} entries ({e}); passing over them")
                    break
                deadline = self._stop_deadline()
                if deadline is not None and time.monotonic() + wait > deadline:
                    self.say(f"spottrain-logs: {len(entries)} entries not shipped before power-off ({e})")
                    return False
                self.say(f"spottrain-logs: entries:write failed ({e}); retrying in {wait:.0f} s")
                if deadline is None:
                    self.stopping.wait(wait)  # a SIGTERM cuts the wait short: the drain begins
                else:
                    time.sleep(wait)
                wait = min(wait * 2, RETRY_CAP_S)
        if cursor:
            self._write_cursor(cursor)
        return True

    # --- the watchdog ----------------------------------------------------------------------
    def _drained(self) -> bool:
        """Every record the journal held once the trainer stopped has been queued and sent.

        A quiet reader is not enough: under load `journalctl --follow` may not yet have handed
        over the unit's last lines (systemd's "Main process exited ... status=0", which is how
        `trainer logs` tells how a session ended) when the trainer is already inactive."""
        if self._drain_to is None:
            cmd = self.journal_command(None, follow=False)
            try:
                out = subprocess.run([*cmd, "--lines=1"], capture_output=True, text=True, timeout=10)
                last = json.loads(out.stdout.strip().splitlines()[-1]) if out.stdout.strip() else {}
            except (OSError, subprocess.SubprocessError, ValueError):
                last = {}  # no answer: the quiet rule alone decides, as before
            self._drain_to = str(last.get("__CURSOR") or "") if isinstance(last, dict) else ""
        return (not self._drain_to or self._drain_to in self._read) and self.queue.empty()

    def _trainer_active(self) -> bool:
        try:
            out = subprocess.run(["systemctl", "is-active", self.trainer_unit], capture_output=True,
                                 text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return False
        return out.stdout.strip() == "active"

    def watchdog(self, now: float) -> Optional[Dict[str, Any]]:
        """The `event=stalled` entry when one is due, else None. Polls the unit every 10 s."""
        if now < self._next_poll:
            return None
        elapsed, self._last_poll = now - self._last_poll, now
        self._next_poll = now + min(10.0, self.stall_s / 3)
        if not self._trainer_active():
            return None
        self._active_s += elapsed
        if self._active_s < self.stall_s or now - self._reported_at < self.stall_s:
            return None
        self._reported_at = now
        stalled = int(self._active_s)
        last = "none" if self._last_step is None else str(self._last_step)
        text = (f"event={STALL_EVENT} stalled_s={stalled} last_step={last} (no training step for "
                f"{stalled} s while the trainer unit is active)")
        payload: Dict[str, Any] = {"experiment": self.cfg["experiment"], "run": self.cfg["run"],
                                   "node": self._node, "boot": self._boot}
        if self._session:
            payload["session"] = self._session
        # The shipper's own words: its fields are read straight from them (no prefix, no signature).
        payload.update(event=STALL_EVENT, fields=fields(text), source="logs", message=text)
        now_wall = time.time()
        return {"logName": f"projects/{self.cfg['project']}/logs/{self.cfg.get('log_id', LOG_ID)}",
                "resource": self._resource(), "labels": {LABEL: self.cfg["experiment"]},
                "severity": "WARNING", "jsonPayload": payload,
                "timestamp": _timestamp(str(int(now_wall * 1e6))),
                "insertId": hashlib.sha256(f"stall-{self._boot}-{now_wall}".encode()).hexdigest()[:24]}

    def _saw(self, e: Dict[str, Any]) -> None:
        p = e["jsonPayload"]
        self._node, self._boot = p.get("node") or self._node, p.get("boot") or self._boot
        if p.get("source") == "trainer":
            self._session = p.get("session", self._session)
            if p.get("event") in PROGRESS_EVENTS:
                self._active_s, self._reported_at = 0.0, 0.0
                self._last_step = p.get("step", self._last_step)

    # --- the loop --------------------------------------------------------------------------
    def run(self) -> int:
        resource = None
        while resource is None:
            try:
                resource = self._resource()
            except (OSError, ValueError, http.client.HTTPException) as e:
                if self.stopping.wait(2.0):
                    return 0
                self.say(f"spottrain-logs: waiting for the metadata server ({e})")
        reader = threading.Thread(target=self._reader, name="journal", daemon=True)
        reader.start()
        quiet_since = time.monotonic()
        while True:
            deadline = self._stop_deadline()
            batch: List[Dict[str, Any]] = []
            size, cursor = 0, None
            try:
                record = self.queue.get(timeout=0.25 if deadline else 1.0)
                while True:
                    one = entry(record, self.cfg, resource, self.key)
                    self._saw(one)
                    batch.append(one)
                    size += len(json.dumps(one))
                    cursor = record.get("__CURSOR") or cursor
                    if len(batch) >= MAX_ENTRIES or size >= MAX_BYTES:
                        break
                    record = self.queue.get_nowait()
            except queue.Empty:
                pass
            now = time.monotonic()
            if batch:
                quiet_since = now
            stalled = self.watchdog(now) if deadline is None else None
            if stalled is not None:
                batch.append(stalled)
            if batch and not self.send(batch, cursor):
                break
            deadline = self._stop_deadline()
            if deadline is not None:
                done = not batch and now - quiet_since > 0.5 and not self._trainer_active() and self._drained()
                if done or now > deadline:
                    break
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
        return 0


def main(argv: Optional[List[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: log_shipper.py CONFIG.json", file=sys.stderr)
        return 2
    with open(args[0]) as f:
        cfg = json.load(f)
    shipper = Shipper(cfg)
    signal.signal(signal.SIGTERM, lambda *_: shipper.stopping.set())
    signal.signal(signal.SIGINT, lambda *_: shipper.stopping.set())
    return shipper.run()


if __name__ == "__main__":
    sys.exit(main())
