"""trainer.checkpoint.crc32c: Cloud Storage's checksum, and of a concatenation from its parts'."""
from __future__ import annotations

import random
from pathlib import Path

import google_crc32c

from trainer.checkpoint import crc32c


def test_combine_equals_the_crc_of_the_concatenation() -> None:
    rng = random.Random(1)
    for _ in range(20):
        a, b = rng.randbytes(rng.randrange(0, 5000)), rng.randbytes(rng.randrange(0, 5000))
        got = crc32c.combine(google_crc32c.value(a), google_crc32c.value(b), len(b))
        assert got == google_crc32c.value(a + b)


def test_the_metadata_form_and_the_sources_agree(tmp_path: Path) -> None:
    data = random.Random(2).randbytes(100_000)
    (tmp_path / "f").write_bytes(data)
    want = google_crc32c.value(data)
    assert crc32c.of_bytes(data) == crc32c.of_bytes(memoryview(data)) == crc32c.of_file(tmp_path / "f") == want
    assert crc32c.parse(crc32c.b64(want)) == want
    assert crc32c.b64(0x12345678) == "EjRWeA=="  # big-endian, as Cloud Storage writes it
