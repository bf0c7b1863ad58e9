"""The multi-node drill end to end: a coordinator and a Spot worker booted from the real pooled
scripts, the worker preempted once and brought back; and its command-line checks."""
from __future__ import annotations

from pathlib import Path

import pytest

from drill.__main__ import main as drill_main
from drill.drill import DrillConfig
from drill.pool_drill import Session, run_pool_drill, world_size_path
from drill_support import needs_root


#: The shipper's stall window in the pool drill (and the trainers' heartbeat, a third of it): a
#: minute, so that a node that trains longer than it and logs no step line (the worker: only global
#: rank 0 logs them) is watched by it, while a pool's own pauses (a membership change's save,
#: rendezvous and restore: 20-30 s on this loaded machine) stay well inside it.
STALL_S = 60


@needs_root
@pytest.mark.xdist_group("torchrun")
def test_pool_drill_one_worker_preemption(tmp_path: Path) -> None:
    lines: list[str] = []
    # 600 steps: the worker's session after it rejoins trains longer than STALL_S even on an idle
    # machine (500 steps gave it 79 s there), so that the window is shown to hold for a healthy node.
    cfg = DrillConfig(nodes=2, steps=600, preemptions=1, seed=1, window_s=30.0, checkpoint_every_steps=50,
                      disk_mb=64, workdir=tmp_path / "drill", stall_s=STALL_S)
    r = run_pool_drill(cfg, say=lines.append)
    log = "\n".join(lines)

    [p] = r.preemptions
    assert p.worker == "example-worker-1"
    # The loss: every rank stopped at one step, rank 0 saved it, the coordinator alone resumed
    # from exactly that step (nothing lost).
    assert (p.world_size_before, p.world_size_after) == (2, 1), log
    assert p.saved_step is not None and p.resumed_from < p.saved_step < cfg.steps, log
    assert p.restored_step == p.saved_step and p.steps_lost == 0, log
    # The return: the agents' membership change is another coordinated save, and both nodes
    # resume from it.
    assert p.world_size_rejoined == 2, log
    assert p.rejoin_saved_step == p.rejoin_restored_step, log
    assert p.saved_step < p.rejoin_restored_step < cfg.steps, log
    assert [ws for ws, _, _ in r.segments][-3:] == [2, 1, 2], log
    assert p.recovered_s is not None and p.rejoin_s is not None  # reported, never judged here
    assert p.save_s is not None, log  # the save time the trainer logged reaches the table
    assert r.segments[-1] == (2, p.rejoin_restored_step, cfg.steps)

    # The same model as a run that took the same world-size path without VMs.
    assert r.reference_digest is not None
    assert r.digest == r.reference_digest, log
    assert r.ok and "digest MATCHES" in log
    # The finish stopped paying for everything: the coordinator stopped, the Spot workers' group
    # at zero, by the control job the nodes started, all within the synthesized stack's grants.
    # Both nodes start the job when they finish; an execution that reads the group while the
    # other's resize is still pending asks for zero again, which is harmless: never anything else.
    first, *after = r.worker_group_sizes
    assert first == 1 and after and set(after) == {0} and r.coordinator_status == "TERMINATED", log
    assert r.refusals == [] and r.control_runs and not any(r.control_runs), log
    s = r.status
    assert s["latest_step"] == cfg.steps
    g = s["goodput"]
    assert g["finished"] is True
    assert set(g["nodes"]) == {"example-coordinator", "example-worker-1"}
    assert g["nodes"]["example-worker-1"]["sessions"] == 2

    # Healthy, for longer than the stall window: the synthesized stack's alerts, evaluated over what
    # each node shipped (drill.alert_eval), raise no stall. The worker never logs a step line; its
    # heartbeats keep its stall clock. The preemption is counted once, the finish raised.
    for node in ("example-coordinator", "example-worker-1"):
        assert r.longest_session_s[node] > STALL_S, log
        assert "training stalled" not in r.alerts[node], log
    assert r.alerts["example-coordinator"] == {"run finished": 1}, log
    assert "repair loop" not in r.alerts["example-worker-1"] and "run stopped" not in r.alerts["example-worker-1"], log


def test_world_size_path_follows_the_sessions() -> None:
    sessions = [Session(1, 0, 0, None), Session(2, 1, 0, None), Session(2, 2, 40, "gcs"),
                Session(1, 3, 90, "persistent"), Session(2, 4, 150, "persistent")]
    # A session that made no progress (the second world formed before the first trained) drops out.
    assert world_size_path(sessions, 200) == [(2, 0, 40), (2, 40, 90), (1, 90, 150), (2, 150, 200)]


def test_cli_refuses_a_pool_it_cannot_drill(capsys: pytest.CaptureFixture[str]) -> None:
    assert drill_main(["--nodes", "5"]) == 2
    assert "nodes: 5" in capsys.readouterr().err
    assert drill_main(["--nodes", "2", "--preemptions", "2", "--steps", "300"]) == 2
    assert "steps: 300 is too few for 2 preemption(s) of a pool" in capsys.readouterr().err
    assert drill_main(["--nodes", "0"]) == 2
    assert "nodes: 0" in capsys.readouterr().err
