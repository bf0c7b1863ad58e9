"""trainer.checkpoint.sharded: FSDP2 checkpoints through DCP, driven by the one checkpointer;
resharding, async saves, fallback, GCS, emergency.

Multi-rank cases run real ranks: this file is also the worker script, started once per rank with
torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE) and joined over gloo on loopback. Single-process cases (world size 1: no process group,
a plain model, as ``python -m trainer run`` has it) run in the test process itself.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

REPO = Path(__file__).resolve().parents[3]
if str(REPO) not in sys.path:  # as a torchrun worker script
    sys.path.insert(0, str(REPO))

from tests.trainer.support import Policy, checkpointer, join_ranks, run_ranks  # noqa: E402
from trainer.checkpoint.checkpointer import Checkpointer  # noqa: E402
from trainer.checkpoint.manifest import MANIFEST, step_name  # noqa: E402
from trainer.checkpoint.sharded import EXTRAS, Sharded, list_sharded, verify_sharded_dir  # noqa: E402
from trainer.distributed import World  # noqa: E402
from trainer.loop.parallel import shard  # noqa: E402

GUARD = 120.0  # failure guard for waits; never reached when the code is right
EVERY = {"persistent": Policy(every_steps=1, keep=10), "gcs": Policy(every_steps=1, keep=10)}


# ----------------------------------------------------------------------------- shared by both sides


def make(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """A tiny model whose 16-row layers split unevenly over 3 ranks (FSDP2 pads the last shard)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    return model, opt, sched


def train(model: nn.Module, opt: torch.optim.Optimizer, sched: Any, steps: int, rank: int) -> None:
    g = torch.Generator().manual_seed(1000 + rank)
    for _ in range(steps):
        x = torch.randn(4, 8, generator=g)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """The unsharded model and optimizer state (a collective under FSDP; complete on rank 0)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {"model": get_model_state_dict(model, options=opts),
            "optim": get_optimizer_state_dict(model, opt, options=opts)}


def extras_for(step: int, sched: Any, rngs: list) -> dict:
    return {"step": step, "scheduler": sched.state_dict(), "data": {"index": step * 16, "epoch": 0},
            "rng": rngs, "fingerprint": {"model": "tiny"}}


def key() -> Any:
    """The suite's checkpoint key (tests/conftest.py; the workers inherit its environment)."""
    from trainer.checkpoint.key import resolve

    return resolve(None, create_default=False)


def ckpt(run_dir: Path, world: World, gcs_uri: str | None = None, *, model: Any = None, opt: Any = None,
         policies: dict | None = None, **kw: Any) -> Checkpointer:
    """A checkpointer of the sharded layout over these ranks, bound to ``model`` and ``opt``."""
    kw.setdefault("key", key())
    c = checkpointer(run_dir=run_dir, gcs_uri=gcs_uri, layout=Sharded(world, run_dir=run_dir),
                     policies=policies if policies is not None else
                     {k: v for k, v in EVERY.items() if gcs_uri or k != "gcs"}, **kw)
    if model is not None:
        c.bind(model, opt)
    return c


def stager_closes_after_every_stage() -> None:
    """DCP's DefaultStager as PyTorch released it before 2.13 (2.11 on an H200 failed this way):
    its ``_stage`` closes its StateDictStager after every stage, which drops the stager's cached
    host buffers and empties its copy table. (2.13 no longer closes there.)"""
    from torch.distributed.checkpoint.staging import DefaultStager

    if getattr(DefaultStager._stage, "closes_after_every_stage", False):
        return
    stage = DefaultStager._stage

    def _stage(self: Any, state_dict: Any, **kwargs: Any) -> Any:
        staged = stage(self, state_dict, **kwargs)
        self._state_dict_stager.close()
        return staged

    _stage.closes_after_every_stage = True  # type: ignore[attr-defined]
    DefaultStager._stage = _stage  # type: ignore[method-assign]


# ----------------------------------------------------------------------------- the worker


def worker(mode: str, args: dict) -> None:
    import logging

    import torch.distributed as dist

    logging.basicConfig(level=logging.INFO, format=f"rank{os.environ['RANK']} %(message)s")
    if os.environ.get("SHARDED_TEST_STAGER_CLOSES"):
        stager_closes_after_every_stage()
    join_ranks()
    world = World(rank=dist.get_rank(), local_rank=int(os.environ["LOCAL_RANK"]), size=dist.get_world_size())
    out = Path(args["out"])
    model, opt, sched = make(seed=0 if mode != "load" else 99)  # a load must overwrite other weights
    shard(model, world, optimizer=opt)
    run_dir = Path(args["run_dir"])
    if "node_size" in args:  # ranks with different run dirs stand for different VMs
        run_dir = run_dir / f"node{world.rank // int(args['node_size'])}"
    c = ckpt(run_dir, world, args.get("gcs_uri"), model=model, opt=opt)
    rngs = world.gather(torch.get_rng_state())

    def record(name: str) -> None:
        full = full_state(model, opt)
        if world.is_main:
            torch.save(full, out / name)

    if mode in ("save", "gcs-save"):
        train(model, opt, sched, 2, world.rank)
        record("full-2.pt")
        c.save(2, extras_for(2, sched, rngs) if world.is_main else None,
               meta={"world_size": world.size})
        # Training goes on while step 2 is written: what is written must be step 2's state.
        train(model, opt, sched, 2, world.rank)
        record("full-4.pt")
        extras = extras_for(4, sched, rngs) if world.is_main else None
        if mode == "save":
            c.save(4, extras, meta={"world_size": world.size})
        else:
            report = c.emergency_save(4, extras, deadline=time.monotonic() + GUARD,
                                      meta={"world_size": world.size})
            (out / f"report-{world.rank}.json").write_text(json.dumps({**report.__dict__, **report.fields(["persistent", "gcs"])}))
        c.wait()
    elif mode == "durable":  # every rank its own node: GCS holds the only complete copy
        train(model, opt, sched, 2, world.rank)
        c.save(2, extras_for(2, sched, rngs) if world.is_main else None, meta={})
        first = c.durable(2, deadline=time.monotonic() + GUARD)  # the upload ran on the uploader's group
        train(model, opt, sched, 2, world.rank)
        c.save(4, extras_for(4, sched, rngs) if world.is_main else None, meta={}, every_tier=True)
        second = c.durable(4, deadline=time.monotonic() + GUARD)  # its manifest upload gets 403
        (out / f"durable-{world.rank}.json").write_text(json.dumps([first.tiers, second.tiers]))
    elif mode == "load-failing":  # this rank's first shard read fails (a disk's EIO, memory running out)
        from tests.trainer.support import failing_shard_reads
        from trainer.checkpoint.manifest import ResumeMismatch
        from trainer.checkpoint.tier_wait import TierUnknown

        left = failing_shard_reads(args["kind"], 1) if world.rank == int(args["failing_rank"]) else [0]
        try:
            first = f"restored step {c.restore().step}"
        except TierUnknown as e:
            first = f"unknown: {e}"
        except ResumeMismatch as e:
            first = f"mismatch: {e}"
        r = c.restore()  # as start-up tries it again
        record("loaded.pt")
        (out / f"attempts-{world.rank}.json").write_text(json.dumps({"first": first, "then": r.step if r else None,
                                                                     "faults_left": left[0]}))
    elif mode == "load":
        r = c.restore()
        record("loaded.pt")
        torch.save({"step": r.step, "tier": r.tier, "state": r.state} if r else None, out / f"restored-{world.rank}.pt")
        train(model, opt, sched, 1, world.rank)  # the resharded model and optimizer still train
    c.close()
    dist.destroy_process_group()


def launch(nproc: int, mode: str, env: dict | None = None, **args: Any) -> None:
    """Run ``nproc`` real ranks of ``worker`` (this file as a script; ``run_ranks``)."""
    run_ranks([sys.executable, __file__, mode, json.dumps({k: str(v) for k, v in args.items()})], nproc, env=env,
              timeout=GUARD)


# ----------------------------------------------------------------------------- checks


def assert_same_state(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys() and a["model"]
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    sa, sb = a["optim"]["state"], b["optim"]["state"]
    assert sa.keys() == sb.keys() and sa
    for k in sa:
        assert sa[k].keys() == sb[k].keys()
        for name in sa[k]:
            assert torch.equal(torch.as_tensor(sa[k][name]), torch.as_tensor(sb[k][name])), (k, name)
    assert a["optim"]["param_groups"] == b["optim"]["param_groups"]


def assert_extras(state: dict, step: int, saved_rngs_ranks: int) -> None:
    assert state["step"] == step and state["data"] == {"index": step * 16, "epoch": 0}
    assert state["scheduler"]["last_epoch"] == step and state["fingerprint"] == {"model": "tiny"}
    assert len(state["rng"]) == saved_rngs_ranks and all(isinstance(t, torch.Tensor) for t in state["rng"])


def load_here(run_dir: Path, **kw: Any) -> tuple[Any, dict]:
    """Restore at world size 1 in this process: no process group, a plain (unsharded) model."""
    model, opt, _ = make(seed=99)
    c = ckpt(run_dir, World(), model=model, opt=opt, **kw)
    try:
        r = c.restore()
        return r, full_state(model, opt)
    finally:
        c.close()


# ----------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def saved_ws2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Steps 2 and 4 saved at world size 2 (step 2 written while training went on).

    Written once per test session: xdist workers share it through their common base folder (a
    lock orders them; the later ones find it done), so two workers never pay for it twice.
    """
    import fcntl

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the session's folder, above each worker's own
    base = shared / "sharded-ws2"
    with open(shared / "sharded-ws2.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (base / "done").exists():
            shutil.rmtree(base, ignore_errors=True)
            (base / "out").mkdir(parents=True)
            launch(2, "save", run_dir=base / "run", out=base / "out")
            (base / "done").touch()
    return base


def test_the_emulated_pre_2_13_stager_fails_the_second_stage_as_torch_2_11_did(monkeypatch: pytest.MonkeyPatch) -> None:
    """The emulation below is faithful: through it, DCP's own DefaultStager fails its second
    stage with the error an H200 run under torch 2.11 met at its second FSDP save."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    monkeypatch.setattr(DefaultStager, "_stage", DefaultStager._stage)  # undone after the test
    stager_closes_after_every_stage()
    stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                          use_async_staging=False, use_non_blocking_copy=False))
    model, opt, _ = make(seed=0)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    stager.stage(state)
    with pytest.raises(KeyError, match="<class 'type'>"):
        stager.stage(state)


def test_two_sharded_saves_succeed_and_restore_where_torchs_stager_closes_after_every_stage(tmp_path: Path) -> None:
    """World size 2 over gloo (DTensor shards), two saves with the pre-2.13 stager behaviour in
    every rank: both succeed, and each step restores exactly."""
    out = tmp_path / "out"
    out.mkdir()
    launch(2, "save", env={"SHARDED_TEST_STAGER_CLOSES": "1"}, run_dir=tmp_path / "run", out=out)
    r, loaded = load_here(tmp_path / "run")
    assert r is not None and r.step == 4
    assert_same_state(loaded, torch.load(out / "full-4.pt", weights_only=False))
    shutil.rmtree(tmp_path / "run" / step_name(4))
    r, loaded = load_here(tmp_path / "run")
    assert r is not None and r.step == 2
    assert_same_state(loaded, torch.load(out / "full-2.pt", weights_only=False))


def test_saved_layout_is_sharded_and_verified(saved_ws2: Path) -> None:
    for step in (2, 4):
        folder = saved_ws2 / "run" / step_name(step)
        m = verify_sharded_dir(folder, key=key())
        assert set(m["files"]) == {"__0_0.distcp", "__1_0.distcp", ".metadata", EXTRAS}
        assert m["auth"]["key_id"] == key().id
        assert m["meta"]["sharded"]["world_size"] == 2 and m["meta"]["world_size"] == 2
        assert sorted(p.name for p in folder.iterdir()) == sorted([*m["files"], MANIFEST])
    assert [i.step for i in list_sharded(_dir_store(saved_ws2 / "run")) if i.valid] == [4, 2]
    assert not [p for p in (saved_ws2 / "run").iterdir() if p.name.startswith(".tmp-")]


def test_ws2_checkpoint_loads_at_world_size_1(saved_ws2: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(saved_ws2 / "run", run)
    r, loaded = load_here(run)
    assert r is not None and (r.step, r.tier) == (4, "persistent")
    assert_same_state(loaded, torch.load(saved_ws2 / "out" / "full-4.pt", weights_only=False))
    assert_extras(r.state, 4, saved_rngs_ranks=2)


def test_ws2_checkpoint_loads_at_world_size_3(saved_ws2: Path, tmp_path: Path) -> None:
    run, out = tmp_path / "run", tmp_path / "out"
    shutil.copytree(saved_ws2 / "run", run)
    out.mkdir()
    launch(3, "load", run_dir=run, out=out)
    assert_same_state(torch.load(out / "loaded.pt", weights_only=False),
                      torch.load(saved_ws2 / "out" / "full-4.pt", weights_only=False))
    for rank in range(3):  # every rank got the same step and rank 0's extras
        r = torch.load(out / f"restored-{rank}.pt", weights_only=False)
        assert (r["step"], r["tier"]) == (4, "persistent")
        assert_extras(r["state"], 4, saved_rngs_ranks=2)


def test_async_save_wrote_the_state_of_its_step(saved_ws2: Path, tmp_path: Path) -> None:
    # Step 2 was written in the background while two more steps ran: it holds step 2's state.
    run = tmp_path / "run"
    shutil.copytree(saved_ws2 / "run", run)
    shutil.rmtree(run / step_name(4))
    r, loaded = load_here(run)
    assert r.step == 2
    assert_same_state(loaded, torch.load(saved_ws2 / "out" / "full-2.pt", weights_only=False))
    with pytest.raises(AssertionError):  # the comparison can fail: step 4 differs
        assert_same_state(loaded, torch.load(saved_ws2 / "out" / "full-4.pt", weights_only=False))


def test_corrupted_shard_falls_back_to_previous_checkpoint(saved_ws2: Path, tmp_path: Path, logwatch) -> None:
    run = tmp_path / "run"
    shutil.copytree(saved_ws2 / "run", run)
    shard_file = run / step_name(4) / "__1_0.distcp"
    data = bytearray(shard_file.read_bytes())
    data[len(data) // 2] ^= 1  # same size: only the digest can tell
    shard_file.write_bytes(bytes(data))
    r, loaded = load_here(run, log=_logger())
    assert r.step == 2
    assert_same_state(loaded, torch.load(saved_ws2 / "out" / "full-2.pt", weights_only=False))
    line = logwatch.wait_for("checkpoint step 4")
    assert "__1_0.distcp blake3 mismatch" in line and "falling back" in logwatch.text()


def test_save_returns_before_the_checkpoint_exists_and_manifest_commits(tmp_path: Path, gcs_emulator,
                                                                       faulty_gcs) -> None:
    model, opt, sched = make(seed=0)
    train(model, opt, sched, 1, 0)
    c = ckpt(tmp_path / "run", World(), gcs_emulator.uri, gcs_client=faulty_gcs, model=model, opt=opt)
    disk_held, gcs_held = threading.Event(), threading.Event()
    release_disk, release_gcs = threading.Event(), threading.Event()
    real_dcp_save = c.layout._dcp_save

    def held_dcp_save(staged: dict, stage: Path) -> None:  # a pause point, the real write follows
        disk_held.set()
        assert release_disk.wait(GUARD)
        real_dcp_save(staged, stage)

    c.layout._dcp_save = held_dcp_save  # type: ignore[method-assign]
    faulty_gcs.plan.add("upload", f"*/{step_name(1)}/{MANIFEST}", "hook",
                        hook=lambda: (gcs_held.set(), release_gcs.wait(GUARD)))
    expected = copy.deepcopy(full_state(model, opt))  # the live tensors move on below
    c.save(1, {"step": 1}, meta={})
    assert disk_held.wait(GUARD)
    # save() returned; nothing of step 1 exists yet, and the loop may change the weights now.
    assert not (tmp_path / "run" / step_name(1)).exists()
    train(model, opt, sched, 1, 0)
    release_disk.set()
    assert gcs_held.wait(GUARD)
    # Every payload object is on GCS but the manifest is not: no valid checkpoint there yet.
    infos = list_sharded(c.tiers["gcs"].store)
    assert [(i.step, i.valid, i.reason) for i in infos] == [(1, False, "no manifest (incomplete write or upload)")]
    assert {k.rsplit("/", 1)[-1] for k in c.tiers["gcs"].store.names(step_name(1) + "/")} == {"__0_0.distcp", ".metadata", EXTRAS}
    # The disk copy was committed (manifest last, then the rename) before the upload began.
    assert verify_sharded_dir(tmp_path / "run" / step_name(1))["step"] == 1
    release_gcs.set()
    c.wait()
    assert [i.step for i in list_sharded(c.tiers["gcs"].store) if i.valid] == [1]
    c.close()
    shutil.rmtree(tmp_path / "run")
    r, loaded = load_here(tmp_path / "run", gcs_uri=gcs_emulator.uri)
    assert (r.step, r.tier, r.state) == (1, "gcs", {"step": 1})
    assert_same_state(loaded, expected)
    with pytest.raises(AssertionError):  # the weights did move on after save() returned
        assert_same_state(loaded, full_state(model, opt))


def test_gcs_save_on_two_nodes_at_ws2_restores_at_ws3(tmp_path: Path, gcs_emulator) -> None:
    # Each rank has its own run dir: two "VMs", each disk sees only its own rank's shard file.
    out, load_out = tmp_path / "out", tmp_path / "load"
    out.mkdir()
    load_out.mkdir()
    launch(2, "gcs-save", env=gcs_emulator.env, run_dir=tmp_path / "run", node_size=1, out=out,
           gcs_uri=gcs_emulator.uri)
    for rank in range(2):  # the emergency save of step 4: no disk is complete, GCS is
        report = json.loads((out / f"report-{rank}.json").read_text())
        assert (report["step"], report["persistent_ok"], report["gcs_ok"]) == (4, False, True), report
        assert "persistent not complete" in report["detail"] and "gcs uploaded" in report["detail"]
    for node in ("node0", "node1"):  # no partial folder left behind, none posing as a checkpoint
        assert [p.name for p in (tmp_path / "run" / node).iterdir() if p.name.startswith(("step-", ".tmp-"))] == []
    from trainer.checkpoint.stores import GcsStore

    gcs = GcsStore(gcs_emulator.uri, client=gcs_emulator.client)
    # Step 4 is there; step 2's upload may have been cut short by the emergency save (by design:
    # then it has no manifest and is not valid).
    assert [i.step for i in list_sharded(gcs) if i.valid] in ([4, 2], [4])
    # The VMs came back elsewhere with fresh disks: two VMs again, one with two ranks.
    shutil.rmtree(tmp_path / "run")
    launch(3, "load", env=gcs_emulator.env, run_dir=tmp_path / "run", node_size=2, out=load_out,
           gcs_uri=gcs_emulator.uri)
    assert_same_state(torch.load(load_out / "loaded.pt", weights_only=False),
                      torch.load(out / "full-4.pt", weights_only=False))
    for rank in range(3):
        r = torch.load(load_out / f"restored-{rank}.pt", weights_only=False)
        assert (r["step"], r["tier"]) == (4, "gcs")
        assert_extras(r["state"], 4, saved_rngs_ranks=2)
    # Each VM downloaded the complete checkpoint into its run dir and verified it.
    for node in ("node0", "node1"):
        assert verify_sharded_dir(tmp_path / "run" / node / step_name(4))["step"] == 4


def test_emergency_save_writes_disk_then_gcs_and_reports_both(tmp_path: Path, gcs_emulator) -> None:
    model, opt, sched = make(seed=0)
    train(model, opt, sched, 1, 0)
    c = ckpt(tmp_path / "run", World(), gcs_emulator.uri, model=model, opt=opt)
    c.save(1, {"step": 1}, meta={})
    train(model, opt, sched, 1, 0)
    expected = copy.deepcopy(full_state(model, opt))
    report = c.emergency_save(2, {"step": 2}, deadline=time.monotonic() + GUARD, meta={})
    assert (report.step, report.persistent_ok, report.gcs_ok) == (2, True, True), report
    assert report.detail.index("persistent saved") < report.detail.index("gcs uploaded")
    assert verify_sharded_dir(tmp_path / "run" / step_name(2))["step"] == 2
    assert [i.step for i in list_sharded(c.tiers["gcs"].store) if i.valid][0] == 2
    c.close()
    shutil.rmtree(tmp_path / "run")
    r, loaded = load_here(tmp_path / "run", gcs_uri=gcs_emulator.uri)
    assert (r.step, r.tier, r.state) == (2, "gcs", {"step": 2})
    assert_same_state(loaded, expected)


def test_save_writes_the_due_tiers_or_every_tier(tmp_path: Path, gcs_emulator) -> None:
    model, opt, sched = make(seed=0)
    c = ckpt(tmp_path / "run", World(), gcs_emulator.uri, model=model, opt=opt,
             policies={"persistent": Policy(every_steps=1), "gcs": Policy(every_steps=1000)})
    train(model, opt, sched, 1, 0)
    assert c.due(1)
    c.save(1, {"step": 1})
    c.wait()
    train(model, opt, sched, 1, 0)
    c.save(2, {"step": 2}, every_tier=True)  # the final checkpoint: everywhere
    c.wait()
    assert [i.step for i in list_sharded(_dir_store(tmp_path / "run")) if i.valid] == [2, 1]
    assert [i.step for i in list_sharded(c.tiers["gcs"].store) if i.valid] == [2]  # step 1 was not due there
    c.close()


def test_fresh_run_restores_nothing(tmp_path: Path, logwatch) -> None:
    model, opt, _ = make(seed=0)
    before = copy.deepcopy(model.state_dict())
    c = ckpt(tmp_path / "run", World(), log=_logger(), model=model, opt=opt)
    assert c.restore() is None and "starting from scratch" in logwatch.text()
    # Nothing was touched: no optimizer state appeared (a fresh Adam counts its steps from 0).
    assert not opt.state and all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    c.close()


def test_checkpoint_of_another_model_is_a_resume_mismatch(saved_ws2: Path, tmp_path: Path) -> None:
    from trainer.loop.state import ResumeMismatch

    run = tmp_path / "run"
    shutil.copytree(saved_ws2 / "run", run)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    c = ckpt(run, World(), model=model, opt=opt)
    with pytest.raises(ResumeMismatch, match=r"cannot resume from step 4 .*Size mismatch .*model\.0\.weight"):
        c.restore()  # not a fallback to step 2, nor a fresh start: the run would be lost
    c.close()


def test_a_disk_error_on_one_rank_while_loading_is_unknown_then_loads_never_a_mismatch(saved_ws2: Path,
                                                                                         tmp_path: Path) -> None:
    """World size 2: rank 1's shard read meets EIO once. DCP hands that rank's error to every
    rank; it says nothing about the checkpoint, so every rank's restore says the tier is unknown
    (start-up waits and tries again), and the next try loads step 4 exactly."""
    run, out = tmp_path / "run", tmp_path / "out"
    shutil.copytree(saved_ws2 / "run", run)
    out.mkdir()
    launch(2, "load-failing", run_dir=run, out=out, kind="eio", failing_rank=1)
    for rank in range(2):
        got = json.loads((out / f"attempts-{rank}.json").read_text())
        assert got["first"].startswith("unknown: persistent: step 4 "), got
        assert "OSError: [Errno 5] Input/output error" in got["first"] and got["then"] == 4
    assert json.loads((out / "attempts-1.json").read_text())["faults_left"] == 0
    assert_same_state(torch.load(out / "loaded.pt", weights_only=False),
                      torch.load(saved_ws2 / "out" / "full-4.pt", weights_only=False))
    assert [i.step for i in list_sharded(_dir_store(run)) if i.valid] == [4, 2]  # nothing deleted


def test_memory_running_out_while_loading_is_unknown_then_loads(saved_ws2: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.checkpoint import filesystem

    from tests.trainer.support import failing_shard_reads
    from trainer.checkpoint.tier_wait import TierUnknown

    run = tmp_path / "run"
    shutil.copytree(saved_ws2 / "run", run)
    monkeypatch.setattr(filesystem.FileSystem, "create_stream", filesystem.FileSystem.create_stream)  # undone after
    left = failing_shard_reads("memory", 1)
    model, opt, _ = make(seed=99)
    c = ckpt(run, World(), model=model, opt=opt)
    try:
        with pytest.raises(TierUnknown, match=r"persistent: step 4 .*MemoryError"):
            c.restore()  # not a fallback to step 2, nor exit 2
        assert left == [0]
        r = c.restore()
        assert r is not None and r.step == 4
        assert_same_state(full_state(model, opt), torch.load(saved_ws2 / "out" / "full-4.pt", weights_only=False))
    finally:
        c.close()


def _failures(*errors: BaseException) -> BaseException:
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException("load failed", {r: (e, traceback.StackSummary()) for r, e in enumerate(errors)})


# What gloo raised in a survivor when its peer died, and when its peer hung (torch 2.13, recorded).
GLOO_PEER_CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
                    "peer [127.0.0.1]:10132. This is typically caused by a remote worker crashing.")
GLOO_TIMEOUT = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                "3000ms for recv operation to complete")


@pytest.mark.parametrize("error, outside", [
    (OSError(5, "Input/output error"), True),
    (MemoryError(), True),
    (torch.OutOfMemoryError("CUDA out of memory"), True),
    (torch.distributed.DistBackendError("NCCL communicator was aborted"), True),
    (RuntimeError(GLOO_PEER_CLOSED), True),
    (RuntimeError(GLOO_TIMEOUT), True),
    (_failures(OSError(5, "Input/output error"), RuntimeError(GLOO_PEER_CLOSED)), True),
    (RuntimeError("Size mismatch for model.0.weight"), False),
    (RuntimeError("Missing key in checkpoint state_dict: model.3.weight."), False),
    (KeyError("optim"), False),
    (_failures(OSError(5, "Input/output error"), RuntimeError("Size mismatch for model.0.weight")), False),
], ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else str(v))
def test_what_a_load_error_says_about_the_checkpoint(error: BaseException, outside: bool) -> None:
    """I/O, memory and peers say nothing about a verified checkpoint; a shape or a key that does
    not fit does (every rank's error counts: one that does not fit has the answer)."""
    from trainer.checkpoint.manifest import unreadable

    assert unreadable(error) is outside


def _forge_on_disk(run: Path, src: int, step: int, replace: dict[str, bytes]) -> None:
    """What a writer of a copy of the run dir (or of the bucket it is downloaded from) without
    the key can do: a newer step with some files swapped and every digest recomputed."""
    from tests.trainer.support import forge

    dst = run / step_name(step)
    shutil.copytree(run / step_name(src), dst)
    for name, data in replace.items():
        (dst / name).write_bytes(data)
    (dst / MANIFEST).write_bytes(forge((dst / MANIFEST).read_bytes(), step, replace))


def test_forged_dcp_index_or_extras_are_never_read(saved_ws2: Path, tmp_path: Path, logwatch) -> None:
    from tests.trainer.support import code_running_pickle
    from trainer.checkpoint.sharded import DCP_METADATA

    run = tmp_path / "run"
    shutil.copytree(saved_ws2 / "run", run)
    meta, extras = tmp_path / "ran-metadata", tmp_path / "ran-extras"
    _forge_on_disk(run, 4, 6, {DCP_METADATA: code_running_pickle(meta, torch_save=False)})
    _forge_on_disk(run, 4, 5, {EXTRAS: code_running_pickle(extras)})
    r, loaded = load_here(run, log=_logger())
    assert r.step == 4 and not meta.exists() and not extras.exists()
    assert_same_state(loaded, torch.load(saved_ws2 / "out" / "full-4.pt", weights_only=False))
    assert "refusing persistent checkpoint step 6" in logwatch.text()
    look = checkpointer(run_dir=run, layout=Sharded(), key=key())  # `status`
    found = look.restore(download=False)
    look.close()
    assert found is not None and found.step == 4 and not meta.exists() and not extras.exists()
    assert (run / step_name(6) / MANIFEST).exists() and (run / step_name(5) / MANIFEST).exists()


def test_no_key_no_sharded_checkpointer(tmp_path: Path) -> None:
    from trainer.checkpoint.key import KeyProblem

    with pytest.raises(KeyProblem, match=r"sharded checkpoints \(parallelism = \"fsdp\"\) need a checkpoint key"):
        ckpt(tmp_path / "run", World(), key=None)
    with pytest.raises(KeyProblem, match=r"sharded checkpoints \(parallelism = \"fsdp\"\) need a checkpoint key"):
        checkpointer(run_dir=tmp_path, layout=Sharded())  # a read-only look (`status`) too


def test_on_two_nodes_only_gcs_counts_and_a_403_on_the_manifest_is_not_durable(tmp_path: Path, gcs_proxy) -> None:
    prefix = gcs_proxy.uri.split("/", 3)[3]
    gcs_proxy.proxy.add("POST", rf"object={prefix}/{step_name(4)}/manifest[.]json$", "status", status=403, times=None)
    launch(2, "durable", env=gcs_proxy.env, run_dir=tmp_path / "run", node_size=1, out=tmp_path,
           gcs_uri=gcs_proxy.uri)
    first, second = json.loads((tmp_path / "durable-0.json").read_text())
    assert first == {"gcs": "ok"}  # no disk holds a complete copy on two nodes: GCS alone counts
    assert list(second) == ["gcs"] and "no manifest" in second["gcs"]
    assert json.loads((tmp_path / "durable-1.json").read_text()) == [{}, {}]  # rank 0 speaks for the job


def _proxied(run_dir: Path, gcs_proxy, **kw: Any) -> Checkpointer:
    c = ckpt(run_dir, World(), gcs_proxy.uri, gcs_client=gcs_proxy.client(), **kw)
    c.tiers["gcs"].store.request_timeout_s = 3600  # a stalled request is held until the test releases it
    return c


def test_a_full_run_dir_stages_the_shards_in_host_memory_for_gcs(tmp_path: Path, gcs_proxy, small_fs, logwatch) -> None:
    model, opt, sched = make(seed=0)
    train(model, opt, sched, 1, 0)
    expected = copy.deepcopy(full_state(model, opt))
    pd = small_fs("pd", 1 << 20)
    (pd.path / "run").mkdir()
    pd.fill()
    c = _proxied(pd.path / "run", gcs_proxy, log=_logger(), model=model, opt=opt)
    c.save(1, {"step": 1}, meta={})
    c.wait()
    assert "step 1 on persistent failed" in logwatch.text() and "shards staged in" in logwatch.text()
    assert [i.step for i in list_sharded(c.tiers["gcs"].store) if i.valid] == [1]
    assert c.durable(1, deadline=time.monotonic() + GUARD).tiers == {"persistent": "step 1 is not there", "gcs": "ok"}
    c.close()
    assert not [p for root in ("/dev/shm", tempfile.gettempdir()) for p in Path(root).glob(f".tmp-{step_name(1)}-*")]
    r, loaded = load_here(tmp_path / "fresh", gcs_uri=gcs_proxy.uri)
    assert (r.step, r.tier, r.state) == (1, "gcs", {"step": 1})
    assert_same_state(loaded, expected)


def test_a_stalled_upload_never_holds_the_sharded_emergency_save(tmp_path: Path, gcs_proxy) -> None:
    model, opt, sched = make(seed=0)
    train(model, opt, sched, 1, 0)
    c = _proxied(tmp_path / "run", gcs_proxy, model=model, opt=opt)
    prefix = gcs_proxy.uri.split("/", 3)[3]
    stall = gcs_proxy.proxy.add("POST", rf"object={prefix}/{step_name(1)}/__0_0[.]distcp$", "stall")
    c.save(1, {"step": 1}, meta={})
    assert gcs_proxy.proxy.wait_stalled(stall, timeout=GUARD)
    train(model, opt, sched, 1, 0)
    got: list = []
    th = threading.Thread(target=lambda: got.append(c.emergency_save(2, {"step": 2},
                                                                     deadline=time.monotonic() + GUARD, meta={})),
                          daemon=True)
    th.start()
    th.join(GUARD)
    assert got, "the emergency save waited for the stalled upload"
    assert (got[0].persistent_ok, got[0].gcs_ok, got[0].complete) == (True, True, True), got[0].detail
    assert stall.held == 1
    assert [i.step for i in list_sharded(c.tiers["gcs"].store) if i.valid] == [2]


def _dir_store(root: Path) -> Any:
    from trainer.checkpoint.stores import DirStore

    return DirStore(root, "persistent")


def _logger() -> Any:
    import logging

    return logging.getLogger("spottrain.checkpoint")


if __name__ == "__main__":
    worker(sys.argv[1], json.loads(sys.argv[2]))


def test_a_gcs_that_cannot_be_read_is_unknown_in_the_sharded_layout_too(tmp_path: Path, gcs_proxy) -> None:
    from trainer.checkpoint.tier_wait import TierUnknown

    model, opt, sched = make(seed=0)
    c = ckpt(tmp_path / "run", World(), gcs_proxy.uri, gcs_client=gcs_proxy.client(), model=model, opt=opt,
             policies={"gcs": Policy(every_steps=1)})
    train(model, opt, sched, 1, 0)
    c.save(1, {"step": 1}, every_tier=True)
    c.wait()
    c.close()
    shutil.rmtree(tmp_path / "run")  # a blank disk: the checkpoint is only in GCS
    for rule in ((r"/o\?.*prefix=", "listing"), (r"alt=media.* object=.*\.distcp", "download")):
        gcs_proxy.proxy.clear()
        gcs_proxy.proxy.add("GET", rule[0], "status", status=403, times=None)
        fresh, fresh_opt, _ = make(seed=1)
        c = ckpt(tmp_path / "run", World(), gcs_proxy.uri, gcs_client=gcs_proxy.client(), model=fresh,
                 opt=fresh_opt, policies={})
        with pytest.raises(TierUnknown, match="gcs"):  # never "no checkpoint: start from scratch"
            c.restore()
        c.close()
    gcs_proxy.proxy.clear()
    fresh, fresh_opt, _ = make(seed=1)
    c = ckpt(tmp_path / "run", World(), gcs_proxy.uri, gcs_client=gcs_proxy.client(), model=fresh, opt=fresh_opt,
             policies={})
    assert c.restore().step == 1
    c.close()


def test_another_runs_sharded_checkpoint_planted_at_a_first_boot_is_set_aside(tmp_path: Path, gcs_emulator) -> None:
    """The sharded layout decides as the whole-model one (issue 28): another run's authentic
    sharded checkpoint copied into the prefix of a run with nothing of its own is set aside, never
    read by DCP; the run starts from scratch, and its own save writes the run record."""
    from drill.attacker import copy_step
    from trainer.checkpoint import run_record

    other = gcs_emulator.uri + "-other"
    model, opt, sched = make(seed=0)
    c = ckpt(tmp_path / "other", World(), other, gcs_client=gcs_emulator.client, model=model, opt=opt,
             key=key().bound_to(other), policies={"gcs": Policy(every_steps=1)})
    train(model, opt, sched, 1, 0)
    c.save(1, {"step": 1}, every_tier=True)
    c.wait()
    c.close()
    copy_step(gcs_emulator.client, other, gcs_emulator.uri, 1)

    mine = key().bound_to(gcs_emulator.uri)
    fresh, fresh_opt, _ = make(seed=1)
    c = ckpt(tmp_path / "run", World(), gcs_emulator.uri, gcs_client=gcs_emulator.client, model=fresh,
             opt=fresh_opt, key=mine, policies={"gcs": Policy(every_steps=1)})
    assert c.restore() is None
    assert c.set_aside is not None and c.set_aside.steps == (1,) and not c.set_aside.saved_before
    c.save(2, {"step": 2}, every_tier=True)
    c.wait()
    c.close()
    assert run_record.read(c.tiers["gcs"].store, mine)[0]


def test_a_frozen_model_saved_before_it_was_sharded_loads_from_the_extras(tmp_path: Path) -> None:
    """Before issue 29's sharding of every model among ``Task.states``, a sharded checkpoint held
    a model that did not train (a frozen copy) in the extras: a resume loads it from there; a
    trained model in neither place is a resume mismatch, never a fresh one."""
    from trainer.loop.named_state import NamedStates
    from trainer.loop.state import ResumeMismatch

    run = tmp_path / "run"
    model, opt, sched = make(seed=0)
    frozen = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    c = ckpt(run, World(), model=model, opt=opt)
    c.save(3, {**extras_for(3, sched, []), "states": {"frozen": frozen.state_dict()}, "state_models": ["frozen"]},
           meta={"world_size": 1})
    c.wait()
    c.close()

    model2, opt2, _ = make(seed=99)
    frozen2 = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    states = NamedStates.declare({"frozen": frozen2}, where="task t:build", optimizers=[opt2])
    plan = states.shard_plan(model2, opt2, "task t:build")
    c = ckpt(run, World())
    c.bind(model2, opt2, named=plan)
    restored = c.restore()
    c.close()
    assert restored is not None and restored.step == 3
    states.load(restored.state["states"], {})
    assert torch.equal(frozen2[0].weight, frozen[0].weight) and torch.equal(model2[0].weight, model[0].weight)

    d = nn.Linear(4, 1)
    opt_d = torch.optim.Adam(d.parameters())
    c = ckpt(run, World())
    c.bind(model2, opt2, named={"D": (d, "opt_d", opt_d)})
    with pytest.raises(ResumeMismatch, match=r"cannot resume from step 3 .*the checkpoint holds no state 'D'"):
        c.restore()
    c.close()
