"""TensorBoard curves across a crash, a preemption and a lost disk: the bucket's event files
show the whole run once, exactly the curve of an uninterrupted run."""
from __future__ import annotations

import shutil
import signal
from pathlib import Path

from tests.trainer.support import REFERENCE_STEPS as STEPS
from tests.trainer.support import GATE_TASK, gated, open_gate_on_notice, run_to_end, start, status, trainer_env, write_config


def scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(logdir))
    ea.Reload()
    return {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


def test_curves_continue_across_crash_preemption_and_lost_disk(tmp_path: Path, gcs_emulator) -> None:
    # The gate task parks the loop after 27 steps while the flag exists: a crash at a known step.
    config = write_config(tmp_path, f'task = "{GATE_TASK}"\nmetrics_upload_every_s = 0.2\n'
                                    "eval_every_steps = 10\neval_batches = 2\n")
    gcs = ("--gcs-uri", gcs_emulator.uri, "--checkpoint-every-steps", "10")
    ref_dir, run_dir, flag = tmp_path / "ref", tmp_path / "run", tmp_path / "gate"
    run_to_end(ref_dir, STEPS, config)
    env = trainer_env(**gcs_emulator.env)

    p = start(run_dir, STEPS, config, *gcs, env=gated(flag, 27, env))
    p.wait_for(r"event=step step=27/")
    # A checkpoint on the disk before the crash. Step 10's, the first: the one at 20 may be deferred
    # past the parked step 27 while step 10's disk write still runs (steps take milliseconds here,
    # a loaded disk's fsyncs longer), and then never comes. The restore below takes the newest.
    p.seen_or_wait(r"checkpoint step 10 durable on persistent")  # the save is asynchronous
    p.signal(signal.SIGKILL)  # a crash: the steps after the newest checkpoint are lost
    p.wait()
    flag.unlink()

    newest = status(run_dir, "--gcs-uri", gcs_emulator.uri, env=env, cli=True)["latest_step"]
    assert 10 <= newest < 27
    # A preemption, then the disk is gone; held at step 33 only if this test reads the log late.
    p = start(run_dir, STEPS, config, *gcs, env=gated(flag, 33 - newest, env))
    restored = int(p.wait_for(r"event=restore step=(\d+)").group(1))
    assert restored == newest
    p.wait_for(rf"event=metrics_superseded file=\S+ after_step={restored}")
    p.wait_for(r"event=eval step=30 loss=\d+\.\d+ batches=2")
    p.signal(signal.SIGTERM)
    open_gate_on_notice(p, flag)
    assert p.wait() == 75, p.output[-3000:]
    assert "event=metrics_upload ok=0" not in p.output
    shutil.rmtree(run_dir)

    run_to_end(run_dir, STEPS, config, *gcs, env=env)
    assert status(run_dir)["model_digest"] == status(ref_dir)["model_digest"]

    bucket = tmp_path / "bucket"
    bucket.mkdir()
    name, prefix = gcs_emulator.uri.removeprefix("gs://").split("/", 1)
    for blob in gcs_emulator.client.list_blobs(name, prefix=f"{prefix}/tensorboard/"):
        blob.download_to_filename(bucket / blob.name.rsplit("/", 1)[1])
    assert len(list(bucket.iterdir())) == 3  # one event file per session
    ref = scalars(ref_dir / "tensorboard")
    assert [s for s, _ in ref["train/loss"]] == list(range(1, STEPS + 1))
    for logdir in (bucket, run_dir / "tensorboard"):
        got = scalars(logdir)
        assert got["train/loss"] == ref["train/loss"]  # every step once, the uninterrupted values
        assert got["eval/loss"] == ref["eval/loss"] and [s for s, _ in got["eval/loss"]] == [10, 20, 30, 40]
        assert [s for s, _ in got["lr"]] == [s for s, _ in got["throughput/steps_per_s"]] == list(range(1, STEPS + 1))
        assert got["goodput/goodput"] and all(0 < v <= 1 for _, v in got["goodput/goodput"])


def test_the_tasks_own_metrics_reach_the_log_line_tensorboard_and_a_sink_and_change_no_weight(
        tmp_path: Path, reference: dict) -> None:
    """A loss_fn returning (loss, {name: value}): its metrics ride the event seam (the step line,
    TensorBoard's train/NAME and eval/NAME, a [sinks.jsonl] file), and a run preempted and
    resumed with them ends at the plain task's uninterrupted weights."""
    import json
    import math

    events = tmp_path / "events.jsonl"
    config = write_config(tmp_path, 'task = "tests.trainer.e2e.metrics_task:build"\n'
                                    "eval_every_steps = 20\neval_batches = 2\n"
                                    f'[sinks.jsonl]\npath = "{events}"\n')
    run_dir = tmp_path / "run"
    gate = tmp_path / "gate"  # held at step 18 only if this test reads the log late
    p = start(run_dir, STEPS, config, "--checkpoint-every-steps", "10", env=gated(gate, 18))
    line = p.wait_for(r"event=step step=13/\S+ loss=(\S+) .* eta_s=\S+ ppl=(\S+) tokens=(\S+)$")
    assert float(line.group(2)) == float(f"{math.exp(float(line.group(1))):.4g}")  # one step per line here
    p.signal(signal.SIGTERM)
    open_gate_on_notice(p, gate)
    assert p.wait() == 75, p.output[-3000:]
    p = run_to_end(run_dir, STEPS, config, "--checkpoint-every-steps", "10")
    assert "ppl=" in p.wait_for(rf"event=step step={STEPS}/").string
    assert status(run_dir)["model_digest"] == reference["model_digest"]  # the metrics changed nothing

    got = scalars(run_dir / "tensorboard")
    assert [s for s, _ in got["train/ppl"]] == list(range(1, STEPS + 1))
    assert all(v == 4 * 32 for _, v in got["train/tokens"])  # batch_size 4 x block_size 32
    assert [s for s, _ in got["eval/ppl"]] == [20, 40] and [s for s, _ in got["eval/loss"]] == [20, 40]

    lines = [json.loads(x) for x in events.read_text().splitlines()]
    steps = [e for e in lines if e["event"] == "Step"]
    assert steps and all(set(e["metrics"]) == {"ppl", "tokens"} for e in steps)
    assert [e["event"] for e in lines if e["event"] in ("preempted", "finished")] == ["preempted", "finished"]
