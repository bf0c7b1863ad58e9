"""The sinks of the run's events, by registry: adding one is adding a module here.

A sink module registers a factory under its name (``register``); the registry imports every module
of this package, so a new sink (Cloud Logging, W&B, MLflow, ...) is one file::

    # trainer/observe/sinks/mysink.py
    from pydantic import BaseModel

    from trainer.observe.bus import BaseSink, SinkContext
    from trainer.observe.events import Finished, Step
    from trainer.observe.sinks import register


    class Settings(BaseModel, extra="forbid"):
        url: str                              # [sinks.mysink] url = "..." in the run's config


    class MySink(BaseSink):
        name = "mysink"
        handles = (Step, Finished)            # the event types it wants

        def __init__(self, url: str) -> None:
            self.url = url

        def handle(self, event) -> None:
            ...                               # never block the loop: queue, send on a thread


    @register("mysink", settings=Settings)
    def make(ctx: SinkContext):
        return MySink(ctx.settings["url"]) if ctx.is_main else None   # None: not on this rank

A sink with ``settings`` runs when the run's config has its table (``[sinks.mysink]``, validated
by ``Settings`` when the config is read: a bad value is exit 2 naming ``sinks.mysink.FIELD``);
one registered with ``default=True`` runs unless its factory says no (the log line, the ledger,
TensorBoard). A sink module imports what it needs inside its factory, so that reading a config
stays light. ``docs/development.md`` walks through one.
"""
from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from typing import Any, Callable

from trainer.observe.bus import Sink, SinkContext


class SinkUnavailable(Exception):
    """A sink named in the run's config cannot run here (its package is not installed): bad input."""


@dataclasses.dataclass(frozen=True)
class Registered:
    name: str
    make: Callable[[SinkContext], Sink | None]
    settings: Any = None     # a pydantic model of ``[sinks.NAME]`` (None: it has no table)
    default: bool = False    # runs without a table


#: Every sink by name, in the order they were registered (the built-in ones first).
SINKS: dict[str, Registered] = {}
_BUILT_IN = ("log", "ledger", "tensorboard")
_discovered = False


def register(name: str, *, settings: Any = None, default: bool = False) -> Callable[..., Any]:
    """Decorator: ``make(ctx) -> Sink | None`` is the factory of sink ``name``."""
    def decorate(make: Callable[[SinkContext], Sink | None]) -> Callable[[SinkContext], Sink | None]:
        if name in SINKS and SINKS[name].make is not make:
            raise ValueError(f"sink {name!r} is registered twice")
        SINKS[name] = Registered(name, make, settings, default)
        return make
    return decorate


def discover() -> dict[str, Registered]:
    """Import every sink module of this package (once); the registry."""
    global _discovered
    if not _discovered:
        for module in pkgutil.iter_modules(__path__):
            importlib.import_module(f"{__name__}.{module.name}")
        _discovered = True
    order = {name: i for i, name in enumerate(_BUILT_IN)}
    return {name: SINKS[name] for name in sorted(SINKS, key=lambda n: (order.get(n, len(order)), n))}


def validate(tables: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``[sinks.NAME]`` tables checked against their sinks' settings; ValueError naming the
    sink and the field otherwise."""
    from pydantic import ValidationError

    sinks = discover()
    out: dict[str, dict[str, Any]] = {}
    for name, table in tables.items():
        reg = sinks.get(name)
        if reg is None or reg.settings is None:
            known = sorted(n for n, r in sinks.items() if r.settings is not None)
            raise ValueError(f"{name}: no such sink with settings; allowed: {', '.join(known) or 'none'}")
        try:
            out[name] = reg.settings.model_validate(table or {}).model_dump()
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            raise ValueError(f"{name}{'.' + where if where else ''}: {err['msg']}") from None
    return out


def build(ctx: SinkContext, tables: dict[str, dict[str, Any]], *, only: tuple[str, ...] | None = None,
          skip: tuple[str, ...] = ()) -> list[Sink]:
    """The sinks that run in this process: every default one, and those with a table (``only``
    these names, none of ``skip``: the loop builds the log line first, the others once the run
    dir is locked)."""
    out = []
    for name, reg in discover().items():
        if not (reg.default or name in tables) or name in skip or (only is not None and name not in only):
            continue
        sink = reg.make(dataclasses.replace(ctx, settings=dict(tables.get(name) or {})))
        if sink is not None:
            out.append(sink)
    return out
