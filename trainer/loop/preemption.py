"""Preemption notices: SIGTERM/SIGINT and the GCE metadata server, turned into one flag.

Signal handlers only set the flag (and remember when), so a signal never interrupts a save: the
loop looks at the flag between steps and does the emergency save itself; a second signal is
logged and otherwise ignored. A daemon thread follows the metadata server's
``instance/preempted`` with ``wait_for_change=true``: Spot VMs see it flip to TRUE at the start of
the 30 s shutdown window. Off GCE the host does not resolve and the watcher backs off quietly.
"""
from __future__ import annotations

import http.client
import logging
import os
import signal
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Callable

from trainer import retry, startup_notice

PREEMPTED_PATH = "/computeMetadata/v1/instance/preempted"
DEFAULT_METADATA_HOST = "metadata.google.internal"
#: The watcher's waits after the metadata server did not answer: from half a second, doubling to
#: ``max_backoff_s``; without end (it is the only ear for a preemption the guest agent misses).
WATCH = retry.Policy(first_s=0.5, cap_s=30.0)


class Preemption:
    """The preemption flag. ``requested`` is cheap to read every step."""

    def __init__(self, log: logging.Logger | None = None):
        self.log = log or logging.getLogger("trainer.preemption")
        self._event = threading.Event()
        self.notice_monotonic: float | None = None
        self.reason: str | None = None
        #: Steps completed when the notice arrived: the emergency save lands at this step or, when
        #: the notice came during a step, at the next one (the step in flight is finished first).
        self.notice_step: int | None = None
        self._completed = 0
        self._lock = threading.Lock()
        self._previous: dict[int, object] = {}
        self._watcher: MetadataWatcher | None = None

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def step_completed(self, step: int) -> None:
        """The loop reports each finished step, so a notice can say where it found the loop."""
        self._completed = step

    def request(self, reason: str) -> None:
        with self._lock:
            if self._event.is_set():
                self.log.warning("event=preemption_notice again=1 reason=%s (already stopping; the save goes on)",
                                 reason)
                return
            self.notice_monotonic = time.monotonic()
            self.notice_step = self._completed
            self.reason = reason
            self._event.set()
        self.log.warning("event=preemption_notice reason=%s completed_step=%d", reason, self.notice_step)

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)

    def seconds_since_notice(self) -> float:
        """How long ago this process got its notice (0.0 without one)."""
        t = self.notice_monotonic
        return 0.0 if t is None or not self._event.is_set() else max(0.0, time.monotonic() - t)

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT set the flag (main thread only, as Python requires). A notice that
        start-up remembered before (``trainer.startup_notice``) sets it at once, with its time."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._on_signal)
        early = startup_notice.pending()
        if early is None:
            return
        with self._lock:
            if self._event.is_set():  # one of ours came in between: it stands
                return
            self.reason, self.notice_monotonic = early
            self.notice_step = self._completed
            self._event.set()
        self.log.warning("event=preemption_notice reason=%s completed_step=%d (during start-up)", self.reason,
                         self.notice_step)

    def _on_signal(self, signum: int, frame: object) -> None:
        # Runs between bytecodes of the main thread: logging here could deadlock on the
        # logging lock held by the interrupted code, so only note it and log from a thread.
        name = signal.Signals(signum).name
        if self._event.is_set():
            threading.Thread(target=self.request, args=(name,), daemon=True).start()
            return
        self.notice_monotonic = time.monotonic()
        self.notice_step = self._completed
        self.reason = name
        self._event.set()
        threading.Thread(target=self.log.warning, daemon=True,
                         args=("event=preemption_notice reason=%s completed_step=%d", name, self.notice_step)).start()

    def watch_metadata(self, host: str | None = None) -> "MetadataWatcher":
        host = host or os.environ.get("GCE_METADATA_HOST") or DEFAULT_METADATA_HOST
        self._watcher = MetadataWatcher(host, lambda: self.request("metadata instance/preempted=TRUE"), self.log)
        self._watcher.start()
        return self._watcher

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)  # type: ignore[arg-type]
        self._previous.clear()


class MetadataWatcher(threading.Thread):
    """Long-polls ``instance/preempted`` and calls ``on_preempted`` once it reads TRUE."""

    def __init__(self, host: str, on_preempted: Callable[[], None], log: logging.Logger,
                 *, max_backoff_s: float = WATCH.cap_s, poll_timeout_s: int = 300):
        super().__init__(name="metadata-preempted", daemon=True)
        self.base = f"http://{host}{PREEMPTED_PATH}"
        self.on_preempted = on_preempted
        self.log = log
        self.max_backoff_s = max_backoff_s
        self.poll_timeout_s = poll_timeout_s
        self._stopping = threading.Event()
        self.connected = threading.Event()  # set after the first successful answer (tests, logs)

    def stop(self) -> None:
        self._stopping.set()

    def _get(self, etag: str | None) -> tuple[str, str | None]:
        query = {}
        if etag is not None:
            query = {"wait_for_change": "true", "last_etag": etag, "timeout_sec": str(self.poll_timeout_s)}
        url = self.base + ("?" + urllib.parse.urlencode(query) if query else "")
        req = urllib.request.Request(url, headers={"Metadata-Flavor": "Google"})
        with urllib.request.urlopen(req, timeout=self.poll_timeout_s + 10) as resp:
            return resp.read().decode().strip(), resp.headers.get("ETag")

    def run(self) -> None:
        backoff = retry.Backoff(WATCH, cap_s=self.max_backoff_s)
        etag, complained = None, False
        while not self._stopping.is_set():
            try:
                value, new_etag = self._get(etag)
            except (OSError, urllib.error.URLError, http.client.HTTPException, ValueError) as e:
                # Off GCE, or a metadata hiccup (a refused connection, or an answer cut off when
                # the server restarts: IncompleteRead is not an OSError). Quiet, with backoff; say
                # it once at debug level. The thread must outlive any of these: it is the only
                # thing that hears a preemption the guest agent does not turn into a SIGTERM.
                if not complained:
                    self.log.debug("metadata server not reachable at %s (%s); retrying with backoff", self.base, e)
                    complained = True
                etag = None
                if self._stopping.wait(backoff.next()):
                    return
                continue
            if self._stopping.is_set():  # the session closed while the long poll was open: not its notice
                return
            backoff.reset()
            if not self.connected.is_set():
                self.connected.set()
                self.log.info("event=metadata_watch url=%s preempted=%s", self.base, value)
            if value.upper() == "TRUE":
                self.on_preempted()
                return
            # Without an ETag, wait_for_change still returns on the next change (or its timeout).
            etag = new_etag if new_etag is not None else ""
