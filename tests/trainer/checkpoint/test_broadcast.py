"""A restored whole-model state reaches every rank as tensors, not pickle (trainer.checkpoint.broadcast,
through trainer.loop.restore.newest, the multi-rank restore the trainer runs).

A restored checkpoint's tensors are views into one buffer; pickling each view carries the whole
buffer, so the old pickled broadcast grew as (number of tensors) x (state size): a model of a few
hundred tensors took gigabytes per rank. These tests restore a 16-layer GPT with its AdamW state
(788 tensors) on 2 and 4 real gloo ranks and check every rank gets the saved state bit for bit while
the bytes pickled between ranks stay those of the structure, and no rank's memory grows by more than
about one copy of the state.

This file is also the worker script, started once per rank with torchrun's environment (RANK,
WORLD_SIZE) and joined over gloo on loopback through a TCPStore the test process hosts.
"""
from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]
if str(REPO) not in sys.path:  # as a worker script
    sys.path.insert(0, str(REPO))

from tests.trainer.support import Policy, checkpointer, join_ranks, run_ranks  # noqa: E402
from trainer.checkpoint.format import state_digest  # noqa: E402
from trainer.checkpoint.state_codec import tensors_in  # noqa: E402
from trainer.checkpoint.broadcast import broadcast_state  # noqa: E402
from trainer.distributed import World  # noqa: E402

pytestmark = pytest.mark.xdist_group("torchrun")
GUARD = 240.0  # failure guard for a rank's exit; never reached when the code is right
N_LAYER = 16  # 197 model tensors; with AdamW's two moments and step per parameter, 785 in the state


def make_state(step: int, seed: int) -> dict:
    """The state the trainer saves for a GPT after ``step`` AdamW steps (model, optimizer, step)."""
    from trainer.tasks.gpt import GPT

    torch.manual_seed(seed)
    model = GPT(65, 32, N_LAYER, 2, 32, 0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(step):
        x = torch.randint(0, 65, (2, 32))
        model(x, torch.roll(x, 1, dims=1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"step": step, "model": model.state_dict(), "optimizer": opt.state_dict()}


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


# ----------------------------------------------------------------------------- the worker


def worker(args: dict) -> None:
    import logging

    import torch.distributed as dist

    from trainer.loop import restore

    logging.basicConfig(level=logging.INFO, format=f"rank{os.environ['RANK']} %(message)s")
    rank, size = join_ranks()
    world = World(rank=rank, local_rank=rank, size=size, local_size=size)
    base, out = Path(args["base"]), Path(args["out"])
    # One node: rank 0 leads and holds the run dir. "nodes": every rank is a node of its own, and
    # the last rank's disk holds the newest step, so it restores and sends (not rank 0).
    nodes = args["mode"] == "nodes"
    c = None
    if rank == 0 or nodes:
        c = checkpointer(run_dir=base / (f"node{rank}" if nodes else "node0"),
                         policies={"persistent": Policy(every_steps=1)})
        saves = {0: 3, size - 1: 5} if nodes else {0: 3}
        if rank in saves:
            state = make_state(saves[rank], seed=rank)
            c.save(saves[rank], state, meta={"world_size": size})
            c.wait()
            (out / f"saved-{saves[rank]}.json").write_text(json.dumps({"digest": state_digest(state)}))
            del state
    world.barrier()
    before, rss0 = world.object_bytes, peak_rss()
    saved, where = restore.newest(c, world)
    rss1 = peak_rss()
    (out / f"rank-{rank}.json").write_text(json.dumps({
        "step": saved["step"], "digest": state_digest(saved), "tier": where[0], "tensors": len(tensors_in(saved)),
        "pickled": world.object_bytes - before, "rss_growth": rss1 - rss0,
        "state_bytes": sum(t.numel() * t.element_size() for t in tensors_in(saved))}))
    if c is not None:
        c.close()
    world.barrier()
    dist.destroy_process_group()


def launch(nproc: int, mode: str, base: Path) -> list[dict]:
    out = base / "out"
    out.mkdir(parents=True)
    outputs = run_ranks([sys.executable, __file__, json.dumps({"base": str(base), "out": str(out), "mode": mode})],
                        nproc, timeout=GUARD)
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(nproc)] + \
        [{"saved": {int(p.stem.split("-")[1]): json.loads(p.read_text())["digest"] for p in out.glob("saved-*.json")},
          "log": "\n".join(outputs)}]


def check(ranks: list[dict], step: int, saved_digest: str) -> None:
    for r, got in enumerate(ranks):
        assert got["step"] == step and got["digest"] == saved_digest, f"rank {r} restored another state"
        assert got["tensors"] > 700, "the state must be of a real shape: hundreds of tensors"
        # Pickled between ranks: the decision and the structure (~100 bytes a tensor), never the
        # tensors' bytes. The old broadcast pickled every view's whole buffer: tensors x state bytes.
        assert got["pickled"] < 200 * got["tensors"] + 65536 < got["state_bytes"], (r, got)
        # About one copy of the state (plus the packing chunk and the allocator's slack), not one per
        # tensor.
        assert got["rss_growth"] < 3 * got["state_bytes"] + (48 << 20), (r, got)


@pytest.mark.parametrize("nproc", [2, 4])
def test_a_many_tensor_state_reaches_every_rank_as_tensors(tmp_path: Path, nproc: int) -> None:
    *ranks, extra = launch(nproc, "one-node", tmp_path)
    check(ranks, 3, extra["saved"][3])
    assert f"sent from rank 0 as {ranks[0]['tensors']} tensors" in extra["log"], extra["log"][-2000:]


def test_the_node_with_the_newest_step_sends_it(tmp_path: Path) -> None:
    *ranks, extra = launch(2, "nodes", tmp_path)
    check(ranks, 5, extra["saved"][5])
    assert f"sent from rank 1 as {ranks[0]['tensors']} tensors" in extra["log"], extra["log"][-2000:]


# ----------------------------------------------------------------------------- in one process


def test_one_process_gets_its_own_state_back_untouched() -> None:
    state = {"step": 1, "w": torch.ones(3)}
    got, sent = broadcast_state(World(), state)
    assert got is state and sent.tensor_bytes == 0


if __name__ == "__main__":
    worker(json.loads(sys.argv[1]))
