"""Every event as one JSON line in a file of your choice: the smallest sink there is, for a
watcher of your own (``tail -f``, a log shipper) and the one to copy when writing a sink.

``[sinks.jsonl] path = "/var/log/spottrain/events.jsonl"`` in the run's config; each line is
``{"event": NAME, "t": UNIX_TIME, "rank": RANK, ...the event's fields}`` (NAME: the ledger's name
where the ledger records it, else the event's type, e.g. ``Step``). On rank 0 only unless
``every_rank``; a write that fails is counted by the bus and never stops the run.
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from trainer.observe.bus import BaseSink, SinkContext
from trainer.observe.events import Event
from trainer.observe.sinks import register


class Settings(BaseModel):
    """``[sinks.jsonl]``."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    path: Path
    every_rank: bool = False


class JsonLines(BaseSink):
    name = "jsonl"

    def __init__(self, path: Path, rank: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", buffering=1, encoding="utf-8")  # line-buffered: a line at a time
        self._rank = rank

    def handle(self, event: Event) -> None:
        fields: dict[str, Any] = {f.name: getattr(event, f.name) for f in dataclasses.fields(event)}
        line = {"event": event.kind or type(event).__name__, "t": time.time(), "rank": self._rank, **fields}
        self._file.write(json.dumps(line, sort_keys=True, default=str, allow_nan=True) + "\n")

    def close(self, timeout: float) -> bool:
        self._file.close()
        return True


@register("jsonl", settings=Settings)
def make(ctx: SinkContext) -> JsonLines | None:
    if not (ctx.is_main or ctx.settings.get("every_rank")):
        return None
    path = Path(ctx.settings["path"])
    if ctx.settings.get("every_rank") and ctx.rank:
        path = path.with_name(f"{path.stem}.rank{ctx.rank}{path.suffix}")
    return JsonLines(path, ctx.rank)
