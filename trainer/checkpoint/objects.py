"""What a store and the streams that move its large objects (``trainer.checkpoint.gcs_streams``)
both speak of, below either of them: ``ObjectInfo`` (one object as a listing shows it),
``UploadAborted`` (an upload stopped on purpose) and ``Readable`` (what an upload reads).
``trainer.checkpoint.stores`` re-exports the first two."""

from __future__ import annotations

from typing import NamedTuple, Protocol

from trainer import retry


class ObjectInfo(NamedTuple):
    """One object as a listing shows it."""

    size: int
    crc32c: str  # base64, as GCS reports it
    generation: int


class UploadAborted(retry.Aborted):
    """An upload was stopped on purpose (deadline passed or the checkpointer is shutting down)."""


class Readable(Protocol):
    """A file-like source of an upload's bytes: an open file, a range of one, host memory. Read
    from where it is; an upload's retry seeks back to where it began."""

    def read(self, n: int = -1, /) -> bytes: ...
    def seek(self, offset: int, whence: int = 0, /) -> int: ...
    def tell(self) -> int: ...


__all__ = ["ObjectInfo", "Readable", "UploadAborted"]
