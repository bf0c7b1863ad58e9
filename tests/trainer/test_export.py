"""trainer/export.py and trainer/reader.py: a run's weights out as a plain state dict in
safetensors, loadable with `strict=True` into the user's own model class (tied weights
included), read through the verified path from a run dir or from GCS; bad input is exit 2."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from trainer.checkpoint.format import tensor_digest
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.checkpoint.tiers import tier_table
from trainer.cli import main
from trainer.export import plain_state_dict
from tests.trainer.support import REPO, run_key, trainer_env


class Tied(torch.nn.Module):
    """The shape of nanoGPT's GPT: the output head shares the token embedding's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(11, 4)
        self.ln = torch.nn.LayerNorm(4)
        self.lm_head = torch.nn.Linear(4, 11, bias=False)
        self.lm_head.weight = self.wte.weight


def saved_run(tmp_path: Path, *steps: int, gcs=None) -> tuple[Path, dict[int, dict]]:
    """A run dir (and GCS prefix) holding whole-model checkpoints as the trainer saves them."""
    run = tmp_path / "run"
    c = Checkpointer(tier_table(run, gcs_uri=gcs.uri if gcs else None, gcs_client=gcs.client if gcs else None),
                     key=run_key())  # signed, as the trainer's are
    models = {}
    for step in steps:
        torch.manual_seed(step)
        m = Tied()
        models[step] = m.state_dict()
        c.save(step, {"step": step, "model": m.state_dict(), "optimizer": {"state": {}, "param_groups": []},
                      "fingerprint": {"task": "mytask:build", "task_args": {"width": 4}, "parallelism": "ddp",
                                      "steps": 100, "seed": 0}},
               meta={"world_size": 1}, every_tier=True)
        c.wait()
    c.close()
    return run, models


def load_strict(path: Path) -> Tied:
    m = Tied()
    m.load_state_dict(load_file(str(path)), strict=True)
    return m


def test_plain_state_dict_drops_wrapper_names_and_shares_no_memory() -> None:
    m = Tied()
    wrapped = {f"module._orig_mod.{k}": v for k, v in m.state_dict().items()}
    wrapped["module.extra_state"] = {"not": "a tensor"}
    plain = plain_state_dict(wrapped)
    assert sorted(plain) == sorted(m.state_dict())
    assert plain["wte.weight"].data_ptr() != plain["lm_head.weight"].data_ptr()
    assert tensor_digest(plain) == tensor_digest(m.state_dict())


def test_export_from_a_run_dir_loads_strictly_into_the_model_class(tmp_path: Path, capsys) -> None:
    run, models = saved_run(tmp_path, 10, 20)
    out = tmp_path / "out" / "model.safetensors"
    out.parent.mkdir()
    assert main(["export", "--run-dir", str(run), "--out", str(out)]) == 0
    model = load_strict(out)
    assert model.lm_head.weight is model.wte.weight  # still tied after loading
    digest = tensor_digest(model.state_dict())
    assert digest == tensor_digest(models[20])
    side = json.loads((tmp_path / "out" / "model.json").read_text())
    assert (side["step"], side["task"], side["task_args"], side["digest"]) == (20, "mytask:build", {"width": 4}, digest)
    assert side["source"] == str(run / "step-00000020") and side["torch_version"] == torch.__version__
    # An older step on request; exporting the same checkpoint twice gives the same bytes.
    first = out.read_bytes()
    assert main(["export", "--run-dir", str(run), "--step", "10", "--out", str(out)]) == 0
    assert tensor_digest(load_strict(out).state_dict()) == tensor_digest(models[10])
    assert main(["export", "--run-dir", str(run), "--out", str(out)]) == 0
    assert out.read_bytes() == first


def test_export_from_gcs_alone(gcs_emulator, tmp_path: Path) -> None:
    _, models = saved_run(tmp_path, 5, gcs=gcs_emulator)
    out = tmp_path / "m.safetensors"
    assert main(["export", "--gcs-uri", gcs_emulator.uri, "--out", str(out)]) == 0
    side = json.loads((tmp_path / "m.json").read_text())
    assert side["source"] == f"{gcs_emulator.uri}/step-00000005" and side["tier"] == "gcs"
    assert tensor_digest(load_strict(out).state_dict()) == side["digest"] == tensor_digest(models[5])


def test_bad_input_is_exit_2_with_a_clear_message(tmp_path: Path, capsys, small_fs) -> None:
    run, _ = saved_run(tmp_path, 10)
    out = str(tmp_path / "m.safetensors")
    cases = [
        (["--run-dir", str(tmp_path / "nothing-here")], "run_dir: ", "is not a directory"),
        (["--run-dir", str(tmp_path)], "export: no valid checkpoint at ", ""),
        (["--run-dir", str(run), "--step", "7"], "no valid checkpoint of step 7 at ", "(valid: steps 10)"),
    ]
    for args, *needles in cases:
        assert main(["export", *args, "--out", out]) == 2
        err = capsys.readouterr().err
        assert all(n in err for n in needles), err
    assert main(["export", "--run-dir", str(run), "--out", str(tmp_path / "m.pt")]) == 2
    assert "out: " in capsys.readouterr().err
    ro = small_fs("ro", 1 << 20)
    ro.readonly()
    assert main(["export", "--run-dir", str(run), "--out", str(ro.path / "m.safetensors")]) == 2
    assert f"out: cannot write {ro.path / 'm.safetensors'}" in capsys.readouterr().err
    assert not (ro.path / "m.safetensors").exists()


def test_the_command_has_no_traceback(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "trainer", "export", "--run-dir", str(tmp_path), "--out",
                          str(tmp_path / "m.safetensors")], capture_output=True, text=True, env=trainer_env(),
                         cwd=REPO, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1] == f"export: no valid checkpoint at {tmp_path}"


def test_export_reads_only_what_the_key_authenticates(tmp_path: Path, capsys) -> None:
    run, _ = saved_run(tmp_path, 10)
    other = tmp_path / "another.key"
    other.write_bytes(b"a different key, not this run's!")
    other.chmod(0o600)
    out = str(tmp_path / "m.safetensors")
    assert main(["export", "--run-dir", str(run), "--out", out, "--checkpoint-key-file", str(other)]) == 2
    err = capsys.readouterr().err
    assert "no valid checkpoint at" in err and "never read: persistent step 10: unauthenticated: its manifest names" in err
    assert main(["export", "--run-dir", str(run), "--out", out, "--checkpoint-key-file", str(tmp_path / "nope")]) == 2
    assert "checkpoint_key_file: cannot read" in capsys.readouterr().err


def test_export_from_a_sharded_checkpoint_gathers_every_model_by_name(tmp_path: Path) -> None:
    """Issue 29: the other models of a sharded run (a discriminator with its optimizer, an EMA)
    lie in the shards, not in the extras; each is exported whole by name, loadable with
    ``strict=True`` by its own class, ``n_averaged`` left out of the EMA's weights."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    from trainer.checkpoint.sharded import Sharded

    torch.manual_seed(0)
    g, d = Tied(), torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 1))
    opt_g, opt_d = torch.optim.Adam(g.parameters()), torch.optim.Adam(d.parameters())
    ema = AveragedModel(g, multi_avg_fn=get_ema_multi_avg_fn(0.5))
    for _ in range(2):
        d(g.wte(torch.tensor([1, 2]))).sum().backward()
        opt_g.step(), opt_d.step()
        ema.update_parameters(g)
    run = tmp_path / "run"
    c = Checkpointer(tier_table(run), Sharded(None, run_dir=run), key=run_key())
    c.bind(g, opt_g, named={"D": (d, "opt_d", opt_d), "ema": (ema, None, None)})
    c.save(7, {"step": 7, "rng": [], "states": {}, "state_models": ["D", "ema"],
               "fingerprint": {"task": "gan:build", "parallelism": "fsdp", "steps": 10, "seed": 0}},
           meta={"world_size": 1}, every_tier=True)
    c.wait()
    c.close()
    out = tmp_path / "out" / "model.safetensors"
    out.parent.mkdir()
    assert main(["export", "--run-dir", str(run), "--out", str(out)]) == 0
    assert torch.equal(load_strict(out).lm_head.weight, g.lm_head.weight)
    d2 = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 1))
    d2.load_state_dict(load_file(str(out.parent / "model-D.safetensors")), strict=True)
    assert all(torch.equal(a, b) for a, b in zip(d2.state_dict().values(), d.state_dict().values()))
    averaged = load_strict(out.parent / "model-ema.safetensors")
    assert torch.equal(averaged.wte.weight, ema.module.wte.weight) and not torch.equal(averaged.wte.weight, g.wte.weight)
    sidecar = json.loads((out.parent / "model.json").read_text())
    assert sorted(sidecar["models"]) == ["D", "ema"] and sidecar["layout"] == "sharded"
