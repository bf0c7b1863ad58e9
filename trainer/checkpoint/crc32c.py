"""CRC32C, the checksum Cloud Storage keeps for every object, composite ones included (they have
no MD5): of bytes, of a file or a byte range of one, in the base64 form of an object's metadata,
and of a concatenation from its parts' checksums (``combine``), which is how a sliced download
checks the whole object from its slices and a composite upload checks the composed object
against its parts, without reading anything twice.
"""
from __future__ import annotations

import base64
from pathlib import Path

from trainer.checkpoint.objects import Readable

_POLY = 0x82F63B78  # Castagnoli, reflected
_CHUNK = 16 << 20


def _gf2_times(mat: list[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _gf2_square(mat: list[int]) -> list[int]:
    return [_gf2_times(mat, mat[n]) for n in range(32)]


def combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC32C of A + B from crc(A), crc(B) and len(B) (zlib's crc32_combine, Castagnoli):
    O(log len(B)), nothing read again."""
    if len2 <= 0:
        return crc1
    odd = [_POLY] + [1 << n for n in range(31)]  # one zero bit
    even = _gf2_square(odd)  # two
    odd = _gf2_square(even)  # four
    while True:
        even = _gf2_square(odd)
        if len2 & 1:
            crc1 = _gf2_times(even, crc1)
        len2 >>= 1
        if not len2:
            break
        odd = _gf2_square(even)
        if len2 & 1:
            crc1 = _gf2_times(odd, crc1)
        len2 >>= 1
        if not len2:
            break
    return crc1 ^ crc2


def b64(value: int) -> str:
    """The form of an object's ``crc32c`` metadata: base64 of the big-endian 4 bytes."""
    return base64.b64encode(value.to_bytes(4, "big")).decode()


def parse(value: str) -> int:
    """An object's ``crc32c`` metadata as a number (``b64``'s inverse)."""
    return int.from_bytes(base64.b64decode(value), "big")


def of_bytes(data: bytes | memoryview) -> int:
    import google_crc32c

    if isinstance(data, bytes):
        return google_crc32c.value(data)
    crc = 0  # it takes read-only bytes only: a chunk at a time
    for i in range(0, len(data), _CHUNK):
        crc = google_crc32c.extend(crc, bytes(data[i:i + _CHUNK]))
    return crc


def of_stream(f: Readable) -> int:
    """Of what ``f`` reads from where it is to its end."""
    import google_crc32c

    crc = 0
    while chunk := f.read(_CHUNK):
        crc = google_crc32c.extend(crc, chunk)
    return crc


def of_file(path: Path) -> int:
    with open(path, "rb") as f:
        return of_stream(f)
