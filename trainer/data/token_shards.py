"""A dataset over memory-mapped token shards: nanoGPT's ``.bin`` format, one file or many.

A shard is a flat array of token ids with no header, little-endian ``uint16`` (nanoGPT's
``prepare.py``, vocabularies up to 65,536 such as GPT-2's) or ``uint32`` (larger vocabularies),
chosen by ``dtype``: the file alone does not say which. Shards are taken in the order of their
names (``train_000.bin``, ``train_001.bin``, ...).

Sample ``i`` is a window of ``block_size + 1`` tokens, returned as ``(x, y)`` = (the first
``block_size``, the last ``block_size``) as int64. Windows start every ``stride`` tokens
(default ``block_size``: every token once per epoch; ``stride = 1`` is nanoGPT's "any start
position", about 9·10^9 samples for OpenWebText) and never straddle two files: shards are
usually cut at arbitrary points, and a window across a cut would join unrelated text; only a
file's last few tokens, too few for one more step of ``stride``, start no window.

Nothing is materialised per window: the dataset keeps one cumulative window count per file and
finds a window's file by bisection, so with the trainer's bijection order it serves 10^10 windows
in constant memory. Files are opened (mmap, read-only) lazily in each process, so the dataset
crosses a fork or a pickle to a data worker as a list of paths. It needs no numpy.

Given the model's ``vocab_size``, every shard is checked once to hold only ids below it: a
flipped bit, or shards read with the wrong ``dtype``, would otherwise crash the embedding with an
``IndexError`` at some step after every resume. The check reads each file once (its largest id
and where it is) and remembers the answer by the file's path, size and modification time, in
the process and in ``$XDG_CACHE_HOME/spottrain/token-shards/`` (best effort), so a restart reads
nothing again; a file rewritten since is read again (a bit that rots on the disk without a write
is not seen until the file changes).
"""
from __future__ import annotations

import bisect
import hashlib
import json
import mmap
import os
from pathlib import Path
from typing import Any, Sequence

import torch

DTYPES = {"uint16": (2, torch.int16, 0xFFFF), "uint32": (4, torch.int32, 0xFFFFFFFF)}
#: Bytes read at a time by the vocabulary check.
_CHUNK = 16 << 20
#: (path, size, mtime_ns, dtype) -> (largest id, its first position): this process's answers.
_largest: dict[tuple[str, int, int, str], tuple[int, int]] = {}


class TokenShardError(ValueError):
    """The shards cannot be used as given (the message names the file and the problem)."""


def find_shards(spec: str | os.PathLike[str], base: Path | None = None) -> list[Path]:
    """The shard files ``spec`` names: a file, a directory (its ``*.bin``), or a glob pattern;
    relative to ``base`` (the staged data directory) unless absolute."""
    path = Path(spec)
    if not path.is_absolute():
        if base is None:
            raise TokenShardError(f"{spec}: a relative data path needs a data_dir (the staged data)")
        path = base / path
    if path.is_dir():
        files = sorted(p for p in path.glob("*.bin") if p.is_file())
    elif any(c in path.name for c in "*?["):
        files = sorted(p for p in path.parent.glob(path.name) if p.is_file())
    else:
        if not path.is_file():
            raise TokenShardError(f"{path}: no such file")
        files = [path]
    if not files:
        raise TokenShardError(f"{path}: no .bin token shards there")
    return files


class TokenShards:
    """Windows of ``block_size + 1`` tokens over ``files``; see the module docstring."""

    def __init__(self, files: Sequence[str | os.PathLike[str]], *, block_size: int, dtype: str = "uint16",
                 stride: int | None = None, vocab_size: int | None = None):
        if dtype not in DTYPES:
            raise TokenShardError(f"dtype: must be one of {sorted(DTYPES)}, got {dtype!r}")
        if block_size < 1 or (stride is not None and stride < 1):
            raise TokenShardError("block_size and stride must be >= 1")
        self.files = [Path(f) for f in files]
        self.block_size, self.dtype, self.vocab_size = block_size, dtype, vocab_size
        self.stride = stride or block_size
        self.itemsize = DTYPES[dtype][0]
        self.tokens: list[int] = []
        self.cumulative: list[int] = []  # windows in files [0, k]
        total = 0
        for f in self.files:
            try:
                size = f.stat().st_size
            except OSError as e:
                raise TokenShardError(f"{f}: cannot read: {e.strerror}") from None
            if size % self.itemsize:
                raise TokenShardError(f"{f}: {size} bytes is not a whole number of {dtype} tokens "
                                      f"(is the dtype right?)")
            n = size // self.itemsize
            if vocab_size is not None and n:
                top, at = largest_token(f, dtype)
                if top >= vocab_size:
                    raise TokenShardError(f"{f} holds token id {top} at token {at}; vocab_size is {vocab_size} "
                                          f"(a corrupt shard, or token_dtype is not {dtype})")
            self.tokens.append(n)
            total += (n - block_size - 1) // self.stride + 1 if n >= block_size + 1 else 0
            self.cumulative.append(total)
        if total == 0:
            raise TokenShardError(f"{self.files[0]}: no window of {block_size + 1} tokens fits in "
                                  f"{'this file' if len(self.files) == 1 else 'any of the files'}")
        self._maps: dict[int, Any] = {}

    def __len__(self) -> int:
        return self.cumulative[-1]

    def locate(self, i: int) -> tuple[int, int]:
        """(file number, first token) of window ``i``."""
        if not 0 <= i < len(self):
            raise IndexError(i)
        f = bisect.bisect_right(self.cumulative, i)
        before = self.cumulative[f - 1] if f else 0
        return f, (i - before) * self.stride

    def _map(self, f: int) -> Any:
        m = self._maps.get(f)
        if m is None:
            with open(self.files[f], "rb") as fh:
                m = self._maps[f] = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        return m

    def window(self, i: int) -> torch.Tensor:
        """The ``block_size + 1`` tokens of window ``i`` as int64."""
        f, start = self.locate(i)
        size, signed, mask = DTYPES[self.dtype]
        raw = bytearray(self._map(f)[start * size:(start + self.block_size + 1) * size])
        # Read as the signed type of the same width (torch < 2.3 has no uint16), then unsigned.
        return torch.frombuffer(raw, dtype=signed).to(torch.int64) & mask

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.window(i)
        return w[:-1], w[1:]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": {}}  # maps are per process


def largest_token(path: Path, dtype: str) -> tuple[int, int]:
    """The largest token id in the shard ``path`` and its first position (see the module
    docstring: read once, remembered by path, size and modification time)."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns, dtype)
    got = _largest.get(key)
    if got is None:
        got = _remembered(key)
    if got is None:
        got = _scan(path, dtype)
        _remember(key, got)
    _largest[key] = got
    return got


def _scan(path: Path, dtype: str) -> tuple[int, int]:
    size, signed, mask = DTYPES[dtype]
    top, at, done = -1, 0, 0
    with open(path, "rb") as f:
        while True:
            raw = f.read(_CHUNK)
            if not raw:
                break
            raw = raw[: len(raw) - len(raw) % size]
            ids = torch.frombuffer(bytearray(raw), dtype=signed).to(torch.int64) & mask
            i = int(torch.argmax(ids))  # the first of the largest
            if int(ids[i]) > top:
                top, at = int(ids[i]), done + i
            done += len(ids)
    return top, at


def _cache_file(key: tuple[str, int, int, str]) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "spottrain" / "token-shards" / (hashlib.sha256(f"{key[0]}\0{key[3]}".encode()).hexdigest()[:32]
                                                          + ".json")


def _remembered(key: tuple[str, int, int, str]) -> tuple[int, int] | None:
    try:
        doc = json.loads(_cache_file(key).read_text())
        if [doc["path"], doc["size"], doc["mtime_ns"], doc["dtype"]] == list(key):
            return int(doc["largest"]), int(doc["at"])
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        pass
    return None


def _remember(key: tuple[str, int, int, str], got: tuple[int, int]) -> None:
    path = _cache_file(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"path": key[0], "size": key[1], "mtime_ns": key[2], "dtype": key[3],
                                   "largest": got[0], "at": got[1]}))
        os.replace(tmp, path)
    except OSError:
        pass  # a cache: without it the next start reads the file again
