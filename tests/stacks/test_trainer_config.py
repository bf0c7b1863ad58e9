"""`[trainer.config]`: checked at synthesis by the trainer's own model, delivered to the VM as the
trainer's `--config` file, read back there to exactly the settings that were checked."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tomllib

import pytest
from stack_support import EXAMPLE, ROOT, variant

from stacks.boot import CONFIG_FILE, boot_props, render
from stacks.load import ExperimentError
from stacks.trainer_config import STACK_SETTINGS, fingerprint_settings, to_toml
from trainer.config import RunConfig, load_run_config

CONFIG = {"batch_size": 8, "precision": "bf16", "threads": 2, "grad_clip": "none",
          "task_args": {"n_layer": 2, "n_embd": 32, "dropout": 0.0},
          "tiers": {"gcs": {"every_seconds": 900.0, "keep": 2}}}


def problems(overrides: dict) -> list[str]:
    with pytest.raises(ExperimentError) as err:
        variant(overrides, "x")
    return err.value.lines


def test_a_typo_exits_2_naming_the_file_and_key_before_anything_is_synthesized(tmp_path):
    bad = tmp_path / "typo.toml"
    bad.write_text(EXAMPLE.read_text() + "\n[trainer.config]\nbatch_sise = 32\n")
    env = {**os.environ, "SPOTTRAIN_EXPERIMENTS": str(bad), "CDKTF_OUTDIR": str(tmp_path / "out")}
    proc = subprocess.run([sys.executable, str(ROOT / "main.py")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == [
        f"{bad}: trainer.config.batch_sise: unknown setting; did you mean 'batch_size'? allowed: "
        "a setting in docs/reference/trainer.md"]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("config, line", [
    ({"precision": "fp8"}, "trainer.config.precision: Input should be 'fp32', 'bf16' or 'fp16', got 'fp8'"),
    ({"batch_size": 0}, "trainer.config.batch_size: Input should be greater than 0, got 0"),
    ({"tiers": {"gcs": {"every_step": 5}}},
     "trainer.config.tiers.gcs.every_step: unknown setting; did you mean 'every_steps'? allowed: a "
     "setting in docs/reference/trainer.md"),
    ({"tiers": {"local": {"keep": 1}}},
     "trainer.config.tiers.local: sets the local SSD tier, but disk.local_ssd_count = 0 (there is "
     "none); allowed: remove it, or add local SSDs"),
    ({"steps": 5}, "trainer.config.steps: is set by trainer.steps; allowed: remove it here and set "
     "trainer.steps"),
    ({"gcs_uri": "gs://other/x"}, "trainer.config.gcs_uri: is set by the stack: the experiment's "
     "bucket; allowed: remove it here"),
    ({"startup_grace_s": 60}, "trainer.config.startup_grace_s: is set by group.initial_delay_sec; allowed: remove "
     "it here and set group.initial_delay_sec"),
    ({"health_request": "hi"}, "trainer.config.health_request: is set by the stack: the group's "
     "health check sends this request; allowed: remove it here"),
    ({"heartbeat_every_s": 601}, "trainer.config.heartbeat_every_s: 601 s is not well under alerts.stall_minutes "
     "(1800 s): a pool's healthy nodes would raise the stall alert between heartbeats; allowed: at most 600 s"),
])
def test_the_trainers_own_rules_name_the_key(config, line):
    assert problems({"trainer": {"config": config}}) == [f"x.toml: {line}"]


def test_a_setting_passed_both_ways_is_refused():
    lines = problems({"trainer": {"config": {"seed": 3},
                                  "args": ["--checkpoint-every-steps", "9", "--seed=4", "--config", "f"]}})
    assert lines == [
        "x.toml: trainer.args[2]: --seed sets seed, which [trainer.config] sets too (the flag would "
        "win); allowed: one of the two",
        "x.toml: trainer.args[3]: --config names another settings file while [trainer.config] is "
        "set; allowed: one of the two ([trainer.config] is checked before deploying)",
    ]


def test_every_stack_setting_is_a_trainer_setting():
    assert set(STACK_SETTINGS) <= set(RunConfig.model_fields)
    # Asked of the trainer, not listed: what a resume refuses to change.
    assert {"seed", "steps", "task", "task_args", "batch_size", "precision",
            "global_batch_size", "threads", "deterministic", "device"} <= set(fingerprint_settings())
    assert "log_every_steps" not in fingerprint_settings()


def test_the_vm_reads_back_exactly_the_checked_settings(tmp_path):
    exp = variant({"trainer": {"config": CONFIG}, "disk": {"local_ssd_count": 0}}, "x")
    scripts = render(boot_props("x", exp))
    assert f"--config {CONFIG_FILE}" in scripts.trainer_sh
    # The startup script's own write of the file, run with a stand-in writer.
    start = scripts.startup.index(f"write_if_changed {CONFIG_FILE}")
    line = scripts.startup[start:scripts.startup.index("\n# shellcheck", start)]
    out = tmp_path / "trainer.toml"
    stub = f'write_if_changed() {{ printf "%s\\n" "$3" > {out}; }}\n'
    subprocess.run(["bash", "-c", stub + line], check=True, timeout=30)
    monitoring = {"project": exp.gcp.project, "experiment": "x", "run": "runs/x"}
    assert tomllib.loads(out.read_text()) == {**CONFIG, "sinks": {"monitoring": monitoring}}
    cfg = load_run_config({"run_dir": tmp_path, "steps": 7, "gcs_uri": "gs://b/x"}, out)
    assert (cfg.batch_size, cfg.precision, cfg.threads, cfg.grad_clip) == (8, "bf16", 2, None)
    assert cfg.task_args == CONFIG["task_args"] and cfg.tiers["gcs"].keep == 2
    assert cfg.sinks["monitoring"] == {**monitoring, "every_s": 60.0, "timeout_s": 10.0}


def test_the_vm_always_gets_the_stacks_own_sinks_beside_the_users():
    plain = variant({}, "x")
    monitoring = {"project": plain.gcp.project, "experiment": "x", "run": "runs/x"}
    assert tomllib.loads(boot_props("x", plain).config) == {"sinks": {"monitoring": monitoring}}
    assert f"--config {CONFIG_FILE}" in render(boot_props("x", plain)).trainer_sh
    own = variant({"trainer": {"config": {"sinks": {"jsonl": {"path": "/var/log/e.jsonl"}}}}}, "x")
    assert tomllib.loads(boot_props("x", own).config)["sinks"] == {
        "jsonl": {"path": "/var/log/e.jsonl"}, "monitoring": monitoring}


def test_the_stacks_own_sinks_are_refused_in_the_config():
    assert problems({"trainer": {"config": {"sinks": {"monitoring": {"project": "p-123456"}}}}}) == [
        "x.toml: trainer.config.sinks.monitoring: is set by the stack: the run's goodput, cost and step as "
        "Cloud Monitoring metrics (docs/watch.md); allowed: remove it here"]


def test_toml_round_trip_of_awkward_values():
    data = {"s": 'quote " back \\ tab \t nl \n del \x7f é \u2028 😀', "i": -3, "big": 2**62,
            "f": 1e-05, "g": 1e16, "inf": math.inf, "ninf": -math.inf, "b": False,
            "list": [1, "two", [3.5], {"k": True}], "key with space": {"nested.dot": {"x": []}},
            "empty": {}}
    assert tomllib.loads(to_toml(data)) == data
    assert math.isnan(tomllib.loads(to_toml({"n": math.nan}))["n"])
    assert to_toml({}) == ""
    assert to_toml({"b": 1, "a": {"d": 1, "c": 2}}) == "a = {c = 2, d = 1}\nb = 1\n"
