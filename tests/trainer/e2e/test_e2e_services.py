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
from tests.trainer.support import TIMEOUT, run_to_end, start, status, trainer_env, write_config

from tests.trainer.support import REFERENCE_STEPS as STEPS


def test_metadata_preemption_notice_saves_and_exits_75(tmp_path: Path, reference: dict) -> None:
    config, run_dir = write_config(tmp_path), tmp_path / "run"
    with MetadataServer() as md:
        env = trainer_env(GCE_METADATA_HOST=md.host)
        p = start(run_dir, STEPS, config, env=env)
        p.wait_for(r"event=metadata_watch .* preempted=FALSE")
        assert md.wait_waiters(1, TIMEOUT)
        p.wait_for(r"event=step step=12/")
        md.preempt()
        assert p.wait() == 75, p.output[-3000:]
    p.wait_for(r"event=preemption_notice reason=metadata instance/preempted=TRUE")
    saved = int(p.wait_for(r"event=preempted step=(\d+) persistent_ok=1").group(1))
    assert saved >= 12
    p = run_to_end(run_dir, STEPS, config)
    assert int(p.seen(r"event=restore step=(\d+)").group(1)) == saved
    assert status(run_dir)["model_digest"] == reference["model_digest"]


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
    config, run_dir = write_config(tmp_path), tmp_path / "run"
    env = trainer_env(**gcs_emulator.env)
    gcs = ("--gcs-uri", gcs_emulator.uri, "--checkpoint-every-steps", "10")
    rng = random.Random(7)
    at = 0
    for _ in range(2):
        at = rng.randint(at + 3, at + 12)
        p = start(run_dir, STEPS, config, *gcs, env=env)
        p.wait_for(rf"event=step step={at}/")
        p.signal(signal.SIGTERM)
        assert p.wait() == 75, p.output[-3000:]
        line = p.wait_for(r"event=preempted step=(\d+) persistent_ok=1 gcs_ok=True").group(0)
        at = int(line.split("step=")[1].split()[0])
        shutil.rmtree(run_dir)  # the VM comes back in another zone with a fresh disk
        p = start(run_dir, STEPS, config, *gcs, env=env)
        assert int(p.wait_for(r"event=restore step=(\d+) tier=").group(1)) == at
        p.seen(rf"downloaded step {at} from gs:")
        p.seen_or_wait(r"event=ledger_recover events=\d+ from=gcs")  # in the background
        p.signal(signal.SIGTERM)
        assert p.wait() == 75, p.output[-3000:]
        shutil.rmtree(run_dir)
    p = run_to_end(run_dir, STEPS, config, *gcs, env=env)
    shutil.rmtree(run_dir)
    s = status(run_dir, "--gcs-uri", gcs_emulator.uri, env=env, cli=True)
    assert s["latest_step"] == STEPS and s["tier"] == "gcs"
    g = s["goodput"]
    assert g["sessions"] == 5 and g["preemptions"] == 4 and g["finished"], g
    assert s["model_digest"] == reference["model_digest"]
