"""The rendezvous id of a pool whose coordinator does not train (trainer.rendezvous): real torchrun
agents on 127.0.0.1 joining a real `python -m trainer rendezvous` store, with the id
`python -m trainer rendezvous-id` prints, as the pooled trainer.sh runs them.

torch's launcher closes a rendezvous id for good whenever an agent ends other than by a signal; the
store outlives the agents, so with a fixed id the pool could never train again.
"""
from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from drill.net import free_port
from tests.trainer.support import Proc, trainer_env

pytestmark = pytest.mark.xdist_group("torchrun")

# Each node's one rank: the world it joined, checked by a collective over it.
WORKER = """\
import os, sys
import torch
import torch.distributed as dist
code = int(os.environ.get("WORKER_EXIT", "0"))
if code:
    sys.exit(code)
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
print(f"world={dist.get_world_size()} sum={int(t.item())}", flush=True)
dist.destroy_process_group()
"""


@pytest.fixture
def store() -> Iterator[int]:
    port = free_port()
    p = Proc([sys.executable, "-m", "trainer", "rendezvous", "--host", "127.0.0.1", "--port", str(port)],
             env=trainer_env(), new_session=True)
    try:
        p.wait_for(rf"event=rendezvous_store host=127.0.0.1 port={port}")
        yield port
    finally:
        p.kill()


def rendezvous_id(port: int, name: str = "job") -> str:
    p = Proc([sys.executable, "-m", "trainer", "rendezvous-id", "--endpoint", f"127.0.0.1:{port}",
              "--name", name], env=trainer_env())
    assert p.wait() == 0, p.output
    return p.output.strip()


def agent(tmp: Path, port: int, rdzv_id: str, *, nnodes: str = "2:2", join_timeout: int = 600,
          host: bool = False, **env: str) -> Proc:
    """One node's torchrun, with trainer.sh's flags but for the join timeout (the pool's is 600 s)."""
    script = tmp / "worker.py"
    script.write_text(WORKER)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", "--nproc-per-node=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={rdzv_id}",
           f"--rdzv-conf=is_host={'true' if host else 'false'},join_timeout={join_timeout},last_call_timeout=1,"
           "keep_alive_interval=1,keep_alive_max_attempt=3",
           "--max-restarts=0", "--monitor-interval=0.5", str(script)]
    return Proc(cmd, env=trainer_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **env), new_session=True)


def two_nodes_train(tmp: Path, port: int, rdzv_id: str, *, first_hosts: bool = False) -> None:
    nodes = [agent(tmp, port, rdzv_id, host=first_hosts and i == 0) for i in range(2)]
    try:
        assert [p.wait() for p in nodes] == [0, 0], nodes[0].output[-3000:] + nodes[1].output[-3000:]
        assert all(p.seen(r"world=2 sum=2") for p in nodes)
    finally:
        for p in nodes:
            p.kill()


def test_a_join_timed_out_in_a_stockout_moves_the_pool_to_the_next_epoch(tmp_path, store):
    """A survivor waits alone for a replacement (2 nodes needed) until its join times out: its
    agent closes the rendezvous. Its restart and the replacement meet in the next epoch and train."""
    assert rendezvous_id(store) == "job-0"
    survivor = agent(tmp_path, store, "job-0", join_timeout=1)
    assert survivor.wait() == 1
    assert survivor.seen("RendezvousTimeoutError")
    # What a fixed id gets from now on: refused at once, however many times the unit restarts it.
    again = agent(tmp_path, store, "job-0")
    assert again.wait() == 1
    assert again.seen("RendezvousClosedError")
    # Every node asking now (the survivor's restart, the replacement) gets the next epoch, once.
    assert [rendezvous_id(store), rendezvous_id(store)] == ["job-1", "job-1"]
    two_nodes_train(tmp_path, store, "job-1")


def test_ranks_that_keep_failing_or_a_finished_job_close_their_epoch(tmp_path, store):
    """Every rank exiting 69 after --max-restarts (the unit restarts the node), and a job that
    finished: each closes its rendezvous, and the next start joins a new one."""
    failing = agent(tmp_path, store, rendezvous_id(store), nnodes="1:2", WORKER_EXIT="69")
    assert failing.wait() == 1
    assert failing.seen("exitcode *: 69")
    assert rendezvous_id(store) == "job-1"
    two_nodes_train(tmp_path, store, "job-1")
    assert rendezvous_id(store) == "job-2"


def test_a_node_stopped_by_a_signal_leaves_the_rendezvous_open(tmp_path, store):
    """A preempted or stopped node (SIGTERM to its agent): torch does not close the rendezvous,
    so the epoch stays, and its replacement joins the nodes that wait in it."""
    assert rendezvous_id(store) == "job-0"
    waiting = agent(tmp_path, store, "job-0", LOGLEVEL="INFO")
    try:
        waiting.wait_for(r"Rendezvous'ing worker group")
        waiting.signal(signal.SIGTERM)
        assert waiting.wait() != 0
    finally:
        waiting.kill()
    assert rendezvous_id(store) == "job-0"
    two_nodes_train(tmp_path, store, "job-0")


def test_a_coordinator_that_trains_keeps_the_fixed_id(tmp_path):
    """When the coordinator trains, its own agent hosts the store (is_host=true): a worker whose
    join times out closes the rendezvous, the coordinator's agent ends at once (exit 1, its unit
    restarts it), and its restart hosts a new store where the same id is open."""
    port = free_port()
    coordinator = agent(tmp_path, port, "job", nnodes="3:3", host=True)
    try:
        worker = agent(tmp_path, port, "job", nnodes="3:3", join_timeout=1)
        assert worker.wait() == 1
        assert worker.seen("RendezvousTimeoutError")
        assert coordinator.wait() == 1
        assert coordinator.seen("RendezvousClosedError")
    finally:
        coordinator.kill()
    two_nodes_train(tmp_path, port, "job", first_hosts=True)


def test_a_store_that_does_not_answer_is_one_line_and_exit_1():
    port = free_port()  # nothing listens there
    p = Proc([sys.executable, "-m", "trainer", "rendezvous-id", "--endpoint", f"127.0.0.1:{port}",
              "--name", "job", "--timeout-s", "1"], env=trainer_env())
    assert p.wait() == 1
    assert p.lines == [f"rendezvous-id: no rendezvous id from the store at 127.0.0.1:{port} (timeout 1 s): "
                       f"The client socket has timed out after 1000ms while trying to connect to "
                       f"(127.0.0.1, {port})."], p.output


@pytest.mark.parametrize(("args", "error"), [
    (["--endpoint", "127.0.0.1", "--name", "job"], "command line: endpoint: must be HOST:PORT"),
    (["--endpoint", "h:70000", "--name", "job"], "command line: endpoint: must be HOST:PORT"),
    (["--endpoint", "h:1", "--name", "a b;rm"], "command line: name: must be 1-100 letters"),
    (["--endpoint", "h:1", "--name", "job", "--timeout-s", "0"], "command line: timeout_s: must be > 0"),
])
def test_rendezvous_id_checks_its_arguments(args, error):
    p = Proc([sys.executable, "-m", "trainer", "rendezvous-id", *args], env=trainer_env())
    assert p.wait() == 2
    assert error in p.output and "Traceback" not in p.output
