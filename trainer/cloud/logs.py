"""`python -m trainer logs`: a run's sessions in order, across recreated VMs, with the reason each
ended, from the entries the VMs' log shipper wrote to Cloud Logging (`trainer.cloud.log_shipper`), or
from a local file read with the same parse rule.

From Cloud Logging (`--project P --experiment NAME`): `entries:list` over
projects/P/logs/spottrain, filtered by the experiment's label (and `--run`, `--since`), oldest
first, every page; the token from application-default credentials (`gcloud auth
application-default login`; roles/logging.viewer on the project), or `--access-token-file`.
`SPOTTRAIN_LOGGING_API` points the calls at another endpoint (the loopback fake in the tests).

From a file (`--file F`): a journal export (`journalctl -o json`), Cloud Logging's own JSON
(`gcloud logging read --format=json`), or plain lines (a trainer's log, `journalctl -o
short-iso`); plain trainer lines start a new session at each `event=start`.

What it prints: one block per VM boot (the VM, its boot id, why it booted: `after=` of the boot
script's `event=boot`), its trainer sessions (first and last step, how each ended: finished,
preempted with its emergency save, paused, bad input, a crash and its exception, a checkpoint not
durable, an exit status, or no trace at all), and how the VM stopped (`event=shutdown`).
`--lines` adds each session's lines; `--json` prints the same as one JSON object.

Exit status: 0 shown (also when there is nothing to show: it says so), 1 the API refused or failed,
2 bad arguments or an unreadable file, 3 no credentials.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Callable, Iterable

from trainer.cloud.log_shipper import LABEL, LOG_ID, SCRIPT_RUNNER, entry, local_entry

DEFAULT_LOGGING_API = "https://logging.googleapis.com/v2"
PAGE_SIZE = 1000
#: `journalctl -o short-iso` prefix: TIME HOST IDENT[PID]: MESSAGE
_SHORT = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\S* \S+ (?P<ident>[^\s:\[]+)(?:\[\d+\])?: (?P<message>.*)$")
#: The trainer's lines this report reads, by their `event=NAME`. The events' names are said in
#: `trainer.observe.events`, which this standard-library module cannot import (it runs beside the
#: trainer): tests/trainer/cloud/test_logs.py fails when the two differ.
RESTORE, FINISHED, PREEMPTED, PAUSED, NOT_DURABLE, FAILED = (
    "restore", "finished", "preempted", "paused", "not_durable", "failed")
#: Lines the loop logs itself: a session's start, and a stop for a lost writer lease.
START, STOPPED = "start", "stopped"
_EXIT = re.compile(r"Main process exited, code=(?P<code>exited|killed|dumped), status=(?P<status>[^/\s]+)")
EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_NO_CREDENTIALS = 0, 1, 2, 3


class LogsError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


# --- reading -------------------------------------------------------------------------------------
def log_filter(project: str, experiment: str, *, since: datetime, run: str | None = None) -> str:
    """The entries:list filter of one experiment's entries since `since`."""
    parts = [f'logName="projects/{project}/logs/{LOG_ID}"', f'labels."{LABEL}"="{experiment}"',
             f'timestamp>="{since.strftime("%Y-%m-%dT%H:%M:%SZ")}"']
    if run:
        parts.append(f'jsonPayload.run="{run}"')
    return " AND ".join(parts)


def list_entries(client: Any, project: str, filter_text: str, *, api: str | None = None) -> list[dict[str, Any]]:
    """Every entry the filter selects, oldest first, page after page (`trainer.cloud.gce.Client`)."""
    base = (api or os.environ.get("SPOTTRAIN_LOGGING_API") or DEFAULT_LOGGING_API).rstrip("/")
    body: dict[str, Any] = {"resourceNames": [f"projects/{project}"], "filter": filter_text,
                            "orderBy": "timestamp asc", "pageSize": PAGE_SIZE}
    out: list[dict[str, Any]] = []
    while True:
        page = client.request("POST", f"{base}/entries:list", body=body) or {}
        out += page.get("entries", [])
        token = page.get("nextPageToken")
        if not token:
            return out
        body = {**body, "pageToken": token}


def read_file(path: Path) -> list[dict[str, Any]]:
    """The entries a local file stands for (see the module docstring)."""
    text = path.read_text(errors="replace")
    stripped = text.lstrip()
    if stripped.startswith("["):  # gcloud logging read --format=json
        data = json.loads(stripped)
        return [e for e in data if isinstance(e, dict)]
    cfg = {"experiment": "", "run": "", "project": "local"}
    out, session = [], 0
    for line in text.splitlines():
        if not line.strip():
            continue
        record: Any = None
        if line.lstrip().startswith("{"):
            try:
                record = json.loads(line)
            except ValueError:
                record = None
        if isinstance(record, dict) and "jsonPayload" in record:
            out.append(record)
            continue
        if isinstance(record, dict) and "MESSAGE" in record:
            out.append(entry(record, cfg, {}, by_format=True))
            continue
        m = _SHORT.match(line)
        message = m.group("message") if m else line
        if m and m.group("ident") == SCRIPT_RUNNER:
            message = re.sub(r"^(startup|shutdown)-script: ", "", message)
        e = local_entry(message, cfg, session="")
        if e["jsonPayload"].get("event") == START and e["jsonPayload"].get("source") == "trainer":
            session += 1
        if e["jsonPayload"].get("source") == "trainer":
            e["jsonPayload"]["session"] = f"local-{max(session, 1)}"
        out.append(e)
    return out


# --- the report ----------------------------------------------------------------------------------
@dataclass
class Session:
    session: str
    entries: list[dict[str, Any]] = field(default_factory=list)

    @property
    def payloads(self) -> list[dict[str, Any]]:
        return [e.get("jsonPayload", {}) for e in self.entries]

    def steps(self) -> tuple[int | None, int | None]:
        steps = [p["step"] for p in self.payloads if isinstance(p.get("step"), int) and p.get("source") == "trainer"]
        restore = next((p.get("step") for p in self.payloads if p.get("event") == RESTORE), None)
        first = restore if isinstance(restore, int) else (steps[0] if steps else None)
        return first, (steps[-1] if steps else first)

    def exit(self) -> str | None:
        for p in reversed(self.payloads):
            m = _EXIT.search(str(p.get("message", ""))) if p.get("source") == "systemd" else None
            if m:
                return m.group("status") if m.group("code") == "exited" else f"killed by SIG{m.group('status')}"
        return None

    def ended(self) -> str:
        """How this session ended, in words."""
        reason = None
        payloads = self.payloads
        for i, p in enumerate(payloads):
            event, f = p.get("event"), p.get("fields") or {}
            if p.get("source") != "trainer":
                continue
            step = p.get("step")
            if event == FINISHED:
                reason = f"finished at step {step}"
            elif event == PREEMPTED:
                saved = f" in {f['seconds']:.1f} s" if isinstance(f.get("seconds"), (int, float)) else ""
                reason = (f"preempted: emergency save of step {step}{saved}" if isinstance(step, int)
                          else "preempted before the first step (nothing to save)")
            elif event == PAUSED:
                reason = f"paused at step {step}"
            elif event == NOT_DURABLE:
                reason = f"trained to step {step}, but its final checkpoint was not durable on every tier (exit 74)"
            elif event == STOPPED:
                reason = f"stopped: {f.get('reason', 'see its lines')}"
            elif event == FAILED:
                why = f.get("reason")
                text = str(p.get("message", ""))
                if why == "bad_input":
                    reason = "bad input: " + text.split("reason=bad_input", 1)[-1].strip()[:300]
                elif why == "tier_unknown":
                    reason = "a checkpoint tier stayed unreadable (exit 69)"
                else:
                    tail = [q.get("message", "") for q in payloads[i + 1:]
                            if q.get("source") == "trainer" and "event" not in q and q.get("message", "").strip()]
                    reason = "crashed" + (f": {tail[-1].strip()[:300]}" if tail else "")
        code = self.exit()
        if reason is None:
            return f"exited {code} without saying why (see its lines)" if code else \
                "no trace of its end (VM lost, power-off or SIGKILL; or still running)"
        return reason + (f" (exit {code})" if code and "(exit" not in reason else "")

    def times(self) -> tuple[str, str]:
        stamps = [e.get("timestamp", "") for e in self.entries if e.get("timestamp")]
        return (stamps[0], stamps[-1]) if stamps else ("", "")


@dataclass
class Boot:
    node: str
    boot: str
    entries: list[dict[str, Any]] = field(default_factory=list)
    sessions: dict[str, Session] = field(default_factory=dict)

    def _event(self, name: str) -> dict[str, Any] | None:
        return next((e.get("jsonPayload", {}) for e in self.entries
                     if e.get("jsonPayload", {}).get("event") == name), None)

    @property
    def after(self) -> str | None:
        p = self._event("boot")
        return (p.get("fields") or {}).get("after") if p else None

    @property
    def shutdown(self) -> str | None:
        p = self._event("shutdown")
        if p is None:
            return None
        f = p.get("fields") or {}
        trainer = f" (trainer exit {f['trainer_status']})" if "trainer_status" in f else \
            " (no trainer running)" if f.get("trainer") == "not-running" else ""
        return f"{f.get('reason', '?')}{trainer}"

    @property
    def failed(self) -> str | None:
        p = self._event("boot_failed")
        return str(p.get("message", "")).split("FAILED:", 1)[-1].strip() if p else None


def report(entries: Iterable[dict[str, Any]]) -> list[Boot]:
    """The entries grouped into VM boots and their trainer sessions, in time order."""
    boots: dict[tuple[str, str], Boot] = {}
    ordered = sorted(entries, key=lambda e: e.get("timestamp") or "")
    for e in ordered:
        p = e.get("jsonPayload") or {}
        key = (str(p.get("node") or ""), str(p.get("boot") or ""))
        b = boots.setdefault(key, Boot(*key))
        b.entries.append(e)
        sid = p.get("session")
        if sid:
            b.sessions.setdefault(str(sid), Session(str(sid))).entries.append(e)
    return list(boots.values())


def as_json(boots: list[Boot]) -> dict[str, Any]:
    out = []
    for b in boots:
        sessions = []
        for s in b.sessions.values():
            first, last = s.steps()
            start, end = s.times()
            sessions.append({"session": s.session, "started": start, "last_line": end, "first_step": first,
                             "last_step": last, "exit": s.exit(), "ended": s.ended()})
        stamps = [e.get("timestamp", "") for e in b.entries if e.get("timestamp")]
        out.append({"node": b.node, "boot": b.boot, "after": b.after, "started": stamps[0] if stamps else "",
                    "last_line": stamps[-1] if stamps else "", "boot_failed": b.failed, "shutdown": b.shutdown,
                    "sessions": sessions})
    return {"vms": out, "sessions": sum(len(b.sessions) for b in boots)}


def _short(ts: str) -> str:
    return ts[:19].replace("T", " ") if ts else "?"


def describe(boots: list[Boot], *, title: str, lines: bool = False) -> list[str]:
    total = sum(len(b.sessions) for b in boots)
    vms = len({b.node for b in boots})
    if not boots:
        return [f"{title}: no log entries (nothing shipped yet, or --since is too recent)"]
    out = [f"{title}: {len(boots)} boot(s) of {vms} VM(s), {total} trainer session(s)"]
    for n, b in enumerate(boots, 1):
        stamps = [e.get("timestamp", "") for e in b.entries if e.get("timestamp")]
        why = f", after {b.after}" if b.after else ""
        out.append(f"{n}. VM {b.node or '?'} boot {b.boot[:8] or '?'} from {_short(stamps[0] if stamps else '')}{why}")
        if b.failed:
            out.append(f"   boot FAILED: {b.failed}")
        for s in b.sessions.values():
            first, last = s.steps()
            start, end = s.times()
            span = f"steps {first} -> {last}" if first is not None else "no step"
            out.append(f"   session {s.session}  {_short(start)} -> {_short(end)}  {span}  ended: {s.ended()}")
            if lines:
                for e in s.entries:
                    p = e.get("jsonPayload", {})
                    out.append(f"      {_short(e.get('timestamp', ''))} {p.get('source', '')}: {p.get('message', '')}")
        if b.shutdown:
            out.append(f"   VM stopped: {b.shutdown}")
        if lines:
            for e in b.entries:
                p = e.get("jsonPayload", {})
                if not p.get("session"):
                    out.append(f"      {_short(e.get('timestamp', ''))} {p.get('source', '')}: {p.get('message', '')}")
    return out


# --- command line --------------------------------------------------------------------------------
def adc_token() -> Callable[[], tuple[str, float]]:
    """A token source from application-default credentials (an exception if there are none)."""
    import google.auth
    import google.auth.transport.requests

    creds, _ = google.auth.default(scopes=["https://www.googleapis.com/auth/logging.read"])
    request = google.auth.transport.requests.Request()

    def token() -> tuple[str, float]:
        creds.refresh(request)
        valid = (creds.expiry.replace(tzinfo=timezone.utc).timestamp() - time.time()) \
            if getattr(creds, "expiry", None) else 300.0
        return creds.token, max(valid, 60.0)

    return token


def _since(value: str, now: datetime) -> datetime:
    m = re.fullmatch(r"(\d+)([mhd])", value)
    if m:
        n = int(m.group(1))
        return now - {"m": timedelta(minutes=n), "h": timedelta(hours=n), "d": timedelta(days=n)}[m.group(2)]
    try:
        t = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise LogsError(EXIT_BAD_INPUT, f"--since: {value!r} is neither a duration (30m, 12h, 7d) nor an "
                        "ISO time") from None
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--project", help="the experiment's Google Cloud project")
    p.add_argument("--experiment", help="the experiment (its file name): its entries carry this label")
    p.add_argument("--run", help="only this run (the checkpoint prefix, runs/NAME)")
    p.add_argument("--since", default="7d", help="how far back: 30m, 12h, 7d (default) or an ISO time")
    p.add_argument("--file", type=Path, help="read a local file instead: a journal export (journalctl -o json), "
                                              "gcloud logging read --format=json, or plain log lines")
    p.add_argument("--lines", action="store_true", help="also print each session's lines")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--access-token-file", type=Path,
                   help="a file holding an OAuth access token (default: application-default credentials)")


def run(args: argparse.Namespace, *, now: datetime | None = None) -> int:
    """The command; its exit status (errors as lines on stderr, never a traceback)."""
    try:
        if args.file is not None:
            if args.project or args.experiment:
                raise LogsError(EXIT_BAD_INPUT, "--file reads a local file: leave out --project and --experiment")
            try:
                entries = read_file(args.file)
            except (OSError, ValueError) as e:
                raise LogsError(EXIT_BAD_INPUT, f"{args.file}: cannot be read as log lines ({e})") from None
            title = f"{args.file}"
        else:
            if not args.project or not args.experiment:
                raise LogsError(EXIT_BAD_INPUT, "--project and --experiment are required (or --file)")
            since = _since(args.since, now or datetime.now(timezone.utc))
            entries = _fetch(args, since)
            title = f"experiment {args.experiment}" + (f", run {args.run}" if args.run else "") + \
                f" (project {args.project}, since {since.strftime('%Y-%m-%d %H:%M')} UTC)"
    except LogsError as e:
        print(f"logs: {e}", file=sys.stderr)
        return e.code
    boots = report(entries)
    if args.json:
        print(json.dumps({"title": title, **as_json(boots)}, indent=1))
    else:
        print("\n".join(describe(boots, title=title, lines=args.lines)))
    return EXIT_OK


def _fetch(args: argparse.Namespace, since: datetime) -> list[dict[str, Any]]:
    from trainer.cloud.gce import ApiError, Client

    if args.access_token_file is not None:
        try:
            value = args.access_token_file.read_text().strip()
        except OSError as e:
            raise LogsError(EXIT_BAD_INPUT, f"--access-token-file: {e}") from None
        token: Callable[[], tuple[str, float]] = lambda: (value, 3600.0)  # noqa: E731
    else:
        try:
            token = adc_token()
            token()
        except Exception as e:  # google.auth raises several kinds; none is worth a traceback here
            raise LogsError(EXIT_NO_CREDENTIALS, f"no usable application-default credentials ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else 'none'}); run `gcloud auth "
                            "application-default login`, or pass --access-token-file") from None
    try:
        return list_entries(Client(token=token, retries=2), args.project,
                            log_filter(args.project, args.experiment, since=since, run=args.run))
    except ApiError as e:
        hint = " (reading logs needs roles/logging.viewer on the project)" if e.code == 403 else ""
        raise LogsError(EXIT_FAILED, f"the Logging API answered {e.code} {e.status}: {e.message}{hint}") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer logs", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
