"""What the stream tests share: reading a ``Stream`` in pieces, each piece a new stream resumed
from the state the one before it saved."""
from __future__ import annotations

from typing import Any, Callable

from trainer.data.streaming import Stream


def take(stream: Stream, k: int) -> list[int]:
    return [int(x) for _ in range(k) for x in stream.next()[0].view(-1)]


def read_in_pieces(make: Callable[[], Stream], pieces: tuple[int, ...]) -> tuple[list[int], dict[str, Any]]:
    """The samples of ``pieces[0]`` batches, then ``pieces[1]`` from a new stream resumed from the
    first one's state, and so on; and the last state."""
    got: list[int] = []
    state: dict[str, Any] | None = None
    for k in pieces:
        s = make()
        if state is not None:
            s.load_state_dict(state)
        got += take(s, k)
        state = s.state_dict()
        s.close()
    assert state is not None
    return got, state
