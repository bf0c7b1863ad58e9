"""Any job survives preemption exactly (issue 29), end to end with the real trainer, real signals
and torchrun: the project's examples (a DCGAN with its own step and two optimizers, a diffusion
denoiser with an EMA fed by webdataset shards through data workers, a pytorch/examples script that
keeps its own loop) resume bit for bit through SIGTERM, SIGKILL and restarts, on one process and
on two ranks, and export every model by name; the ports that would lose state silently are
refused with exit 2 before anything is saved."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from tests.trainer.e2e.job_support import EXAMPLES, STEPS, config, digests, interrupted, trainer
from tests.trainer.support import status
from trainer import EXIT_BAD_INPUT, EXIT_PREEMPTED


def test_a_gan_with_its_own_step_and_two_optimizers_resumes_bit_for_bit(tmp_path: Path) -> None:
    code = (EXAMPLES / "gan",)
    cfg = config(tmp_path, 'task = "dcgan:build"\nbatch_size = 8\n[task_args]\nblocks = 2\n')
    ref = trainer(tmp_path / "ref", cfg, code=code)
    assert ref.wait() == 0, ref.output[-4000:]
    interrupted(tmp_path / "run", cfg, code=code)
    want = digests(tmp_path / "ref", STEPS)
    assert set(want) >= {"model", "optimizer", "states.D", "states.opt_d", "data"}
    assert digests(tmp_path / "run", STEPS) == want  # both networks and both Adams, bit for bit
    # Each model by name, loadable by the user's own classes.
    sys.path.insert(0, str(EXAMPLES / "gan"))
    try:
        import dcgan
    finally:
        sys.path.remove(str(EXAMPLES / "gan"))
    export = tmp_path / "run" / "export" / f"step-{STEPS:08d}"
    dcgan.Generator(blocks=2).load_state_dict(load_file(export / "model.safetensors"), strict=True)
    dcgan.Discriminator(blocks=2).load_state_dict(load_file(export / "model-D.safetensors"), strict=True)


def test_an_ema_fed_by_streaming_shards_through_workers_resumes_bit_for_bit(tmp_path: Path) -> None:
    sys.path.insert(0, str(EXAMPLES / "diffusion"))
    try:
        import denoiser
        import shards
    finally:
        sys.path.remove(str(EXAMPLES / "diffusion"))
    shards.write(tmp_path / "shards", shards=4, per_shard=24)  # 12 batches an epoch: the run crosses one
    code = (EXAMPLES / "diffusion",)
    cfg = config(tmp_path, f'task = "denoiser:build"\nbatch_size = 8\ndata_workers = 2\n[task_args]\n'
                           f'shards_dir = "{tmp_path / "shards"}"\n')
    ref = trainer(tmp_path / "ref", cfg, code=code)
    assert ref.wait() == 0, ref.output[-4000:]
    interrupted(tmp_path / "run", cfg, code=code)
    want = digests(tmp_path / "ref", STEPS)
    assert {"states.ema", "rank_states.0"} <= set(want)
    assert digests(tmp_path / "run", STEPS) == want  # the EMA did not restart; the stream's position held
    ema = load_file(tmp_path / "run" / "export" / f"step-{STEPS:08d}" / "model-ema.safetensors")
    denoiser.UNet().load_state_dict(ema, strict=True)  # the EMA is the model one ships


def test_shards_streamed_from_the_bucket_through_faults_resume_bit_for_bit_as_from_a_local_copy(
        tmp_path: Path, gcs_proxy: Any) -> None:
    """No local copy: the shards are read from the (emulated) bucket by two data workers, through a
    503 and a connection reset mid-shard, SIGTERM and SIGKILL; the run ends where a run from the
    local directory ends, bit for bit."""
    sys.path.insert(0, str(EXAMPLES / "diffusion"))
    try:
        import shards
    finally:
        sys.path.remove(str(EXAMPLES / "diffusion"))
    files = shards.write(tmp_path / "shards", shards=4, per_shard=24)  # 12 batches an epoch; ~37 KB a shard
    bucket = gcs_proxy.client(direct=True).bucket(gcs_proxy.bucket)
    for f in files:
        bucket.blob(f"diffusion/{f.name}").upload_from_filename(str(f))
    code = (EXAMPLES / "diffusion",)
    head = 'task = "denoiser:build"\nbatch_size = 8\ndata_workers = 2\n'
    local = config(tmp_path, head + f'[task_args]\nshards_dir = "{tmp_path / "shards"}"\n')
    ref = trainer(tmp_path / "ref", local, code=code)
    assert ref.wait() == 0, ref.output[-4000:]
    (tmp_path / "bucket").mkdir()
    url = f"gs://{gcs_proxy.bucket}/diffusion/shard-{{000000..000003}}.tar"
    # data_url as the VM passes [data] stream's source (--data-url): the task's ctx.data_url
    streamed = config(tmp_path / "bucket", head + f'data_url = "{url}"\n[task_args]\nread_chunk_bytes = 8192\n')
    media = r"alt=media.* object=diffusion/shard-00000{}\.tar$"
    fail = gcs_proxy.proxy.add("GET", media.format(1), "status", status=503, after=2)  # shard 1's 3rd read
    reset = gcs_proxy.proxy.add("GET", media.format(2), "drop", after=1)  # shard 2's 2nd read
    interrupted(tmp_path / "run", streamed, code=code)
    assert (fail.hits, reset.hits) == (1, 1)
    assert digests(tmp_path / "run", STEPS) == digests(tmp_path / "ref", STEPS)
    assert not list((tmp_path / "run").rglob("*.tar"))  # read, never copied


def test_a_shard_missing_from_the_bucket_is_one_line_before_training(tmp_path: Path, gcs_proxy: Any) -> None:
    sys.path.insert(0, str(EXAMPLES / "diffusion"))
    try:
        import shards
    finally:
        sys.path.remove(str(EXAMPLES / "diffusion"))
    bucket = gcs_proxy.client(direct=True).bucket(gcs_proxy.bucket)
    for f in shards.write(tmp_path / "shards", shards=2, per_shard=8):
        bucket.blob(f"d/{f.name}").upload_from_filename(str(f))
    url = f"gs://{gcs_proxy.bucket}/d/shard-{{000000..000002}}.tar"
    cfg = config(tmp_path, f'task = "denoiser:build"\nbatch_size = 8\n[task_args]\ndata_url = "{url}"\n')
    p = trainer(tmp_path / "run", cfg, code=(EXAMPLES / "diffusion",))
    assert p.wait() == EXIT_BAD_INPUT, p.output[-3000:]
    assert p.seen(rf"event=failed reason=bad_input data URL: 1 of 3 shards missing in gs://{gcs_proxy.bucket}/d/: "
                  rf"gs://{gcs_proxy.bucket}/d/shard-000002\.tar$")
    assert not list((tmp_path / "run").glob("step-*"))


def test_a_stream_refuses_another_split_over_workers(tmp_path: Path) -> None:
    sys.path.insert(0, str(EXAMPLES / "diffusion"))
    try:
        import shards
    finally:
        sys.path.remove(str(EXAMPLES / "diffusion"))
    shards.write(tmp_path / "shards", shards=2, per_shard=16)
    code = (EXAMPLES / "diffusion",)
    cfg = config(tmp_path, f'task = "denoiser:build"\nbatch_size = 8\n[task_args]\nshards_dir = "{tmp_path / "shards"}"\n')
    p = trainer(tmp_path / "run", cfg, "--stop-at-step", "3", code=code)
    assert p.wait() == EXIT_PREEMPTED, p.output[-3000:]
    p = trainer(tmp_path / "run", cfg, "--data-workers", "2", code=code)
    assert p.wait() == EXIT_BAD_INPUT
    assert p.seen(r"cannot resume: .*stream_workers: checkpoint has 0, this run has 2")


def test_a_script_that_keeps_its_own_loop_resumes_bit_for_bit(tmp_path: Path) -> None:
    script = ("--script", str(EXAMPLES / "own_loop" / "train.py"), "--script-arg=--samples",
              "--script-arg=256", "--script-arg=--batch-size", "--script-arg=16")
    cfg = config(tmp_path, "")
    ref = trainer(tmp_path / "ref", cfg, *script)
    assert ref.wait() == 0, ref.output[-4000:]
    p = interrupted(tmp_path / "run", cfg, *script)
    assert p.seen(r"event=start .* script=.*own_loop/train.py")
    assert digests(tmp_path / "run", STEPS) == digests(tmp_path / "ref", STEPS)  # model, Adadelta, StepLR, data
    assert status(tmp_path / "run")["model_digest"] == status(tmp_path / "ref")["model_digest"]


def test_code_after_an_own_loop_runs_for_a_finished_run_only(tmp_path: Path) -> None:
    after = tmp_path / "after.txt"
    script = ("--script", "tests/trainer/e2e/own_loop_script.py", f"--script-arg=--after={after}")
    cfg = config(tmp_path, "batch_size = 8\n")
    p = trainer(tmp_path / "run", cfg, *script, "--stop-at-step", "6")
    assert p.wait() == EXIT_PREEMPTED  # a pause leaves the loop with SystemExit(75): nothing after it ran
    assert not after.exists()
    p = trainer(tmp_path / "run", cfg, *script)
    assert p.wait() == 0, p.output[-3000:]
    assert after.read_text() == f"finished at {STEPS}\n"
    assert p.seen(r"event=step step=16/16 .* grad_free=")  # the script's own metric, in the step line


@pytest.mark.parametrize("kind, why", [
    ("optimizer_in_loss_fn", r"an optimizer SGD over 2 parameter tensors stepped, but the job never declared it"),
    ("ema_hook", r"the first step changed state the job never declared \(.*(AveragedModel|Sequential)"),
    ("optimizer_list", r"Task.optimizer = list, expected one torch.optim.Optimizer \(more optimizers: name them"),
    ("not_stateful", r"states\['noise'\]: a NoState has no state_dict\(\)/load_state_dict\(\)"),
    ("loader_as_dataset", r"Task.dataset = DataLoader, expected the dataset itself"),
])
def test_a_port_that_would_lose_state_silently_is_refused_before_anything_is_saved(
        tmp_path: Path, kind: str, why: str) -> None:
    cfg = config(tmp_path, f'task = "tests.trainer.e2e.undeclared_task:build"\nbatch_size = 4\n'
                           f'[task_args]\nkind = "{kind}"\n')
    p = trainer(tmp_path / "run", cfg)
    assert p.wait() == EXIT_BAD_INPUT, p.output[-3000:]
    assert p.seen(r"event=failed reason=bad_input .*" + why)
    assert not list((tmp_path / "run").glob("step-*"))  # no checkpoint of a run that would resume wrong


def test_an_own_loop_iterating_a_plain_dataloader_is_refused(tmp_path: Path) -> None:
    p = trainer(tmp_path / "run", config(tmp_path, ""), "--script", "tests/trainer/e2e/own_loop_script.py",
                "--script-arg=--plain-loader")
    assert p.wait() == EXIT_BAD_INPUT, p.output[-3000:]
    assert p.seen(r"event=failed reason=bad_input the first step left a torch DataLoader iterating")
    assert not list((tmp_path / "run").glob("step-*"))


def test_a_gan_on_two_ranks_resumes_bit_for_bit_and_its_ranks_stay_identical(tmp_path: Path) -> None:
    code = (EXAMPLES / "gan",)
    # 20 extra layers a network: 659 tensors of state sent to rank 1, the size at which pickled views once cost GBs.
    cfg = config(tmp_path, 'task = "dcgan:build"\nbatch_size = 4\n[task_args]\nblocks = 20\nngf = 8\nndf = 8\n')
    ref = trainer(tmp_path / "ref", cfg, code=code, torchrun=2)
    assert ref.wait() == 0, ref.output[-4000:]
    p = interrupted(tmp_path / "run", cfg, code=code, torchrun=2)
    assert digests(tmp_path / "run", STEPS) == digests(tmp_path / "ref", STEPS)
    sent = p.seen(r"restore: step \d+ sent from rank 0 as (\d+) tensors")
    assert int(sent.group(1)) > 600
    # Every save compared the ranks' weights of both networks (a drift is exit 2): none was seen.
    assert "hold different weights" not in p.output


def test_an_own_loop_on_two_ranks_resumes_bit_for_bit(tmp_path: Path) -> None:
    script = ("--script", "tests/trainer/e2e/own_loop_script.py", "--script-arg=--layers", "--script-arg=200")
    cfg = config(tmp_path, "batch_size = 4\n")
    ref = trainer(tmp_path / "ref", cfg, *script, torchrun=2)
    assert ref.wait() == 0, ref.output[-4000:]
    interrupted(tmp_path / "run", cfg, *script, torchrun=2)
    assert digests(tmp_path / "run", STEPS) == digests(tmp_path / "ref", STEPS)


@pytest.mark.parametrize("port", ["task", "script"])
def test_a_model_trained_outside_ddp_on_two_ranks_is_refused(tmp_path: Path, port: str) -> None:
    if port == "task":  # the step unwraps the DDP model: the ranks drift, found at the first save
        cfg = config(tmp_path, 'task = "tests.trainer.e2e.undeclared_task:build"\nbatch_size = 4\n'
                               '[task_args]\nkind = "unwrapped_step"\n')
        p = trainer(tmp_path / "run", cfg, torchrun=2)
        want = r"after step 4 the ranks hold different weights of model"
    else:  # the script never wrapped it
        p = trainer(tmp_path / "run", config(tmp_path, ""), "--script", "tests/trainer/e2e/own_loop_script.py",
                    "--script-arg=--unwrapped", torchrun=2)
        want = r"on 2 ranks model must train under DDP"
    assert p.wait() != 0
    assert p.seen(r"event=failed reason=bad_input .*" + want)
    assert not list((tmp_path / "run").glob("step-*"))


def test_an_ema_on_shards_split_over_two_ranks_and_their_workers_resumes_bit_for_bit(
        tmp_path: Path, gcs_emulator: Any) -> None:
    """2 ranks x 2 data workers: the run reads its shards from the (emulated) bucket through SIGTERM,
    SIGKILL and a restart, and ends where the uninterrupted run from a local copy ends."""
    sys.path.insert(0, str(EXAMPLES / "diffusion"))
    try:
        import shards
    finally:
        sys.path.remove(str(EXAMPLES / "diffusion"))
    files = shards.write(tmp_path / "shards", shards=8, per_shard=12)  # 2 ranks x 2 workers: 2 shards each
    bucket = gcs_emulator.client.bucket(gcs_emulator.emulator.bucket)
    for f in files:
        bucket.blob(f"diffusion/{f.name}").upload_from_filename(str(f))
    code = (EXAMPLES / "diffusion",)
    # 20 blocks a level: more than a thousand tensors of state with the EMA and AdamW's.
    head = 'task = "denoiser:build"\nbatch_size = 4\ndata_workers = 2\n'
    args = "[task_args]\nwidth = 8\nblocks = 20\n"
    local = config(tmp_path, head + args + f'shards_dir = "{tmp_path / "shards"}"\n')
    ref = trainer(tmp_path / "ref", local, code=code, torchrun=2)
    assert ref.wait() == 0, ref.output[-4000:]
    (tmp_path / "bucket").mkdir()
    url = f"gs://{gcs_emulator.emulator.bucket}/diffusion/shard-{{000000..000007}}.tar"
    streamed = config(tmp_path / "bucket", head + f'data_url = "{url}"\n' + args)
    interrupted(tmp_path / "run", streamed, code=code, torchrun=2)
    want = digests(tmp_path / "ref", STEPS)
    assert {"states.ema", "rank_states.0", "rank_states.1"} <= set(want)
    assert digests(tmp_path / "run", STEPS) == want
    assert not list((tmp_path / "run").rglob("*.tar"))  # read, never copied
