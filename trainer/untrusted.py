"""JSON that someone else may have written: parsed only within a size bound, and any way it fails
is one exception; and text that someone else wrote, as a log line shows it (:func:`shown`).

Whoever can write the job's bucket (without holding the checkpoint key) can put any bytes in
any object: a manifest, the writer lease, a ledger event, a control job's answer. What is read
from there is parsed with :func:`loads`, which refuses more than ``limit`` bytes before parsing
and turns every way a parse can fail (invalid JSON, invalid UTF-8, nesting deep enough to raise
``RecursionError``) into :class:`Garbage`, a ``ValueError``: the caller treats the object as not
what it should be (a manifest as no checkpoint, the lease as an unreadable one), never as a
reason to crash or to call a tier unknown.

Text read from there (a lease's holder, a manifest's key id or hash name), from the task, the data
or an exception reaches log lines only through :func:`shown`: one quoted word, so that no newline,
blank or ``key=`` in it can start a line or become a field of the line it is in. What alerts,
metrics and the stall watchdog act on is the trainer's signed lines' own fields
(``trainer.cloud.log_shipper``); this keeps what someone else wrote inside one of them.

Standard library only: the modules beside the trainer use it too.
"""
from __future__ import annotations

import json
from typing import Any

from trainer.cloud.log_shipper import quote

#: A manifest: a sharded one lists every rank's files (~200 bytes each).
MANIFEST_MAX_BYTES = 16 << 20
#: The writer lease, a ledger event, a control job's request or answer: each well under it.
SMALL_MAX_BYTES = 1 << 20


class Garbage(ValueError):
    """An object that is not the JSON it should be (too big, not JSON, nested too deeply)."""


def loads(data: bytes | str, *, limit: int, what: str = "object") -> Any:
    """``json.loads(data)`` for at most ``limit`` bytes; :class:`Garbage` for anything else."""
    if len(data) > limit:
        raise Garbage(f"{what} is {len(data)} bytes, more than the {limit} it may be")
    try:
        return json.loads(data)
    except RecursionError:
        raise Garbage(f"{what} is nested too deeply to be one") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise Garbage(f"{what} is not valid JSON ({e})") from None


def shown(value: Any) -> str:
    """``value``, written by someone else, as a log line or a message that may be logged shows it:
    one double-quoted word with JSON escapes (``trainer.cloud.log_shipper.quote``)."""
    return quote(value)
