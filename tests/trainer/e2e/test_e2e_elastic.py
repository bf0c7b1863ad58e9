"""Two nodes as two torchrun agents on 127.0.0.1 (elastic, c10d rendezvous, one gloo rank each).

Each node has its own run dir (its persistent disk); the GCS emulator is the tier they share, as
on GCP. A gate in the task parks both ranks at a known step so that a node can be lost there:
- powered off (agent and worker SIGKILLed): node a's agent restarts its worker into a world of one,
  which resumes from the newest checkpoint and finishes;
- preempted (SIGTERM to node b's agent, which torchrun passes to its worker): every rank stops at
  the same step, rank 0 saves it, and node a resumes from exactly that step.
Either way the final model must equal that of a run that took the same world-size path without
the loss: 2 ranks up to the restored step, then 1 rank to the end.
"""
from __future__ import annotations

import shutil
import signal
import sys
from pathlib import Path

import pytest

from drill.net import free_port
from tests.trainer.support import GATE_TASK, Proc, gated, run_args, status, trainer_env, write_config

STEPS = 24
EVERY = 5
PARKED_AFTER = 12  # steps both ranks complete before the gate holds them
BATCH = 4


def _config(tmp: Path) -> Path:
    # global_batch_size keeps 8 samples per step at world size 2 (1 micro-batch) and 1 (2).
    return write_config(tmp, "global_batch_size = 8\nhealth_port = 0\nwatch_metadata = false\n", multi_rank=True)


def _args(run_dir: Path, config: Path, *extra: str) -> list[str]:
    return run_args(run_dir, STEPS, config, "--task", GATE_TASK, "--checkpoint-every-steps", str(EVERY), *extra)


def agent(run_dir: Path, config: Path, port: int, node: str, host: bool, *extra: str, **env: str) -> Proc:
    argv = _args(run_dir, config, *extra)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic-test",
           f"--rdzv-conf=is_host={'true' if host else 'false'},last_call_timeout=1",
           "--max-restarts=3", "--monitor-interval=0.5", "-m", *argv[2:]]
    # As the pooled trainer.sh sets it: without it a node cannot rejoin a later round (torch 2.13).
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    return Proc(cmd, env=trainer_env(SPOTTRAIN_NODE=node, **env), new_session=True)


class Pool:
    """Nodes a (hosts the rendezvous, survives) and b (is lost), parked at step 13."""

    def __init__(self, tmp: Path, gcs) -> None:
        self.tmp, self.gcs = tmp, gcs
        self.config = _config(tmp)
        self.flag = tmp / "gate"
        env = gated(self.flag, PARKED_AFTER, dict(gcs.env), samples_per_step=BATCH)
        self.port = port = free_port()
        self.a = agent(tmp / "a", self.config, port, "a", True, "--gcs-uri", gcs.uri, **env)
        self.b = agent(tmp / "b", self.config, port, "b", False, "--gcs-uri", gcs.uri, **env)
        for p in (self.a, self.b):
            p.wait_for(r"event=start steps=24 world_size=2 node=")
        # Rank 0 (on either node: the rendezvous decides) logs without a rank prefix.
        self.main = self.a if any(" INFO trainer event=start " in line for line in self.a.lines) else self.b

    def release(self) -> None:
        self.flag.unlink()

    def close(self) -> None:
        self.a.kill()
        self.b.kill()

    def status(self) -> dict:
        return status(self.tmp / "a", "--gcs-uri", self.gcs.uri, env=trainer_env(**self.gcs.env), cli=True)


def replay(tmp: Path, config: Path, path: list[tuple[int, int | None]]) -> str:
    """The digest of a run without losses along ``path``: (world size, pause step or None for
    the end) segments, each resuming the previous one's checkpoint."""
    ref = tmp / "ref"
    for size, stop in path:
        extra = ("--stop-at-step", str(stop)) if stop is not None else ()
        argv = _args(ref, config, *extra)
        p = Proc(argv) if size == 1 else Proc(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={size}", "-m",
             *argv[2:]], new_session=True)
        rc = p.wait()  # under torchrun a pause is reported as the workers' failure (75)
        if stop is None:
            assert rc == 0, p.output[-4000:]
        else:
            p.seen(rf"event=paused step={stop} ")
    return status(ref)["model_digest"]


def same_path_digest(tmp: Path, config: Path, step: int) -> str:
    """The run without the loss: 2 ranks paused at ``step``, then 1 rank to the end."""
    return replay(tmp, config, [(2, step), (1, None)])


@pytest.mark.xdist_group("torchrun")
def test_a_node_powered_off_costs_a_restart_from_the_last_checkpoint(tmp_path: Path, gcs_emulator) -> None:
    pool = Pool(tmp_path, gcs_emulator)
    try:
        # A checkpoint on the shared tier first (node b's disk goes with it if rank 0 is there);
        # the ranks park at step 13 at the latest.
        durable = int(pool.main.wait_for(r"checkpoint step (\d+) durable on gcs").group(1))
        pool.b.power_off()
        assert pool.b.wait() != 0
        pool.release()  # node a's rank goes on, meets a dead peer in its all-reduce, fails
        assert pool.a.wait() == 0, pool.a.output[-5000:]
    finally:
        pool.close()
    a = pool.a
    # The newest checkpoint that survived, wherever it was: node a's disk or GCS.
    restored = int(a.seen(r"event=restore step=(\d+) tier=\S+ path=\S+ seconds=\S+ world_size=1").group(1))
    assert durable <= restored <= PARKED_AFTER
    assert a.seen(rf"event=world_size_change step={restored} from=2 to=1 consumed={restored * 8} ")
    assert a.seen(r"event=start steps=24 world_size=1 node=a node_rank=0 restart=1 accum=2 ")
    s = pool.status()
    assert s["latest_step"] == STEPS
    assert s["model_digest"] == same_path_digest(tmp_path, pool.config, restored)

    # Goodput per node, rolled up for the job: node b's one session, node a's two.
    g = s["goodput"]
    assert set(g["nodes"]) == {"a", "b"}
    assert g["nodes"]["a"]["sessions"] == 2 and g["nodes"]["b"]["sessions"] == 1
    assert g["nodes"]["a"]["finished"] and not g["nodes"]["b"]["finished"]
    assert g["finished"] and g["steps"] == STEPS


@pytest.mark.xdist_group("torchrun")
def test_a_preemption_notice_on_one_node_is_a_coordinated_save(tmp_path: Path, gcs_emulator) -> None:
    pool = Pool(tmp_path, gcs_emulator)
    try:
        pool.main.wait_for(r"event=step step=12/")  # training, not starting up: both park at 13
        pool.b.signal(signal.SIGTERM)  # systemd stopping node b's unit: torchrun passes it on
        pool.b.wait_for(r"event=preemption_notice reason=SIGTERM")
        pool.release()
        saved = int(pool.main.wait_for(r"event=preempted step=(\d+) persistent_ok=1 gcs_ok=True").group(1))
        assert pool.a.wait() == 0, pool.a.output[-5000:]
    finally:
        pool.close()
    assert saved in (12, 13)  # the step in flight when the notice came, finished first
    a = pool.a
    # No step is lost: node a, alone now, resumes from the step every rank stopped at.
    assert int(a.seen(r"event=restore step=(\d+) .* world_size=1").group(1)) == saved
    s = pool.status()
    assert s["latest_step"] == STEPS
    assert s["model_digest"] == same_path_digest(tmp_path, pool.config, saved)
    g = s["goodput"]
    assert g["nodes"]["a"]["preemptions"] == g["nodes"]["b"]["preemptions"] == 1
    assert g["nodes"]["a"]["lost_s"] == 0 and g["nodes"]["b"]["lost_s"] == 0


@pytest.mark.xdist_group("torchrun")
def test_a_coordinator_that_does_not_train_hosts_the_rendezvous(tmp_path: Path) -> None:
    """`python -m trainer rendezvous` holds the store; both agents join it as clients (is_host=false)."""
    port = free_port()
    store = Proc([sys.executable, "-m", "trainer", "rendezvous", "--host", "127.0.0.1", "--port", str(port)],
                 new_session=True)
    try:
        store.wait_for(rf"event=rendezvous_store host=127.0.0.1 port={port}")
        config = _config(tmp_path)
        # Each node its own run dir (its disk): a run dir belongs to one trainer (it is locked).
        agents = [agent(tmp_path / node, config, port, node, False) for node in ("a", "b")]
        try:
            assert [p.wait() for p in agents] == [0, 0], agents[0].output[-3000:] + agents[1].output[-3000:]
        finally:
            for p in agents:
                p.kill()
        assert max(status(tmp_path / node)["latest_step"] or 0 for node in ("a", "b")) == STEPS  # rank 0's
        assert sum(" INFO trainer event=finished step=24" in line for p in agents for line in p.lines) == 1
        store.signal(signal.SIGTERM)
        assert store.wait() == 0
        assert store.seen("event=rendezvous_stopped")
    finally:
        store.kill()


def test_rendezvous_port_is_checked(tmp_path: Path) -> None:
    p = Proc([sys.executable, "-m", "trainer", "rendezvous", "--port", "70000"])
    assert p.wait() == 2
    assert "command line: port: must be 1..65535, got 70000" in p.output and "Traceback" not in p.output


@pytest.mark.xdist_group("torchrun")
def test_the_node_holding_the_newest_checkpoint_restores_for_everyone(tmp_path: Path) -> None:
    """Only node b's disk holds a checkpoint (step 10, written by a run of one process there); no
    GCS. Whichever node rank 0 lands on, the job resumes from b's step 10, not from scratch."""
    config = _config(tmp_path)
    seed = Proc(_args(tmp_path / "b", config, "--stop-at-step", "10"))
    assert seed.wait() == 75
    port = free_port()
    a = agent(tmp_path / "a", config, port, "a", True)
    b = agent(tmp_path / "b", config, port, "b", False)
    try:
        assert [p.wait() for p in (a, b)] == [0, 0], a.output[-3000:] + b.output[-3000:]
    finally:
        a.kill()
        b.kill()
    for p in (a, b):  # every node leader logs where the job's state came from
        assert p.seen(r"event=restore step=10 tier=persistent path=b:\S+ seconds=\S+ world_size=2")
    final = [status(tmp_path / n) for n in ("a", "b")]
    done = [s for s in final if s["latest_step"] == STEPS]
    assert done

    # The same path in one place: 1 process to step 10, then 2 to the end.
    ref = tmp_path / "ref"
    assert Proc(_args(ref, config, "--stop-at-step", "10")).wait() == 75
    two = Proc([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
                *_args(ref, config)[2:]], new_session=True)
    assert two.wait() == 0, two.output[-3000:]
    assert done[0]["model_digest"] == status(ref)["model_digest"]


@pytest.mark.xdist_group("torchrun")
def test_a_newest_checkpoint_that_fails_verification_falls_back_to_another_nodes(tmp_path: Path) -> None:
    """Node a's disk holds step 15, which passes the quick check (manifest, sizes) but not full
    verification (a byte flipped on the disk), and nothing older; node b's disk holds step 10; no
    GCS. a is chosen for 15, fails it, and the leaders negotiate again without it: the job resumes
    from b's step 10, not from scratch, and ends as a run that took that path."""
    config = _config(tmp_path)
    assert Proc(_args(tmp_path / "a", config, "--stop-at-step", "15")).wait() == 75
    assert Proc(_args(tmp_path / "b", config, "--stop-at-step", "10")).wait() == 75
    for old in ("step-00000005", "step-00000010"):
        shutil.rmtree(tmp_path / "a" / old)
    payload = max((f for f in (tmp_path / "a" / "step-00000015").iterdir() if f.name != "manifest.json"),
                  key=lambda f: f.stat().st_size)
    with open(payload, "r+b") as f:  # bit rot: same size, other bytes
        f.seek(payload.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))
    port = free_port()
    a = agent(tmp_path / "a", config, port, "a", True)
    b = agent(tmp_path / "b", config, port, "b", False)
    try:
        assert [p.wait() for p in (a, b)] == [0, 0], a.output[-3000:] + b.output[-3000:]
    finally:
        a.kill()
        b.kill()
    assert a.seen(r"checkpoint step 15 is unusable")
    for p in (a, b):
        assert p.seen(r"event=restore step=10 tier=persistent path=b:\S+ seconds=\S+ world_size=2")
    done = [s for s in (status(tmp_path / n) for n in ("a", "b")) if s["latest_step"] == STEPS]
    assert done
    ref = tmp_path / "ref"
    assert Proc(_args(ref, config, "--stop-at-step", "10")).wait() == 75
    two = Proc([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
                *_args(ref, config)[2:]], new_session=True)
    assert two.wait() == 0, two.output[-3000:]
    assert done[0]["model_digest"] == status(ref)["model_digest"]


@pytest.mark.xdist_group("torchrun")
def test_a_node_that_comes_back_rejoins_and_the_world_grows_again(tmp_path: Path, gcs_emulator) -> None:
    """Node b is powered off; node a trains alone; b boots again and joins: a's worker saves at
    once (torchrun stops it for the membership change) and both resume from that step at world
    size 2. Same digest as a run that took the same world-size path."""
    pool = Pool(tmp_path, gcs_emulator)
    a = pool.a
    try:
        pool.main.wait_for(r"checkpoint step (\d+) durable on gcs")
        pool.b.power_off()
        pool.release()
        a.wait_for(r"event=failed reason=exception")  # the dead peer, met in an all-reduce
        pool.flag.touch()  # a's next worker parks again, 6 steps into its world of one
        lost = int(a.wait_for(r"event=restore step=(\d+) .* world_size=1").group(1))
        a.wait_for(rf"event=step step={lost + 6}/")
        b = agent(tmp_path / "b", pool.config, pool.port, "b", False, "--gcs-uri", pool.gcs.uri,
                  **pool.gcs.env)
        pool.b = b
        a.wait_for(r"event=preemption_notice reason=SIGTERM")  # torchrun makes room for b
        pool.release()
        grown = int(a.wait_for(r"event=preempted step=(\d+) persistent_ok=1").group(1))
        assert a.wait() == 0 and b.wait() == 0, a.output[-3000:] + b.output[-3000:]
    finally:
        pool.close()
    assert grown == lost + 7  # 6 steps, then the one parked in flight, finished first: nothing lost
    for p in (a, b):
        assert p.seen(rf"event=restore step={grown} .* world_size=2")
    s = pool.status()
    assert s["latest_step"] == STEPS
    assert s["model_digest"] == replay(tmp_path, pool.config, [(2, lost), (1, grown), (2, None)])
