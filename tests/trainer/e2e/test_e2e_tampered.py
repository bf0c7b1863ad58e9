"""Checkpoints someone else wrote, and checkpoints the code no longer fits, against the real CLI.

Whoever can write the checkpoint bucket but does not hold the run's checkpoint key plants a newer
checkpoint whose payload is a pickle that would run code (a marker file appears if it ever runs),
with every file digest and the manifest's self-checksum recomputed. `trainer status` and `trainer run`
must never run it, must say why they refuse it, must resume from the newest authentic checkpoint
and must never delete it. A checkpoint that verifies but no longer loads into the model (the code
changed) is a resume mismatch: exit 2 naming the step, the tier and the reason, nothing deleted.
"""
from __future__ import annotations

import os
import re
import shutil
import time
import uuid
from pathlib import Path

import pytest

from tests.trainer.support import (Proc, bucket_names, code_running_pickle, forge_in_bucket, run_args,
                                   run_to_end, start, status, trainer_env, write_config)

STEPS = 40  # the reference run's (e2e conftest)


def test_a_forged_checkpoint_in_the_bucket_is_never_loaded(tmp_path: Path, gcs_emulator, reference: dict) -> None:
    from trainer.checkpoint.whole_model import STATE

    config, run_dir = write_config(tmp_path), tmp_path / "run"
    env = trainer_env(**gcs_emulator.env)
    gcs = ("--gcs-uri", gcs_emulator.uri, "--checkpoint-every-steps", "10")
    assert start(run_dir, STEPS, config, *gcs, "--stop-at-step", "20", env=env).wait() == 75
    # Two forgeries newer than anything authentic: this format with its structure replaced, and
    # the older format whose pickled state.pt older trainers unpickled.
    same, legacy = tmp_path / "ran-same-format", tmp_path / "ran-legacy-format"
    forge_in_bucket(gcs_emulator.client, gcs_emulator.uri, 20, 30, {STATE: code_running_pickle(same)})
    forge_in_bucket(gcs_emulator.client, gcs_emulator.uri, 20, 25, {"state.pt": code_running_pickle(legacy)},
                    legacy=True)

    s = status(run_dir, "--gcs-uri", gcs_emulator.uri)  # an operator's laptop, with the run's key
    assert not same.exists() and not legacy.exists()
    assert s["latest_step"] == 20
    refused = {c["step"]: c["reason"] for c in s["tiers"]["gcs"]["checkpoints"] if not c["valid"]}
    assert refused[30].startswith("unauthenticated: its manifest carries no HMAC")
    assert refused[25].startswith("unauthenticated: checkpoint format 1, written by an older spottrain")

    p = run_to_end(run_dir, STEPS, config, *gcs, env=env)
    assert not same.exists() and not legacy.exists()
    p.seen(r"refusing gcs checkpoint step 30 at gs://\S+: unauthenticated: ")
    p.seen(r"refusing gcs checkpoint step 25 at gs://\S+: unauthenticated: checkpoint format 1")
    p.seen(r"event=restore step=20 tier=persistent")
    # Never deleted, never overwritten (the run's own step 30 skipped GCS rather than replace it).
    names = bucket_names(gcs_emulator.client, gcs_emulator.uri)
    assert {"step-00000030/manifest.json", "step-00000025/manifest.json"} <= names
    p.seen(r"gcs holds a checkpoint at step 30 that is never overwritten")
    final = status(run_dir, "--gcs-uri", gcs_emulator.uri)
    assert final["latest_step"] == STEPS and final["model_digest"] == reference["model_digest"]
    assert not same.exists() and not legacy.exists()


@pytest.mark.xdist_group("torchrun")
def test_a_forged_sharded_checkpoint_is_never_read(tmp_path: Path, gcs_emulator) -> None:
    from trainer.checkpoint.sharded import DCP_METADATA, EXTRAS

    config, run_dir = write_config(tmp_path, 'parallelism = "fsdp"\n'), tmp_path / "run"
    env = trainer_env(**gcs_emulator.env)
    gcs = ("--gcs-uri", gcs_emulator.uri, "--checkpoint-every-steps", "10")
    assert start(run_dir, STEPS, config, *gcs, "--stop-at-step", "20", env=env).wait() == 75
    meta, extras = tmp_path / "ran-metadata", tmp_path / "ran-extras"
    forge_in_bucket(gcs_emulator.client, gcs_emulator.uri, 20, 30,
                    {DCP_METADATA: code_running_pickle(meta, torch_save=False)})
    forge_in_bucket(gcs_emulator.client, gcs_emulator.uri, 20, 25, {EXTRAS: code_running_pickle(extras)})

    s = status(run_dir, "--gcs-uri", gcs_emulator.uri)
    assert not meta.exists() and not extras.exists()
    assert s["sharded"] and s["latest_step"] == 20
    p = start(run_dir, STEPS, config, *gcs, "--stop-at-step", "21", env=env)
    assert p.wait() == 75, p.output[-3000:]
    assert not meta.exists() and not extras.exists()
    p.seen(r"refusing gcs checkpoint step 30 at gs://\S+: unauthenticated: ")
    p.seen(r"event=restore step=20 tier=persistent")
    assert {"step-00000030/manifest.json", "step-00000025/manifest.json"} <= bucket_names(
        gcs_emulator.client, gcs_emulator.uri)


TASK = """\
import torch
from trainer.task import Task

WIDTH = {width}


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = torch.nn.Sequential(torch.nn.Linear(1, WIDTH), torch.nn.Linear(WIDTH, 1))

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.f(x), y)


def build(ctx):
    model = Net().to(ctx.device)
    data = [(torch.tensor([i / 64.0]), torch.tensor([i / 32.0])) for i in range(64)]
    return Task(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), dataset=data)
"""


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_a_verified_checkpoint_the_code_no_longer_fits_is_a_resume_mismatch(tmp_path: Path,
                                                                              parallelism: str) -> None:
    module = f"refactored_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(TASK.format(width=8))
    env = trainer_env(PYTHONPATH=f"{tmp_path}{os.pathsep}{trainer_env()['PYTHONPATH']}")
    config = tmp_path / "trainer.toml"
    config.write_text(f'log_every_steps = 1\nbatch_size = 4\nparallelism = "{parallelism}"\ntask = "{module}:build"\n')
    run_dir = tmp_path / "run"
    args = ("--checkpoint-every-steps", "2", "--stop-at-step", "4")
    first = Proc(run_args(run_dir, 8, config, *args), env=env)
    assert first.wait() == 75, first.output[-3000:]
    before = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if "step-" in str(p))
    assert "step-00000004/manifest.json" in before

    (tmp_path / f"{module}.py").write_text(TASK.format(width=16))  # the model changed shape
    p = Proc(run_args(run_dir, 8, config), env=env)
    assert p.wait() == 2, p.output[-3000:]
    assert "Traceback" not in p.output
    p.seen(r"event=failed reason=bad_input cannot resume from step 4 on persistent .*verified but does not")
    p.seen(r"size mismatch|Size mismatch")
    after = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if "step-" in str(p))
    assert after == before  # nothing deleted, nothing written: no fresh start


def test_without_a_key_a_sharded_run_is_refused_with_exit_2(tmp_path: Path) -> None:
    config = write_config(tmp_path, 'parallelism = "fsdp"\n')
    p = Proc(run_args(tmp_path / "run", 4, config, "--checkpoint-key-file", str(tmp_path / "missing.key")))
    assert p.wait() == 2, p.output[-3000:]
    p.seen(r"event=failed reason=bad_input checkpoint_key_file: cannot read .*missing\.key")

    # A sharded run dir, inspected with no key at all: exit 2 naming the flag, nothing read.
    run_dir = tmp_path / "sharded"
    assert Proc(run_args(run_dir, 2, config)).wait() == 0
    env = {k: v for k, v in trainer_env().items() if k != "SPOTTRAIN_CHECKPOINT_KEY_FILE"}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "empty-config")  # no per-user default key either
    out = Proc([*run_args(run_dir, 2, config)[:3], "status", "--run-dir", str(run_dir), "--json"], env=env)
    assert out.wait() == 2
    out.seen(r"command line: checkpoint_key_file: sharded checkpoints .*--checkpoint-key-file")


def test_a_key_path_that_is_a_fifo_is_refused_at_start_up(tmp_path: Path) -> None:
    """A FIFO (or a device) named as the key: start-up must not wait for a writer that never comes."""
    fifo = tmp_path / "checkpoint.key"
    os.mkfifo(fifo)
    p = Proc(run_args(tmp_path / "run", 4, write_config(tmp_path), "--checkpoint-key-file", str(fifo)))
    assert p.wait() == 2, p.output[-3000:]
    assert "Traceback" not in p.output
    p.seen(r"event=failed reason=bad_input checkpoint_key_file: \S*checkpoint\.key is not a regular file \(a FIFO\)")


def test_garbage_objects_in_the_bucket_never_stop_the_job(tmp_path: Path, gcs_emulator) -> None:
    """A bucket writer plants 200 KB of nested `[` as the newest manifest and as the writer lease:
    the manifest is no checkpoint (GCS is not 'unknown'), the lease an unreadable one that is
    taken over once nobody renews it; the run resumes from its newest authentic step and ends."""
    from trainer.checkpoint.lease import LEASE_KEY

    config, run_dir = write_config(tmp_path, "lease_ttl_s = 2\n"), tmp_path / "run"
    env = trainer_env(**gcs_emulator.env)
    gcs = ("--gcs-uri", gcs_emulator.uri, "--checkpoint-every-steps", "10")
    assert start(run_dir, STEPS, config, *gcs, "--stop-at-step", "20", env=env).wait() == 75
    bucket_name, _, prefix = gcs_emulator.uri[len("gs://"):].partition("/")
    bucket = gcs_emulator.client.bucket(bucket_name)
    nested = b"[" * 200_000
    bucket.blob(f"{prefix}/step-00000030/manifest.json").upload_from_string(nested)
    bucket.blob(f"{prefix}/step-00000030/model.safetensors").upload_from_string(b"x")
    bucket.blob(f"{prefix}/{LEASE_KEY}").upload_from_string(nested)

    p = run_to_end(run_dir, STEPS, config, *gcs, env=env)
    assert "Traceback" not in p.output and "RecursionError" not in p.output
    p.seen(r"ignoring gcs checkpoint step 30 at gs://\S+: manifest is nested too deeply to be one")
    p.seen(r'event=lease_acquired .*took_over=expired previous="unreadable lease object gs://\S+lease\.json')
    p.seen(r"event=restore step=20 tier=persistent")
    assert status(run_dir, "--gcs-uri", gcs_emulator.uri)["latest_step"] == STEPS


def test_a_forged_final_checkpoint_never_finishes_the_run(tmp_path: Path, gcs_emulator) -> None:
    """A bucket writer plants a well-formed manifest (every file digest right, no HMAC) at the final step
    before the run gets there: the trainer's own upload meets it and skips GCS (it is never
    overwritten), and the read-back authenticates, so the final checkpoint is not durable: exit 74,
    never `finished` (which would let scale-to-zero delete the disk holding the only authentic
    final step)."""
    config, run_dir = write_config(tmp_path), tmp_path / "run"
    env = trainer_env(**gcs_emulator.env)
    gcs = ("--gcs-uri", gcs_emulator.uri, "--checkpoint-every-steps", "10")
    assert start(run_dir, STEPS, config, *gcs, "--stop-at-step", "20", env=env).wait() == 75
    forge_in_bucket(gcs_emulator.client, gcs_emulator.uri, 20, STEPS, {})

    p = start(run_dir, STEPS, config, *gcs, "--durable-timeout-s", "2", env=env)
    assert p.wait() == 74, p.output[-4000:]
    p.seen(rf"gcs holds a checkpoint at step {STEPS} that is never overwritten")
    p.seen(rf"step {STEPS}\) is not durable .*gcs NOT DURABLE: unauthenticated: its manifest carries no HMAC")
    assert not any("event=finished" in line for line in p.lines)
    # Nothing deleted: the planted one stays (never deleted), the authentic final step is on disk.
    assert f"step-{STEPS:08d}/manifest.json" in bucket_names(gcs_emulator.client, gcs_emulator.uri)
    assert status(run_dir)["latest_step"] == STEPS


def _copy_step(client, src_uri: str, dst_uri: str, step: int) -> None:
    """Copy one checkpoint, object by object, as anyone who can write the bucket can."""
    src_bucket, _, src_prefix = src_uri[len("gs://"):].partition("/")
    dst_bucket, _, dst_prefix = dst_uri[len("gs://"):].partition("/")
    folder = f"step-{step:08d}/"
    source, target = client.bucket(src_bucket), client.bucket(dst_bucket)
    for blob in client.list_blobs(src_bucket, prefix=f"{src_prefix}/{folder}"):
        name = blob.name[len(src_prefix) + 1:]
        source.copy_blob(blob, target, f"{dst_prefix}/{name}")


def test_another_runs_authentic_checkpoint_copied_in_is_never_resumed(tmp_path: Path, gcs_emulator,
                                                                      reference: dict) -> None:
    """Runs of one experiment share its checkpoint key. Another run's step 30 (authentic under
    that key, same settings), copied into this run's prefix, names the run it was signed for: it
    is refused, never overwritten, and this run resumes its own step 20 and ends as an
    uninterrupted run does."""
    config = write_config(tmp_path)
    env = trainer_env(**gcs_emulator.env)
    other_uri = gcs_emulator.uri + "-other"
    assert start(tmp_path / "other", STEPS, config, "--gcs-uri", other_uri, "--checkpoint-every-steps", "10",
                 "--stop-at-step", "30", env=env).wait() == 75
    run_dir, gcs = tmp_path / "run", ("--gcs-uri", gcs_emulator.uri, "--checkpoint-every-steps", "10")
    assert start(run_dir, STEPS, config, *gcs, "--stop-at-step", "20", env=env).wait() == 75
    _copy_step(gcs_emulator.client, other_uri, gcs_emulator.uri, 30)

    p = run_to_end(run_dir, STEPS, config, *gcs, env=env)
    p.seen(r"refusing gcs checkpoint step 30 at gs://\S+: another run's: signed for the run at \"gs://\S+-other\"")
    p.seen(r"event=restore step=20 tier=persistent")
    assert "step-00000030/manifest.json" in bucket_names(gcs_emulator.client, gcs_emulator.uri)
    final = status(run_dir, "--gcs-uri", gcs_emulator.uri)
    assert final["latest_step"] == STEPS and final["model_digest"] == reference["model_digest"]


def test_checkpoints_planted_at_a_first_boot_never_stop_the_run(tmp_path: Path, gcs_emulator) -> None:
    """Before a run's first boot, a bucket writer without the key copies another run's authentic
    checkpoint into its prefix and plants an unsigned forgery. No record signed by this run says it
    ever saved, so it sets them aside (never loaded, deleted or overwritten), says so as an event
    an alert can match (and in its ledger), and trains to the end; a restart resumes its own."""
    from trainer.observe.ledger import LEDGER_DIR, LEDGER_FILE, read_events

    config = write_config(tmp_path)
    env = trainer_env(**gcs_emulator.env)
    other_uri = gcs_emulator.uri + "-moved-from"
    assert start(tmp_path / "other", STEPS, config, "--gcs-uri", other_uri, "--checkpoint-every-steps", "10",
                 "--stop-at-step", "10", env=env).wait() == 75
    _copy_step(gcs_emulator.client, other_uri, gcs_emulator.uri, 10)
    forge_in_bucket(gcs_emulator.client, gcs_emulator.uri, 10, 30, {})
    planted = {"step-00000010/manifest.json", "step-00000030/manifest.json"}

    run_dir, gcs = tmp_path / "run", ("--gcs-uri", gcs_emulator.uri, "--checkpoint-every-steps", "10")
    p = start(run_dir, STEPS, config, *gcs, "--stop-at-step", "20", env=env)
    assert p.wait() == 75, p.output[-4000:]
    assert "Traceback" not in p.output
    line = p.seen(r"event=checkpoints_set_aside saved_before=0 steps=10,30 \(started from scratch beside "
                  r"checkpoints nobody can vouch for as this run's: .*").group(0)
    assert re.search(r"gcs step 10 at gs://\S+: another run's: signed for the run at " + r'"\S+-moved-from"', line)
    assert re.search(r"gcs step 30 at gs://\S+: unauthenticated: its manifest carries no HMAC", line)
    p.seen(r"event=restore step=0 \(no checkpoint: starting fresh\)")
    p.seen(r"gcs holds a checkpoint at step 10 that is never overwritten")
    aside = [e for e in read_events(run_dir / LEDGER_DIR / LEDGER_FILE) if e["event"] == "checkpoints_set_aside"]
    assert len(aside) == 1 and aside[0]["saved_before"] is False and aside[0]["steps"] == [10, 30]
    assert planted <= bucket_names(gcs_emulator.client, gcs_emulator.uri)

    shutil.rmtree(run_dir)  # a blank disk: the bucket holds its own step 20 now, beside the planted ones
    p = start(run_dir, STEPS, config, *gcs, "--stop-at-step", "25", env=env)
    assert p.wait() == 75, p.output[-4000:]
    p.seen(r"event=restore step=20 tier=gcs")
    assert not any("checkpoints_set_aside" in line for line in p.lines)
    assert planted <= bucket_names(gcs_emulator.client, gcs_emulator.uri)


def _recorded_in_bucket(run_dir: Path) -> list[int]:
    """The steps the run's ledger (on its own disk) recorded durable in the bucket."""
    from trainer.observe.ledger import LEDGER_DIR, LEDGER_FILE, read_events

    return [e["step"] for e in read_events(run_dir / LEDGER_DIR / LEDGER_FILE)
            if e["event"] == "durable" and e.get("tier") == "gcs"]


def test_deleting_the_newest_checkpoints_from_the_bucket_never_rolls_the_run_back(tmp_path: Path,
                                                                                  gcs_emulator) -> None:
    """The fast tier (a local SSD) goes with the VM, and the persistent disk saves seldom: after a
    crash the bucket holds the only copies. Someone who can write the bucket deletes them. The
    run's ledger, on its own disk, recorded them durable in the bucket: the restore refuses to
    start afresh (exit 2, naming the newest), and does so only when told to (--allow-rollback)."""
    config = write_config(tmp_path, "[tiers.persistent]\nevery_steps = 100000\n")
    env = trainer_env(**gcs_emulator.env)
    run_dir, local = tmp_path / "run", tmp_path / "ssd"
    gcs = ("--gcs-uri", gcs_emulator.uri, "--local-dir", str(local), "--checkpoint-every-steps", "10")
    p = start(run_dir, 1_000_000, config, *gcs, env=env)
    p.wait_for(r"checkpoint step \d+ durable on gcs")
    deadline = time.monotonic() + 120
    while not _recorded_in_bucket(run_dir):  # the ledger line follows the log line, on the same thread
        assert time.monotonic() < deadline and p.p.poll() is None, p.output[-4000:]
        time.sleep(0.05)  # polling a file the trainer appends to
    p.kill()  # the VM is gone, and its local SSD with it
    shutil.rmtree(local)
    newest = max(_recorded_in_bucket(run_dir))
    bucket_name, _, prefix = gcs_emulator.uri[len("gs://"):].partition("/")
    for blob in gcs_emulator.client.list_blobs(bucket_name, prefix=f"{prefix}/step-"):
        blob.delete()

    p = start(run_dir, 1_000_000, config, *gcs, env=env)
    assert p.wait() == 2, p.output[-4000:]
    p.seen(rf"cannot resume: this run's ledger \(\S+ledger\.jsonl\) records step {newest} durable in the bucket "
           r".* resuming would roll the run back to a fresh start")
    assert "Traceback" not in p.output

    p = start(run_dir, 1_000_000, config, *gcs, "--allow-rollback", "--stop-at-step", "5", env=env)
    assert p.wait() == 75, p.output[-4000:]
    p.seen(rf"event=rollback step={newest} to=None allowed=1")


def test_a_planted_checkpoint_at_a_step_the_ledger_recorded_never_hides_a_rollback(tmp_path: Path,
                                                                                   gcs_emulator) -> None:
    """The run's ledger (its own disk) recorded step 20 durable in the bucket; a bucket writer
    deletes the run's checkpoints and copies another run's step 20 in their place (the run's disk
    lost its checkpoint folders too). The planted step 20 is set aside, and it does not count as
    the run's step 20 being there: the rollback guard refuses the fresh start (exit 2)."""
    config = write_config(tmp_path)
    env = trainer_env(**gcs_emulator.env)
    other_uri = gcs_emulator.uri + "-other"
    assert start(tmp_path / "other", STEPS, config, "--gcs-uri", other_uri, "--checkpoint-every-steps", "10",
                 "--stop-at-step", "20", env=env).wait() == 75
    run_dir, gcs = tmp_path / "run", ("--gcs-uri", gcs_emulator.uri, "--checkpoint-every-steps", "10")
    assert start(run_dir, STEPS, config, *gcs, "--stop-at-step", "20", env=env).wait() == 75
    assert 20 in _recorded_in_bucket(run_dir)
    for folder in run_dir.glob("step-*"):
        shutil.rmtree(folder)
    bucket_name, _, prefix = gcs_emulator.uri[len("gs://"):].partition("/")
    for blob in gcs_emulator.client.list_blobs(bucket_name, prefix=f"{prefix}/step-"):
        blob.delete()
    _copy_step(gcs_emulator.client, other_uri, gcs_emulator.uri, 20)

    p = start(run_dir, STEPS, config, *gcs, env=env)
    assert p.wait() == 2, p.output[-4000:]
    p.seen(r"setting aside checkpoints \(saved_before=1\): this run saved before")
    p.seen(r"cannot resume: this run's ledger \(\S+ledger\.jsonl\) records step 20 durable in the bucket "
           r".* resuming would roll the run back to a fresh start")
    assert "step-00000020/manifest.json" in bucket_names(gcs_emulator.client, gcs_emulator.uri)
