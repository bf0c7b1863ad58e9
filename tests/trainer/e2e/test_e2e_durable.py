"""`python -m trainer run` counts a run as finished (exit 0, `event=finished`) only once its final
checkpoint is durable on every durable tier; otherwise it retries within `durable_timeout_s` and
exits 74, and a re-run writes the missing copies before it says complete. Faults as they happen:
Cloud Storage behind the fault proxy, a real run dir that fills up, a real SIGTERM."""
from __future__ import annotations

import signal
from pathlib import Path

from trainer.checkpoint.manifest import MANIFEST, step_name
from trainer.checkpoint.whole_model import list_whole as list_checkpoints
from trainer.observe.health import ask
from trainer.checkpoint.stores import GcsStore
from tests.trainer.support import GATE_TASK, TIMEOUT, gated, start, status, trainer_env, write_config

STEPS = 6


def _valid_on_gcs(gcs_proxy) -> list[int]:
    return [i.step for i in list_checkpoints(GcsStore(gcs_proxy.uri, client=gcs_proxy.client(direct=True)))
            if i.valid]


def _seen_or_wait(p, pattern: str) -> None:
    try:
        p.seen(pattern)
    except AssertionError:
        p.wait_for(pattern)


def _prefix(gcs_proxy) -> str:
    return gcs_proxy.uri.split("/", 3)[3]


def test_gcs_refusing_the_final_upload_is_not_finished_and_a_rerun_repairs_it(tmp_path: Path, gcs_proxy) -> None:
    config, run_dir, flag = write_config(tmp_path, "durable_timeout_s = 3\n"), tmp_path / "run", tmp_path / "gate"
    # Every manifest upload answers 403 (a grant withdrawn); the loader parks in step 5 meanwhile.
    rule = gcs_proxy.proxy.add("POST", rf"object={_prefix(gcs_proxy)}/step-\d+/manifest[.]json$", "status",
                               status=403, times=None)
    env = gated(flag, 4, trainer_env(**gcs_proxy.env))
    args = ("--gcs-uri", gcs_proxy.uri, "--checkpoint-every-steps", "2", "--task", GATE_TASK)
    p = start(run_dir, STEPS, config, *args, env=env)
    port = int(p.wait_for(r"event=health_listening host=\S+ port=(\d+)").group(1))
    for line in (r"event=tier_failing tier=gcs", r"event=step step=4/"):  # in either order
        _seen_or_wait(p, line)
    # Still training: the check passes (no autohealing), and says which tier keeps failing.
    answer = ask("127.0.0.1", port)
    assert answer.startswith("ok degraded: gcs failing since") and "403" in answer, answer
    flag.unlink()
    assert p.wait() == 74, p.output[-3000:]
    p.seen(rf"event=not_durable step={STEPS} .*gcs NOT DURABLE")
    assert "event=finished" not in p.output
    s = status(run_dir, "--gcs-uri", gcs_proxy.uri, env=env, cli=True)
    assert s["tiers"]["persistent"]["newest_valid"] == STEPS and s["tiers"]["gcs"]["newest_valid"] is None
    assert list(s["failing"]) == ["gcs"] and not s["goodput"]["finished"]

    gcs_proxy.proxy.release(rule)
    p = start(run_dir, STEPS, config, *args, env=env)
    assert p.wait() == 0, p.output[-3000:]
    p.seen(rf"event=finished step={STEPS} \(already complete\)")
    assert "event=step " not in p.output
    # What went up is the final checkpoint on the disk, manifest and all.
    assert _valid_on_gcs(gcs_proxy)[0] == STEPS
    gcs = GcsStore(gcs_proxy.uri, client=gcs_proxy.client(direct=True))
    assert gcs.get_bytes(f"{step_name(STEPS)}/{MANIFEST}") == (run_dir / step_name(STEPS) / MANIFEST).read_bytes()
    s = status(run_dir, "--gcs-uri", gcs_proxy.uri, env=env, cli=True)
    assert s["failing"] == {} and s["goodput"]["finished"]


def test_a_full_run_dir_at_the_end_is_not_finished_but_gcs_gets_the_model(tmp_path: Path, gcs_proxy, small_fs) -> None:
    pd = small_fs("pd", 8 << 20)
    config, run_dir, flag = write_config(tmp_path, "durable_timeout_s = 2\n"), pd.path / "run", tmp_path / "gate"
    env = gated(flag, STEPS - 1, trainer_env(**gcs_proxy.env))
    args = ("--gcs-uri", gcs_proxy.uri, "--checkpoint-every-steps", "100", "--task", GATE_TASK)
    p = start(run_dir, STEPS, config, *args, env=env)
    p.wait_for(rf"event=step step={STEPS - 1}/")  # parked in the last step's batch
    pd.fill(leave_bytes=64 << 10)  # the ledger's lines still fit; a checkpoint does not
    flag.unlink()
    assert p.wait() == 74, p.output[-3000:]
    p.seen(rf"checkpoint step {STEPS}: no disk tier took it; uploading it to gcs from host memory")
    p.seen(rf"event=not_durable step={STEPS} .*persistent NOT DURABLE")
    assert "event=finished" not in p.output
    assert _valid_on_gcs(gcs_proxy) == [STEPS]  # the tiers failed independently

    pd.free()
    p = start(run_dir, STEPS, config, *args, env=env)
    assert p.wait() == 0, p.output[-3000:]
    p.seen(rf"downloaded step {STEPS} from gs:")
    p.seen(rf"event=finished step={STEPS} \(already complete\)")
    assert status(run_dir)["latest_step"] == STEPS


def test_sigterm_during_a_stalled_final_upload_saves_and_exits_75(tmp_path: Path, gcs_proxy) -> None:
    config, run_dir = write_config(tmp_path, "preemption_budget_s = 3\n"), tmp_path / "run"
    stall = gcs_proxy.proxy.add("POST", rf"object={_prefix(gcs_proxy)}/{step_name(STEPS)}/tensors[.]bin$",
                                "stall", times=None)
    env = trainer_env(**gcs_proxy.env)
    args = ("--gcs-uri", gcs_proxy.uri, "--checkpoint-every-steps", "100")
    p = start(run_dir, STEPS, config, *args, env=env)
    assert gcs_proxy.proxy.wait_stalled(stall, timeout=TIMEOUT)
    p.signal(signal.SIGTERM)  # the final upload hangs in the network: the notice is not ignored
    assert p.wait() == 75, p.output[-3000:]
    p.seen(rf"event=preempted step={STEPS} persistent_ok=1 gcs_ok=False")
    assert "event=finished" not in p.output

    gcs_proxy.proxy.release(stall)
    p = start(run_dir, STEPS, config, *args, env=env)
    assert p.wait() == 0, p.output[-3000:]
    p.seen(rf"event=finished step={STEPS} \(already complete\)")
    assert _valid_on_gcs(gcs_proxy) == [STEPS]


def test_the_export_after_finishing_stays_healthy_and_gives_way_to_a_notice(tmp_path: Path, gcs_proxy) -> None:
    """A big model's export takes minutes after `event=finished`: the health check passes
    meanwhile (autohealing must not recreate a finished VM), and a SIGTERM then is acted on at
    once (exit 0: the final checkpoint is durable; the export is left for a re-run or by hand)."""
    config, run_dir = write_config(tmp_path), tmp_path / "run"
    stall = gcs_proxy.proxy.add("POST", rf"object={_prefix(gcs_proxy)}/export/{step_name(STEPS)}/model[.]safetensors$",
                                "stall", times=None)
    env = trainer_env(**gcs_proxy.env)
    args = ("--gcs-uri", gcs_proxy.uri, "--checkpoint-every-steps", "100")
    p = start(run_dir, STEPS, config, *args, env=env)
    port = int(p.wait_for(r"event=health_listening host=\S+ port=(\d+)").group(1))
    assert gcs_proxy.proxy.wait_stalled(stall, timeout=TIMEOUT)  # the export's upload hangs
    p.seen(rf"event=finished step={STEPS}")
    assert ask("127.0.0.1", port) == f"ok finishing: exporting step {STEPS} (the final checkpoint is durable)"
    p.signal(signal.SIGTERM)
    assert p.wait() == 0, p.output[-3000:]
    p.seen(rf"event=export ok=0 step={STEPS} interrupted=1")
    assert stall.held >= 1  # it left while the upload was still held
    gcs = GcsStore(gcs_proxy.uri, client=gcs_proxy.client(direct=True))
    assert not gcs.names(f"export/{step_name(STEPS)}/model.json")

    gcs_proxy.proxy.release(stall)  # a re-run of the finished job writes the export
    p = start(run_dir, STEPS, config, *args, env=env)
    assert p.wait() == 0, p.output[-3000:]
    p.seen(rf"event=export step={STEPS} at=gs://")
    assert gcs.names(f"export/{step_name(STEPS)}/model.json")


def test_fsdp_final_checkpoint_refused_by_gcs_is_not_finished_until_a_rerun(tmp_path: Path, gcs_proxy) -> None:
    config = write_config(tmp_path, 'parallelism = "fsdp"\ndurable_timeout_s = 2\n')
    run_dir = tmp_path / "run"
    rule = gcs_proxy.proxy.add("POST", rf"object={_prefix(gcs_proxy)}/{step_name(STEPS)}/manifest[.]json$",
                               "status", status=403, times=None)
    env = trainer_env(**gcs_proxy.env)
    args = ("--gcs-uri", gcs_proxy.uri, "--checkpoint-every-steps", "100")
    p = start(run_dir, STEPS, config, *args, env=env)
    assert p.wait() == 74, p.output[-3000:]
    assert "event=finished" not in p.output
    gcs_proxy.proxy.release(rule)
    p = start(run_dir, STEPS, config, *args, env=env)
    assert p.wait() == 0, p.output[-3000:]
    p.seen(rf"event=finished step={STEPS} \(already complete\)")
    from trainer.checkpoint.sharded import list_sharded

    assert [i.step for i in list_sharded(GcsStore(gcs_proxy.uri, client=gcs_proxy.client(direct=True)))
            if i.valid] == [STEPS]
