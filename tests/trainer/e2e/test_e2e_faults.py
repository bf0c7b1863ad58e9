"""The real trainer under the faults a cloud produces at start-up and around the job: Cloud Storage
answering 403 or down while a blank disk boots (issue 9 item 4), a ledger that cannot write
(item 7), settings that change the numbers (item 8), and a second trainer on the same job (item 9).

Cloud Storage is gcp-storage-emulator behind the fault proxy (`gcs_proxy`), which also enforces
the generation preconditions the writer lease relies on; disks are real tmpfs mounts (`small_fs`).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from pathlib import Path

from trainer.checkpoint.whole_model import list_whole as list_checkpoints
from trainer.observe.health import ask
from trainer.checkpoint.lease import LEASE_KEY
from trainer.checkpoint.stores import GcsStore
from tests.trainer.support import GATE_TASK, Proc, gated, run_args, start, status, trainer_env, write_config

STEPS = 40


def _parked(tmp_path: Path, run_dir: Path, config: Path, *extra: str, **env: str) -> tuple[Proc, Path]:
    """A trainer of the gate task that completed step 1 and is held in step 2's data loader
    until the returned flag is deleted: alive and training, for as long as a test needs."""
    flag = tmp_path / f"gate-{run_dir.name}"
    p = start(run_dir, 400, config, "--task", GATE_TASK, *extra, env=gated(flag, 1, trainer_env(**env)))
    p.wait_for(r"event=step step=1/")
    return p, flag


def _objects(gcs) -> list[str]:
    return sorted(b.name for b in gcs.client(direct=True).list_blobs(gcs.bucket))


def _gcs_checkpoint_at(run_dir: Path, config: Path, gcs, step: int, *extra: str) -> None:
    """A job paused at ``step`` with that checkpoint in GCS (and the run dir)."""
    p = start(run_dir, STEPS, config, "--gcs-uri", gcs.uri, "--stop-at-step", str(step), *extra,
              env=trainer_env(**gcs.env))
    assert p.wait() == 75, p.output[-3000:]
    assert [i.step for i in list_checkpoints(GcsStore(gcs.uri, client=gcs.client(direct=True)))] == [step]


# ------------------------------------------------------------------------------ item 4: unknown tiers


def test_a_blank_disk_waits_while_gcs_answers_403_then_resumes_from_its_step(tmp_path: Path, gcs_proxy) -> None:
    config, run_dir = write_config(tmp_path, "wait_for_tiers_s = 600\n"), tmp_path / "run"
    _gcs_checkpoint_at(run_dir, config, gcs_proxy, 10)
    shutil.rmtree(run_dir)  # a new VM (recreated, or in another zone): a blank disk
    # Its service account's grant is still propagating: every listing answers 403.
    gcs_proxy.proxy.add("GET", r"/o\?.*prefix=", "status", status=403, times=None)
    p = start(run_dir, STEPS, config, "--gcs-uri", gcs_proxy.uri, env=trainer_env(**gcs_proxy.env))
    try:
        port = int(p.wait_for(r"event=health_listening host=\S+ port=(\d+)").group(1))
        line = p.wait_for(r"event=waiting_for_tier tier=gcs error=\"Forbidden: 403 .* waited_s=\d+ until=\S+Z").string
        assert "not deciding where to resume while gcs cannot be read" in line
        # The group must not recreate the VM meanwhile: the answer passes ("ok" first).
        assert ask("127.0.0.1", port).startswith("ok waiting for gcs (unknown for ")
        p.wait_for(r"event=waiting_for_tier tier=gcs .* waited_s=[1-9]")  # it tries again, later
        gcs_proxy.proxy.clear()  # the grant arrived
        assert int(p.wait_for(r"event=restore step=(\d+) tier=gcs").group(1)) == 10
        p.seen(r"event=tiers_known waited_s=")
        assert p.wait() == 0, p.output[-3000:]
    finally:
        p.kill()
    assert "event=restore step=0" not in p.output and "starting fresh" not in p.output


def test_gcs_down_past_the_bound_fails_clearly_and_starts_nothing(tmp_path: Path, gcs_proxy) -> None:
    config, run_dir = write_config(tmp_path, "wait_for_tiers_s = 3\n"), tmp_path / "run"
    _gcs_checkpoint_at(run_dir, config, gcs_proxy, 5)
    before = _objects(gcs_proxy)
    shutil.rmtree(run_dir)
    gcs_proxy.proxy.down()
    p = start(run_dir, STEPS, config, "--gcs-uri", gcs_proxy.uri, env=trainer_env(**gcs_proxy.env))
    assert p.wait() == 69, p.output[-3000:]
    gcs_proxy.proxy.up()
    assert "event=failed reason=tier_unknown gcs stayed unknown for " in p.output
    assert "Nothing was trained, written or deleted" in p.output and "Traceback" not in p.output
    assert "event=restore" not in p.output and "event=step " not in p.output
    assert _objects(gcs_proxy) == before  # nothing deleted (and nothing written)
    assert not list(run_dir.glob("step-*"))


def test_every_rank_of_a_job_waits_and_gives_up_together(tmp_path: Path, gcs_proxy) -> None:
    """Two ranks under torchrun: rank 0 cannot read GCS; both wait, both give up (exit 69)."""
    config = write_config(tmp_path, "wait_for_tiers_s = 3\n", multi_rank=True)
    gcs_proxy.proxy.add("*", r".", "status", status=403, times=None)
    argv = run_args(tmp_path / "run", STEPS, config, "--gcs-uri", gcs_proxy.uri)
    p = Proc([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", *argv[2:]],
             env=trainer_env(**gcs_proxy.env), new_session=True)
    try:
        p.wait()
    finally:
        p.kill()
    failed = [line for line in p.lines if "event=failed reason=tier_unknown" in line]
    assert len(failed) == 2 and any("rank=1 " in line for line in failed), p.output[-4000:]
    assert "event=step " not in p.output and "event=restore" not in p.output


def test_a_restore_whose_download_fails_waits_instead_of_falling_back(tmp_path: Path, gcs_proxy) -> None:
    config, run_dir = write_config(tmp_path, "wait_for_tiers_s = 600\n"), tmp_path / "run"
    _gcs_checkpoint_at(run_dir, config, gcs_proxy, 10)
    shutil.rmtree(run_dir)
    # Listings work (manifests read), the payload downloads do not: unknown, not invalid.
    gcs_proxy.proxy.add("GET", r"alt=media.* object=.*step-00000010/(?!manifest)", "status", status=403, times=None)
    p = start(run_dir, STEPS, config, "--gcs-uri", gcs_proxy.uri, "--stop-at-step", "12",
              env=trainer_env(**gcs_proxy.env))
    try:
        p.wait_for(r"event=waiting_for_tier tier=gcs error=\"Forbidden")
        gcs_proxy.proxy.clear()
        assert int(p.wait_for(r"event=restore step=(\d+) tier=gcs").group(1)) == 10
        assert p.wait() == 75, p.output[-3000:]
    finally:
        p.kill()
    assert "falling back" not in p.output and "event=restore step=0" not in p.output


# ------------------------------------------------------------------------------ item 7: the ledger


def test_a_read_only_ledger_disk_never_stops_a_run_and_status_counts_it(tmp_path: Path, gcs_proxy, small_fs) -> None:
    config, run_dir = write_config(tmp_path), tmp_path / "run"
    ledger = small_fs("run/goodput", 1 << 20)  # the ledger's own disk; checkpoints stay writable
    ledger.readonly()
    env = trainer_env(**gcs_proxy.env)
    p = start(run_dir, 8, config, "--gcs-uri", gcs_proxy.uri, env=env)
    assert p.wait() == 0, p.output[-3000:]
    p.seen(r"event=ledger_error where=local count=1 ")
    s = status(run_dir, "--gcs-uri", gcs_proxy.uri, env=env, cli=True)
    assert s["latest_step"] == 8
    g = s["goodput"]
    assert g["finished"] and g["sessions"] == 1 and g["ledger_errors"]["local"] >= 1, g


def test_a_ledger_disk_that_fills_mid_run_still_gets_the_emergency_save(tmp_path: Path, small_fs) -> None:
    config, run_dir = write_config(tmp_path), tmp_path / "run"
    ledger = small_fs("run/goodput", 256 << 10)  # the ledger's own disk; checkpoints stay writable
    p, flag = _parked(tmp_path, run_dir, config)
    try:
        ledger.fill()
        fd = os.open(ledger.path / "ledger.jsonl", os.O_WRONLY | os.O_APPEND)  # and the file's last page
        try:
            while os.write(fd, b"\n" * 512):
                pass
        except OSError:
            pass
        finally:
            os.close(fd)
        p.signal(signal.SIGTERM)
        p.wait_for(r"event=preemption_notice reason=SIGTERM")
        flag.unlink()  # the step in flight completes; every ledger write from here fails
        assert p.wait() == 75, p.output[-3000:]
    finally:
        p.kill()
    p.seen(r"event=ledger_error where=local count=1 ")
    saved = int(p.seen(r"event=preempted step=(\d+) persistent_ok=1").group(1))
    ledger.free()
    p = start(run_dir, 400, config, "--task", GATE_TASK, "--stop-at-step", str(saved + 1), env=trainer_env())
    assert p.wait() == 75, p.output[-3000:]
    assert int(p.seen(r"event=restore step=(\d+)").group(1)) == saved


# ------------------------------------------------------------------------------ item 8: the numbers


def test_settings_that_change_the_numbers_are_refused_and_stop_at_step_is_honoured(tmp_path: Path) -> None:
    config, run_dir = write_config(tmp_path), tmp_path / "run"
    p = start(run_dir, STEPS, config, "--stop-at-step", "6")
    assert p.wait() == 75, p.output[-3000:]
    # A stop_at_step at or below the checkpoint's step pauses at once.
    p = start(run_dir, STEPS, config, "--stop-at-step", "4")
    assert p.wait() == 75, p.output[-3000:]
    p.seen(r"event=stop_at_step stop_at_step=4 step=6 \(already there: pausing at once\)")
    p.seen(r"event=paused step=6 ")
    assert "event=step " not in p.output
    # Other CPU threads (or determinism) would silently change the final weights: refused.
    other = write_config(tmp_path, "threads = 2\ndeterministic = false\n")
    p = start(run_dir, STEPS, other)
    assert p.wait() == 2, p.output[-3000:]
    assert "threads: checkpoint has 1, this run has 2" in p.output
    assert "deterministic: checkpoint has True, this run has False" in p.output
    assert "Traceback" not in p.output and "event=step " not in p.output


# ------------------------------------------------------------------------------ item 9: one writer


def test_a_second_trainer_on_the_same_run_dir_exits_2_naming_the_first(tmp_path: Path) -> None:
    config, run_dir = write_config(tmp_path), tmp_path / "run"
    a, flag = _parked(tmp_path, run_dir, config)
    try:
        b = start(run_dir, 400, config, "--task", GATE_TASK, env=trainer_env())
        assert b.wait() == 2, b.output[-3000:]
        assert f"is in use by another trainer (pid {a.p.pid} on host " in b.output
        assert "Traceback" not in b.output and "event=restore" not in b.output
        a.signal(signal.SIGTERM)  # the first one never noticed: it saves and stops as usual
        flag.unlink()
        assert a.wait() == 75, a.output[-3000:]
    finally:
        a.kill()
    a.seen(r"event=preempted step=2 persistent_ok=1")


def test_two_run_dirs_on_one_gcs_prefix_never_write_it_at_once(tmp_path: Path, gcs_proxy) -> None:
    config = write_config(tmp_path, "lease_ttl_s = 2\n")
    env = trainer_env(**gcs_proxy.env)
    a, flag = _parked(tmp_path, tmp_path / "a", config, "--gcs-uri", gcs_proxy.uri, **gcs_proxy.env)
    try:
        a.seen(r"event=lease_acquired holder=\S+:\S+/a object=")
        b = start(tmp_path / "b", 400, config, "--task", GATE_TASK, "--gcs-uri", gcs_proxy.uri, env=env)
        assert b.wait() == 2, b.output[-3000:]
        b.seen(r'event=waiting_for_lease holder="\S+/a \(pid \d+ on host ')
        b.seen(r"event=failed reason=bad_input another trainer is writing this job: the writer lease "
               rf"{gcs_proxy.uri}/{LEASE_KEY} is held and renewed by \S+/a ")
        assert "event=restore" not in b.output
        a.signal(signal.SIGTERM)  # a never noticed: its emergency save reaches GCS
        flag.unlink()
        assert a.wait() == 75, a.output[-3000:]
    finally:
        a.kill()
    a.seen(r"event=lease_released ok=1")
    assert not list((tmp_path / "b").glob("step-*"))
    # Released on exit: b takes over at once and resumes from a's newest GCS step.
    saved = int(a.seen(r"event=preempted step=(\d+) persistent_ok=1 gcs_ok=True").group(1))
    b = start(tmp_path / "b", 400, config, "--task", GATE_TASK, "--gcs-uri", gcs_proxy.uri,
              "--stop-at-step", str(saved + 1), env=env)
    assert b.wait() == 75, b.output[-3000:]
    assert int(b.seen(r"event=restore step=(\d+) tier=gcs").group(1)) == saved
    assert "event=waiting_for_lease" not in b.output


def _pool_job(tmp_path: Path, run_dir: Path, config: Path, gcs, **env: str) -> Proc:
    """One torchrun job of a pool (as trainer.sh starts it: c10d rendezvous, the experiment's name
    as rendezvous id) on a rendezvous of its own, parked in step 2 while its gate flag exists."""
    from drill.net import free_port

    argv = run_args(run_dir, 400, config, "--task", GATE_TASK, "--gcs-uri", gcs.uri)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=1", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=pool", "--max-restarts=0", "-m", *argv[2:]]
    flag = tmp_path / f"gate-{run_dir.name}"
    env = trainer_env(SPOTTRAIN_NODE="pool-0", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **gcs.env, **env)
    return Proc(cmd, env=gated(flag, 1, env), new_session=True)


def test_a_second_incarnation_of_a_pool_job_exits_2_and_the_first_keeps_its_lease(tmp_path: Path, gcs_proxy) -> None:
    """Two torchrun jobs with the same rendezvous id (a pool deployed twice on one prefix, or a
    duplicated pool): the same holder name, two incarnations. The second must not take the
    first one's live lease as its own."""
    config = write_config(tmp_path, "lease_ttl_s = 2\n")
    first = _pool_job(tmp_path, tmp_path / "a", config, gcs_proxy)
    try:
        first.wait_for(r"event=step step=1/")
        first.seen(r"event=lease_acquired holder=torchrun job pool\b")
        reason = tmp_path / "bad-input"
        second = _pool_job(tmp_path, tmp_path / "b", config, gcs_proxy, SPOTTRAIN_BAD_INPUT_FILE=str(reason))
        try:
            got = second.wait_for(r"event=(failed reason=bad_input|lease_acquired) .*").group(0)
            assert got.startswith("event=failed"), got
            second.wait()
        finally:
            second.kill()
        assert 'held and renewed by "torchrun job pool on pool-0:' in reason.read_text(), second.output[-3000:]
        assert "event=restore" not in second.output
        assert "event=lease_lost" not in first.output
        first.signal(signal.SIGTERM, group=True)
        (tmp_path / "gate-a").unlink()
        first.wait()
        first.seen(r"event=preempted step=\d+ persistent_ok=1 gcs_ok=True")
        first.seen(r"event=lease_released ok=1")
    finally:
        first.kill()


def test_a_holder_that_died_is_replaced_after_the_ttl(tmp_path: Path, gcs_proxy) -> None:
    config = write_config(tmp_path, "lease_ttl_s = 3\n")
    gate = tmp_path / "gate"
    a = start(tmp_path / "a", 400, config, "--task", GATE_TASK, "--gcs-uri", gcs_proxy.uri, "--checkpoint-every-steps",
              "5", env=gated(gate, 12, trainer_env(**gcs_proxy.env)))
    try:
        a.wait_for(r"checkpoint step 5 durable on gcs")  # then it parks at step 13
    finally:
        a.power_off()  # no emergency save, no release
        a.wait()
    b = start(tmp_path / "b", 400, config, "--task", GATE_TASK, "--gcs-uri", gcs_proxy.uri, "--stop-at-step", "12",
              env=trainer_env(**gcs_proxy.env))
    assert b.wait() == 75, b.output[-3000:]
    # (Whether b had to wait depends on how long it took to start: test_lease shows the wait.)
    b.seen(r'event=lease_acquired holder=\S+/b object=.* took_over=expired previous="\S+/a ')
    assert int(b.seen(r"event=restore step=(\d+) tier=").group(1)) >= 5


def test_a_trainer_whose_lease_is_taken_stops_writing_gcs_and_exits_2(tmp_path: Path, gcs_proxy) -> None:
    config = write_config(tmp_path, "lease_ttl_s = 2\n")
    a, flag = _parked(tmp_path, tmp_path / "a", config, "--gcs-uri", gcs_proxy.uri, "--checkpoint-every-steps",
                      "1000", **gcs_proxy.env)
    try:
        # Another trainer takes the lease over (as one that judged it expired would).
        blob = gcs_proxy.client(direct=True).bucket(gcs_proxy.bucket).blob(
            f"{gcs_proxy.uri.split('/', 3)[3]}/{LEASE_KEY}")
        blob.upload_from_string(json.dumps({"holder": "vm-z:/run", "pid": 7, "host": "vm-z"}))
        a.wait_for(r'event=lease_lost taker="vm-z:/run \(pid 7 on host vm-z')
        flag.unlink()  # the step in flight completes, then every rank stops
        assert a.wait() == 2, a.output[-3000:]
    finally:
        a.kill()
    stopped = int(a.seen(r"event=stopped reason=lease_lost step=(\d+)").group(1))
    # Its last step went to its own disk only: nothing more in GCS, the lease left to the taker.
    assert [i.step for i in list_checkpoints(GcsStore(gcs_proxy.uri, client=gcs_proxy.client(direct=True)))] == []
    assert (tmp_path / "a" / f"step-{stopped:08d}").is_dir()
    assert json.loads(blob.download_as_bytes())["holder"] == "vm-z:/run"
