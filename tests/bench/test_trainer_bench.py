"""bench/trainer_bench.py kept runnable: its checkpointer that is never due stands in for the real
one inside the real loop, so it must keep up with what the loop asks of a checkpointer (it fell
behind once the loop read the layout and set its hooks, and every run of the bench exited 1)."""
from __future__ import annotations

import pytest

from bench import trainer_bench


def test_every_variant_runs_the_real_loop_and_only_the_checkpointing_ones_save(
        capsys: pytest.CaptureFixture[str],
        logging_restored: None) -> None:
    trainer_bench.main(["--steps", "4", "--rounds", "1", "--every", "2"])
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line}
    saves = {name: int(cells[2]) for name, cells in rows.items() if name != "variant"}
    assert saves["no checkpoints"] == 0
    assert saves["async checkpoint every 2 steps"] >= 2
    assert set(saves) == {"no checkpoints", "checkpointing at the defaults (auto interval)",
                          "async checkpoint every 2 steps"}
