"""The seam between the run and whoever watches it: events in, sinks out.

The loop emits every event (``trainer.observe.events``) once, on the ``Bus``; each sink consumes
it. A sink never stops the run: an error in one is logged (the first time, then counted) and the
other sinks still get the event. Sinks are built by the registry (``trainer.observe.sinks``) from
the run's settings, one set per process; each decides from the ``SinkContext`` whether it runs on
this rank (the ledger on every node leader, TensorBoard on rank 0, the log line everywhere).

Lifecycle besides events: ``mirror_to(store)`` once the job may write its remote mirror tier (the
writer lease is held), ``flush(timeout)`` when a preemption leaves little time, ``close(timeout)``
at the end (True when nothing of a sink's was left only on this VM).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Protocol

from trainer.observe.events import Event


class Sink(Protocol):
    """What a sink is to the bus (``BaseSink`` gives the lifecycle's defaults)."""

    name: str

    def handle(self, event: Event) -> None: ...
    def wants(self, event_type: type[Event]) -> bool: ...
    def mirror_to(self, store: Any) -> None: ...
    def flush(self, timeout: float) -> bool: ...
    def close(self, timeout: float) -> bool: ...


class BaseSink:
    """A sink with nothing to mirror, flush or close; ``handle`` is the sink's own."""

    name = "sink"
    #: The event types this sink does something with (None: every one).
    handles: tuple[type[Event], ...] | None = None

    def handle(self, event: Event) -> None:
        raise NotImplementedError

    def wants(self, event_type: type[Event]) -> bool:
        return self.handles is None or issubclass(event_type, self.handles)

    def mirror_to(self, store: Any) -> None:
        pass

    def flush(self, timeout: float) -> bool:
        return True

    def close(self, timeout: float) -> bool:
        return True


@dataclasses.dataclass
class SinkContext:
    """What a sink factory may need to know about the run (``trainer.observe.sinks``)."""

    cfg: Any                      # the run's ``RunConfig``
    run_dir: Path
    session: str                  # this session's id (the ledger's, TensorBoard's file names)
    rank: int
    is_main: bool                 # rank 0: speaks for the job
    is_node_leader: bool          # local rank 0: this VM's own records
    log: logging.Logger
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)  # ``[sinks.NAME]``, validated


class Bus:
    """Hands each event to every sink; never raises (see the module docstring)."""

    def __init__(self, sinks: list[Sink] | None = None, *, log: logging.Logger | None = None) -> None:
        self.sinks: list[Sink] = list(sinks or [])
        self.log = log or logging.getLogger("trainer.observe")
        self._errors: dict[str, int] = {}

    def add(self, sink: Sink) -> None:
        self.sinks.append(sink)

    def sink(self, name: str) -> Any:
        """The sink called ``name``, or None when it does not run here."""
        return next((s for s in self.sinks if s.name == name), None)

    def wants(self, event_type: type[Event]) -> bool:
        """Some sink does something with events of this type (an event costly to make is made only then)."""
        return any(s.wants(event_type) for s in self.sinks)

    def emit(self, event: Event) -> None:
        for s in self.sinks:
            if not s.wants(type(event)):
                continue
            try:
                s.handle(event)
            except Exception as e:  # noqa: BLE001 - watching the run never stops it
                self._failed(s, "handle", e)

    def _failed(self, sink: Sink, what: str, e: BaseException) -> None:
        n = self._errors[sink.name] = self._errors.get(sink.name, 0) + 1
        if n & (n - 1) == 0:  # the 1st, 2nd, 4th, ... failure
            self.log.warning("event=sink_error sink=%s what=%s count=%d error=%r (training goes on)",
                             sink.name, what, n, e)

    def mirror_to(self, store: Any) -> None:
        for s in self.sinks:
            try:
                s.mirror_to(store)
            except Exception as e:  # noqa: BLE001
                self._failed(s, "mirror", e)

    def flush(self, deadline: float) -> bool:
        ok = True
        for s in self.sinks:
            try:
                ok = s.flush(max(0.0, deadline - time.monotonic())) and ok
            except Exception as e:  # noqa: BLE001
                self._failed(s, "flush", e)
                ok = False
        return ok

    def close(self, deadline: float, *, floor: float = 0.0) -> dict[str, bool]:
        """Close every sink, each given what is left until ``deadline`` (at least ``floor``
        seconds); which of them left nothing only on this VM."""
        out = {}
        for s in self.sinks:
            try:
                out[s.name] = s.close(max(floor, deadline - time.monotonic()))
            except Exception as e:  # noqa: BLE001
                self._failed(s, "close", e)
                out[s.name] = False
        return out
