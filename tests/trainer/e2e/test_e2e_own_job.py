"""Issue 10, the trainer's side, end to end with the real trainer and gcp-storage-emulator: a
finished run extended, a new run seeded from another one (a run dir and a gs:// URI, weights
only and with the optimizer, both layouts), the weights exported and loaded with `strict=True`
into the user's own model class (tied weights), a finished run's own export in GCS, artifacts in
GCS and back on a blank disk, and a busy health port as bad input.

The task is `own_task` (a tiny GPT with nanoGPT's tied head). With `lr = 0` training changes no
weight, so a run seeded with `--init-from` must end at the source's exact digest: that is how
these tests see that the weights were loaded, bit for bit.
"""
from __future__ import annotations

import json
import math
import re
import shutil
import socket
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.trainer.support import Proc, Zygote, run_args, status, trainer_env
from trainer.checkpoint.format import tensor_digest
from trainer.cli import main as cli
from trainer.checkpoint.reader import read

TASK = "tests.trainer.e2e.own_task:build"


def config(dir: Path, name: str = "own", **task_args: object) -> Path:
    dir.mkdir(parents=True, exist_ok=True)
    args = "\n".join(f"{k} = {json.dumps(v)}" for k, v in task_args.items())
    path = dir / f"{name}.toml"
    path.write_text(f'task = "{TASK}"\nbatch_size = 4\nlog_every_steps = 1\nprogress_every_s = 0.5\n'
                    f"[task_args]\n{args}\n")
    return path


def run(zygote: Zygote, run_dir: Path, steps: int, cfg: Path, *extra: str, rc: int = 0,
        env: dict[str, str] | None = None) -> Proc:
    p = zygote.spawn(run_args(run_dir, steps, cfg, *extra)[3:], env or trainer_env())
    got = p.wait()
    assert got == rc, p.output[-4000:]
    assert "Traceback" not in p.output, p.output[-4000:]
    return p


def model_class(vocab: int, n_embd: int = 16) -> torch.nn.Module:
    from tests.trainer.e2e.own_task import TiedGPT

    return TiedGPT(vocab, 16, n_embd)


def load_export(path: Path) -> tuple[torch.nn.Module, dict]:
    """The user's side: a freshly built model, the file loaded with strict=True; and the sidecar."""
    weights = load_file(str(path))
    model = model_class(weights["wte.weight"].shape[0])
    model.load_state_dict(weights, strict=True)
    assert model.lm_head.weight is model.wte.weight
    return model, json.loads(path.with_suffix(".json").read_text())


def adam_steps(optimizer_state: dict) -> set[int]:
    return {int(s["step"]) for s in optimizer_state["state"].values()}


# ------------------------------------------------------------------------------------------------
# Extending a run
# ------------------------------------------------------------------------------------------------


def test_a_finished_run_extended_resumes_from_its_step_and_ends_as_the_longer_run(tmp_path: Path,
                                                                                  zygote: Zygote) -> None:
    """With a schedule that does not depend on the total (constant), 20 steps extended to 30 are
    the 30-step run, bit for bit: the run resumes from 20, not 0, and the task sees 30."""
    cfg = config(tmp_path, schedule="constant")
    run(zygote, tmp_path / "ref", 30, cfg)
    run(zygote, tmp_path / "run", 20, cfg)
    refused = run(zygote, tmp_path / "run", 30, cfg, rc=2)
    assert "steps: checkpoint has 20, this run has 30; to continue this run to 30 steps, say so with " \
           "--extend-steps" in refused.output
    p = run(zygote, tmp_path / "run", 30, cfg, "--extend-steps")
    assert p.seen(r"event=start steps=30 .* ctx_steps=30 ")
    assert p.seen(r"event=steps_changed step=20 from=20 to=30")
    assert p.seen(r"event=restore step=20 tier=persistent")
    assert not [x for x in p.lines if re.search(r"event=step step=(1?\d|20)/", x)]  # none trained again
    s = status(tmp_path / "run")
    assert s["latest_step"] == 30 and s["fingerprint"]["steps"] == 30
    assert s["model_digest"] == status(tmp_path / "ref")["model_digest"]
    assert [(h["event"], h["step"], h["from"], h["to"]) for h in s["history"]] == [("steps_changed", 20, 20, 30)]
    assert s["stopped"] is None and s["goodput"]["finished"]
    run(zygote, tmp_path / "run", 30, cfg).seen(r"event=finished step=30 \(already complete\)")


def test_an_extended_schedule_over_ctx_steps_runs_on_over_the_new_total(tmp_path: Path, zygote: Zygote) -> None:
    cfg = config(tmp_path, schedule="cosine", warmup_steps=2)
    run(zygote, tmp_path / "run", 6, cfg)
    p = run(zygote, tmp_path / "run", 9, cfg, "--extend-steps")
    logged = float(p.seen(r"event=step step=7/9 \S+ lr=(\S+)").group(1))
    factor_9 = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (7 - 2) / (9 - 2)))  # own_task's cosine over 9
    assert logged == pytest.approx(3e-3 * factor_9, rel=1e-3)


# ------------------------------------------------------------------------------------------------
# A whole-model (DDP layout) source: --init-from, export, the finished run's export, artifacts
# ------------------------------------------------------------------------------------------------


def test_init_from_export_and_artifacts_of_a_run_with_gcs(tmp_path: Path, zygote: Zygote, gcs_emulator) -> None:
    env = trainer_env(**gcs_emulator.env)
    src, uri = tmp_path / "src", gcs_emulator.uri
    cfg = config(tmp_path, schedule="constant", artifacts_every=3)
    first = run(zygote, src, 8, cfg, "--gcs-uri", uri, env=env)
    source = status(src, "--gcs-uri", uri)
    digest = source["model_digest"]

    # The finished run exported itself to GCS, once.
    bucket = gcs_emulator.client.bucket(uri.split("/")[2])
    prefix = uri.split("/", 3)[3]

    def names(sub: str) -> list[str]:
        return sorted(b.name[len(prefix) + 1:] for b in bucket.list_blobs(prefix=f"{prefix}/{sub}"))

    assert names("export/") == ["export/step-00000008/model.json", "export/step-00000008/model.safetensors"]
    assert first.seen(rf"event=export step=8 at={re.escape(uri)}/export/step-00000008 digest={digest}")
    side = json.loads(bucket.blob(f"{prefix}/export/step-00000008/model.json").download_as_bytes())
    assert side["digest"] == digest and side["step"] == 8 and side["task"] == TASK
    # The task's artifacts reached GCS.
    assert names("artifacts/") == ["artifacts/samples/call-0003.txt", "artifacts/samples/call-0006.txt",
                                   "artifacts/vocab.txt"]

    # Weights only, from the run dir: lr = 0 keeps them, so the new run ends at the source's digest.
    frozen = config(tmp_path, "frozen", schedule="constant", lr=0.0)
    p = run(zygote, tmp_path / "new", 2, frozen, "--init-from", str(src))
    assert p.seen(rf"event=init_from source={re.escape(str(src))} step=8 location={re.escape(str(src))}/"
                  rf"step-00000008 layout=whole-model optimizer=0 digest={digest}")
    p.seen(r"event=restore step=0 \(no checkpoint: starting from init_from's weights\)")
    new = status(tmp_path / "new")
    assert new["model_digest"] == digest
    assert new["fingerprint"]["init_from"]["location"] == f"{src}/step-00000008"
    assert [h["event"] for h in new["history"]] == ["init_from"]
    assert adam_steps(read(run_dir=tmp_path / "new", gcs_uri=None).state["optimizer"]) == {2}  # a fresh one

    # Weights and optimizer, from the gs:// URI (the run dir is not even there).
    shutil.move(src, tmp_path / "src-moved")
    p = run(zygote, tmp_path / "new-opt", 2, frozen, "--init-from", uri, "--init-from-optimizer", env=env)
    assert p.seen(r"event=init_from .* layout=whole-model optimizer=1 ")
    assert status(tmp_path / "new-opt")["model_digest"] == digest
    assert adam_steps(read(run_dir=tmp_path / "new-opt", gcs_uri=None).state["optimizer"]) == {8 + 2}  # the source's moments went on
    # Once the run has a checkpoint of its own, it resumes from it; init_from is not applied again.
    again = run(zygote, tmp_path / "new-opt", 4, frozen, "--extend-steps", "--init-from", uri, env=env)
    assert again.seen(r"event=init_from skipped=1") and again.seen(r"event=restore step=2 tier=persistent")

    # A model that does not fit is bad input, said once, with the reason in SPOTTRAIN_BAD_INPUT_FILE.
    reason = tmp_path / "bad-input"
    narrow = config(tmp_path, "narrow", n_embd=8)
    p = run(zygote, tmp_path / "narrow", 2, narrow, "--init-from", uri, rc=2,
            env={**env, "SPOTTRAIN_BAD_INPUT_FILE": str(reason)})
    assert "size mismatch for wte.weight" in reason.read_text() and reason.read_text().startswith("init_from: the model of ")
    assert not (tmp_path / "narrow" / "step-00000002").exists()

    # Export by hand from GCS alone: the user's model class, strict=True, the digest of status.
    out = tmp_path / "export" / "model.safetensors"
    out.parent.mkdir()
    assert cli(["export", "--gcs-uri", uri, "--out", str(out)]) == 0
    model, side = load_export(out)
    assert tensor_digest(model.state_dict()) == side["digest"] == digest

    # Another experiment seeds from those weights: its checkpoints are signed with a key of its own,
    # so it takes the exported file (tensors and a JSON header, no code, no key needed), as a path
    # or from the bucket; weights only.
    other_key = tmp_path / "other.key"
    other_key.write_bytes(b"k" * 32)
    other_key.chmod(0o600)
    other = {**env, "SPOTTRAIN_CHECKPOINT_KEY_FILE": str(other_key)}
    refused = run(zygote, tmp_path / "other-run", 2, frozen, "--init-from", uri, rc=2, env=other)
    assert "init_from: " in refused.output
    gs_file = f"{uri}/export/step-00000008/model.safetensors"
    for source in (str(out), gs_file):
        name = "from-path" if source == str(out) else "from-gcs"
        p = run(zygote, tmp_path / name, 2, frozen, "--init-from", source, env=other)
        assert p.seen(rf"event=init_from source={re.escape(source)} step=0 location={re.escape(source)} "
                      rf"layout=weights-file optimizer=0 digest={digest}")
        assert p.seen(rf"event=export step=2 at=\S+ digest={digest}")  # lr = 0: the weights it was given
    p = run(zygote, tmp_path / "file-opt", 2, frozen, "--init-from", str(out), "--init-from-optimizer", rc=2,
            env=other)
    assert "init_from_optimizer: " + str(out) + " holds weights only" in p.output
    for missing in (str(tmp_path / "none.safetensors"), f"{uri}/export/none.safetensors"):
        p = run(zygote, tmp_path / "missing-file", 2, frozen, "--init-from", missing, rc=2, env=other)
        assert f"init_from: {missing}: no such file" in p.output
    (tmp_path / "not-weights.safetensors").write_bytes(b"{not a header")
    p = run(zygote, tmp_path / "bad-file", 2, frozen, "--init-from", str(tmp_path / "not-weights.safetensors"),
            rc=2, env=other)
    assert "is not a safetensors file" in p.output

    # A blank disk: the finished run restores from GCS, does not export again, gets its artifacts back.
    again = run(zygote, src, 8, cfg, "--gcs-uri", uri, env=env)
    assert again.seen(r"event=restore step=8 tier=gcs") and again.seen(r"event=export step=8 already=1")
    assert names("export/") == ["export/step-00000008/model.json", "export/step-00000008/model.safetensors"]
    back = sorted(str(p.relative_to(src / "artifacts")) for p in (src / "artifacts").rglob("*") if p.is_file())
    assert back == ["samples/call-0003.txt", "samples/call-0006.txt", "vocab.txt"]
    assert (src / "artifacts" / "vocab.txt").read_text() == (tmp_path / "src-moved" / "artifacts" / "vocab.txt").read_text()


# ------------------------------------------------------------------------------------------------
# A sharded (FSDP) source written at world size 2
# ------------------------------------------------------------------------------------------------


@pytest.mark.xdist_group("torchrun")
def test_a_sharded_run_exports_and_seeds_runs_of_either_layout(tmp_path: Path, zygote: Zygote) -> None:
    src = tmp_path / "src"
    fsdp = config(tmp_path, "fsdp", schedule="constant")
    fsdp.write_text(fsdp.read_text().replace("[task_args]", 'parallelism = "fsdp"\nglobal_batch_size = 8\n[task_args]'))
    p = Proc([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
              *run_args(src, 6, fsdp)[2:]], new_session=True)
    assert p.wait() == 0, p.output[-4000:]
    s = status(src)
    assert s["sharded"] and s["latest_step"] == 6
    digest = s["model_digest"]

    # Export: the shards of both ranks gathered into full tensors.
    out = tmp_path / "fsdp.safetensors"
    assert cli(["export", "--run-dir", str(src), "--out", str(out)]) == 0
    model, side = load_export(out)
    assert tensor_digest(model.state_dict()) == side["digest"] == digest and side["layout"] == "sharded"
    local = src / "export" / "step-00000006" / "model.safetensors"  # the run's own export (no GCS)
    assert tensor_digest(load_export(local)[0].state_dict()) == digest

    # Into an FSDP run at world size 1 (resharded), weights and optimizer.
    frozen = fsdp.parent / "frozen.toml"
    frozen.write_text(fsdp.read_text().replace("[task_args]", "[task_args]\nlr = 0.0"))
    p = run(zygote, tmp_path / "to-fsdp", 2, frozen, "--init-from", str(src), "--init-from-optimizer")
    assert p.seen(r"event=init_from .* layout=sharded optimizer=1 ")
    assert status(tmp_path / "to-fsdp")["model_digest"] == digest
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(tmp_path / "to-fsdp" / "step-00000002"), str(tmp_path / "full.pt"))
    full = torch.load(tmp_path / "full.pt", weights_only=False)
    assert adam_steps(full["optim"]) == {6 + 2}

    # Into a DDP run: the weights move between layouts, the optimizer state does not.
    ddp = config(tmp_path, "ddp", schedule="constant", lr=0.0)
    run(zygote, tmp_path / "to-ddp", 2, ddp, "--init-from", str(src))
    assert status(tmp_path / "to-ddp")["model_digest"] == digest
    refused = run(zygote, tmp_path / "to-ddp-opt", 2, ddp, "--init-from", str(src), "--init-from-optimizer", rc=2)
    assert 'init_from_optimizer: the source was trained with parallelism = "fsdp" and this run has "ddp"' \
        in refused.output
    # And back: that DDP run's whole-model checkpoint into an FSDP run.
    p = run(zygote, tmp_path / "back-to-fsdp", 2, frozen, "--init-from", str(tmp_path / "to-ddp"))
    assert p.seen(r"event=init_from .* layout=whole-model optimizer=0 ")
    assert status(tmp_path / "back-to-fsdp")["model_digest"] == digest
    # And the exported weights file into an FSDP run: scattered into the shards like a whole model.
    p = run(zygote, tmp_path / "file-to-fsdp", 2, frozen, "--init-from", str(out))
    assert p.seen(r"event=init_from .* layout=weights-file optimizer=0 ")
    assert status(tmp_path / "file-to-fsdp")["model_digest"] == digest


# ------------------------------------------------------------------------------------------------
# A second run on a busy health port
# ------------------------------------------------------------------------------------------------


def test_a_busy_health_port_is_bad_input_naming_port_and_holder(tmp_path: Path, zygote: Zygote) -> None:
    import os

    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        port = held.getsockname()[1]
        argv = run_args(tmp_path / "run", 2, config(tmp_path))[3:]
        argv[argv.index("--health-port") + 1] = str(port)
        p = zygote.spawn(argv, trainer_env())
        assert p.wait() == 2, p.output[-3000:]
    assert "Traceback" not in p.output
    assert p.seen(rf"event=failed reason=bad_input health_port: port {port} on 0.0.0.0 is already in use by pid "
                  rf"{os.getpid()} \(")
