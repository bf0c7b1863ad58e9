"""trainer.loop.restore across nodes (whole-model layout), with checkpoints nobody can vouch for.

Two real ranks (gloo over a TCPStore this process hosts), each its own node with its own run dir,
one bucket prefix (gcp-storage-emulator). Another run's checkpoint is planted in the bucket, so
rank 0 alone would set it aside and start from scratch (issue 28). When another node's disk holds
checkpoints under a key the run no longer has (its own work: no bucket writer writes a disk),
every rank must stop (exit 2), never start afresh beside them; with both disks blank, every rank
starts from scratch.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

GUARD = 180.0  # a failure guard for the ranks; never reached when the code is right


def worker(args: dict) -> None:
    import torch.distributed as dist

    from tests.trainer.support import Policy, checkpointer, join_ranks, run_key
    from trainer.checkpoint.manifest import ResumeMismatch
    from trainer.distributed import World
    from trainer.loop import restore

    rank, _ = join_ranks()
    world = World(rank=rank, local_rank=0, size=2, local_size=1, node_rank=rank)  # a node per rank
    c = checkpointer(run_dir=Path(args["run_dir"]) / f"node{rank}", gcs_uri=args["uri"],
                     policies={"persistent": Policy(every_steps=1), "gcs": Policy(every_steps=1)},
                     key=run_key().bound_to(args["uri"]))
    try:
        state, _ = restore.newest(c, world)
        got = {"fresh": state is None, "set_aside": c.set_aside is not None}
    except ResumeMismatch as e:
        got = {"mismatch": str(e)}
    c.close()
    Path(args["out"], f"rank{rank}.json").write_text(json.dumps(got))
    dist.destroy_process_group()


def launch(env: dict, **args: str) -> list[dict]:
    from tests.trainer.support import run_ranks

    run_ranks([sys.executable, __file__, json.dumps(args)], 2, env=env, timeout=GUARD)
    return [json.loads(Path(args["out"], f"rank{r}.json").read_text()) for r in range(2)]


def _save(c, step: int) -> None:
    c.save(step, {"model": {"w": torch.full((2,), float(step))}, "step": step}, meta={"world_size": 1})
    c.wait()
    c.close()


def test_a_nodes_disk_under_a_lost_key_stops_every_rank_beside_planted_ones(tmp_path: Path, gcs_emulator) -> None:
    from drill.attacker import copy_step
    from tests.trainer.support import Policy, checkpointer, run_key
    from trainer.checkpoint.key import CheckpointKey

    every = Policy(every_steps=1)
    other = gcs_emulator.uri + "-other"
    _save(checkpointer(run_dir=tmp_path / "other", gcs_uri=other, gcs_client=gcs_emulator.client,
                       policies={"persistent": every, "gcs": every}, key=run_key().bound_to(other)), 3)
    copy_step(gcs_emulator.client, other, gcs_emulator.uri, 3)

    out = tmp_path / "blank-out"
    out.mkdir()
    got = launch(gcs_emulator.env, run_dir=str(tmp_path / "blank"), uri=gcs_emulator.uri, out=str(out))
    assert got == [{"fresh": True, "set_aside": True}, {"fresh": True, "set_aside": False}]  # rank 0 decided

    lost = CheckpointKey(b"L" * 32, "the key that was lost").bound_to(gcs_emulator.uri)
    _save(checkpointer(run_dir=tmp_path / "run" / "node1", policies={"persistent": every}, key=lost), 2)
    out = tmp_path / "out"
    out.mkdir()
    got = launch(gcs_emulator.env, run_dir=str(tmp_path / "run"), uri=gcs_emulator.uri, out=str(out))
    for r in got:
        assert "no checkpoint on any tier is authentic under this run's checkpoint key" in r.get("mismatch", ""), got
        assert f"persistent step 2 at {tmp_path / 'run' / 'node1'}" in r["mismatch"]


if __name__ == "__main__":
    worker(json.loads(sys.argv[1]))
