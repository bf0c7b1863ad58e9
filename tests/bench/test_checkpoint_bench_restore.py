"""bench/checkpoint_bench.py's measure 5 (a trainer's restore in a fresh process against
torch.load) runs against the real checkpointer, for both hashes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import checkpoint_bench


def test_the_restore_measure_restores_blake3_and_sha256_checkpoints_in_fresh_processes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checkpoint_bench, "REPEATS", 1)
    monkeypatch.delenv("SPOTTRAIN_BENCH_BEFORE", raising=False)
    rows: list[tuple] = []
    checkpoint_bench._measure_restore(tmp_path, 0.02, rows)  # one layer and its AdamW state
    assert [r[0].split(":")[0] for r in rows] == [
        "5. torch.load + load_state_dict (baseline), warm cache, fresh process", "5. restore (blake3",
        "5. restore (sha256", "5. torch.load + load_state_dict (baseline), cold cache, fresh process",
        "5. restore (blake3", "5. restore (sha256"]
    for name in ("blake3", "sha256"):  # what each restore read was written with that hash
        manifest = next((tmp_path / name).glob("step-*/manifest.json"))
        assert json.loads(manifest.read_text())["hash"].startswith(name)
