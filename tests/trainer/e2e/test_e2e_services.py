"""End to end with the services a VM has: the metadata server's preemption notice, the health
check, and the GCS durable tier (gcp-storage-emulator) with the run dir wiped between restarts."""
from __future__ import annotations

import random
import shutil
import signal
import time
from pathlib import Path

from drill.metadata_server import MetadataServer
from trainer.observe.health import ask
from tests.trainer.support import (GATE_TASK, NOTICE, TIMEOUT, Proc, gated, open_gate_on_notice, run_to_end, start,
                                   status, trainer_env, write_config)

from tests.trainer.support import REFERENCE_STEPS as STEPS


def test_metadata_preemption_notice_saves_and_exits_75(tmp_path: Path, reference: dict) -> None:
    config, run_dir, gate = write_config(tmp_path), tmp_path / "run", tmp_path / "gate"
    with MetadataServer() as md:
        env = trainer_env(GCE_METADATA_HOST=md.host)
        p = _parked(run_dir, config, gate, 12, env)
        p.wait_for(r"event=metadata_watch .* preempted=FALSE")
        assert md.wait_waiters(1, TIMEOUT)
        p.wait_for(r"event=step step=12/")
        md.preempt()
        saved = _saved(p, gate, r"event=preemption_notice reason=metadata instance/preempted=TRUE")
    assert saved in (12, 13)  # the step it had completed, or the one it was waiting to load
    p = run_to_end(run_dir, STEPS, config, "--task", GATE_TASK)
    assert int(p.seen(r"event=restore step=(\d+)").group(1)) == saved
    assert status(run_dir)["model_digest"] == reference["model_digest"]


def _parked(run_dir: Path, config: Path, gate: Path, steps: int, env: dict[str, str], *args: str) -> Proc:
    """A trainer of the gate task that trains `steps` steps, then waits in the next step's data
    loader while `gate` exists: a notice always finds it training, however fast it runs."""
    return start(run_dir, STEPS, config, "--task", GATE_TASK, *args, env=gated(gate, steps, env))


def _saved(p: Proc, gate: Path, notice: str = NOTICE) -> int:
    """Once `p` heard `notice`, open its gate: it saves the step it had completed (or, when the
    notice came while it waited for data, the step it was loading) and exits 75."""
    open_gate_on_notice(p, gate, notice)
    assert p.wait() == 75, p.output[-3000:]
    return int(p.seen(r"event=preempted step=(\d+) persistent_ok=1").group(1))


def _ask_until(port: int, want: str) -> str:
    """Poll the health port until it answers `want` (guarded by a generous timeout)."""
    end = time.monotonic() + TIMEOUT
    got = ""
    while time.monotonic() < end:
        got = ask("127.0.0.1", port)
        if got == want:
            return got
        time.sleep(0.02)
    raise AssertionError(f"health never answered {want!r}; last {got!r}")


def test_health_ok_then_stalled_on_a_hung_loader_then_ok(tmp_path: Path) -> None:
    config = write_config(tmp_path, "stall_timeout_s = 0.3\n")
    flag = tmp_path / "hang"
    env = trainer_env(HANG_FLAG=str(flag))
    p = start(tmp_path / "run", 400, config, "--task", "tests.trainer.e2e.hang_task:build", env=env)
    port = int(p.wait_for(r"event=health_listening host=\S+ port=(\d+)").group(1))
    p.wait_for(r"event=step step=2/")
    assert ask("127.0.0.1", port) in ("ok", "stalled")  # "ok" unless this box paused us 0.3 s
    flag.touch()  # the data loader hangs from the next batch on
    _ask_until(port, "stalled")
    assert ask("127.0.0.1", port, request="hello") == "unknown"
    flag.unlink()
    _ask_until(port, "ok")
    p.signal(signal.SIGTERM)
    assert p.wait() == 75, p.output[-3000:]


def test_gcs_tier_survives_wiped_run_dirs(tmp_path: Path, gcs_emulator, reference: dict) -> None:
    config, run_dir, gate = write_config(tmp_path), tmp_path / "run", tmp_path / "gate"
    env = trainer_env(**gcs_emulator.env)
    gcs = ("--gcs-uri", gcs_emulator.uri, "--checkpoint-every-steps", "10")
    rng = random.Random(7)
    saved = 0
    for _ in range(2):
        at = rng.randint(saved + 3, saved + 12)
        p = _parked(run_dir, config, gate, at - saved, env, *gcs)
        p.wait_for(rf"event=step step={at}/")
        p.signal(signal.SIGTERM)
        saved = _saved(p, gate)
        assert saved in (at, at + 1) and p.seen(r"event=preempted step=\d+ persistent_ok=1 gcs_ok=True")
        shutil.rmtree(run_dir)  # the VM comes back in another zone with a fresh disk
        p = _parked(run_dir, config, gate, 1, env, *gcs)
        assert int(p.wait_for(r"event=restore step=(\d+) tier=").group(1)) == saved
        p.seen(rf"downloaded step {saved} from gs:")
        p.seen_or_wait(r"event=ledger_recover events=\d+ from=gcs")  # in the background
        p.seen_or_wait(rf"event=step step={saved + 1}/")
        p.signal(signal.SIGTERM)
        saved = _saved(p, gate)
        shutil.rmtree(run_dir)
    p = run_to_end(run_dir, STEPS, config, *gcs, "--task", GATE_TASK, env=env)
    shutil.rmtree(run_dir)
    s = status(run_dir, "--gcs-uri", gcs_emulator.uri, env=env, cli=True)
    assert s["latest_step"] == STEPS and s["tier"] == "gcs"
    g = s["goodput"]
    assert g["sessions"] == 5 and g["preemptions"] == 4 and g["finished"], g
    assert s["model_digest"] == reference["model_digest"]
