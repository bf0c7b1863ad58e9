"""The goodput ledger as a sink: every event the ledger records (``Event.kind``), on every node
leader, in the run dir and mirrored to the remote tier once the job may write it
(``trainer.observe.ledger``)."""
from __future__ import annotations

from typing import Any

from trainer.observe.bus import BaseSink, SinkContext
from trainer.observe.events import Event
from trainer.observe.sinks import register


class LedgerSink(BaseSink):
    name = "ledger"

    def __init__(self, ledger: Any) -> None:
        self.ledger = ledger

    def wants(self, event_type: type[Event]) -> bool:
        return event_type.kind is not None

    def handle(self, event: Event) -> None:
        self.ledger.append(event.kind, **event.fields())  # type: ignore[arg-type]

    def mirror_to(self, store: Any) -> None:
        self.ledger.mirror_to(store)

    def flush(self, timeout: float) -> bool:
        return self.ledger.flush(timeout)

    def close(self, timeout: float) -> bool:
        if not self.ledger.close(timeout=timeout):
            self.ledger.log.warning("event=ledger_mirror ok=0 detail=some goodput events reached only the run dir")
            return False
        return True


@register("ledger", default=True)
def make(ctx: SinkContext) -> LedgerSink | None:
    if not ctx.is_node_leader:
        return None
    from trainer.observe.ledger import Ledger

    return LedgerSink(Ledger(ctx.run_dir, session=ctx.session, log=ctx.log.getChild("goodput")))
