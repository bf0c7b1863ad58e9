"""bench/file_hash_bench.py measures both hashes the checkpointer writes with, as it computes them."""
from __future__ import annotations

from bench import file_hash_bench
from trainer.checkpoint import file_hash


def test_the_hash_bench_measures_blake3_and_sha256_in_turns(capsys) -> None:
    got = file_hash_bench.measure(1 << 20, 2)
    assert sorted(got) == sorted([file_hash.BLAKE3_NAME, file_hash.SHA256.name])
    assert all(len(v["cpu"]) == 2 and len(v["wall"]) == 2 for v in got.values())
