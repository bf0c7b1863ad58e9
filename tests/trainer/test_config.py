"""trainer/config.py and the CLI's handling of bad input: `SOURCE: field: problem`, exit 2."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from trainer.cli import main
from trainer.config import ConfigError, RunConfig, load_run_config
from tests.trainer.support import REPO, trainer_env


def test_flags_override_file(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('steps = 10\nseed = 3\nbatch_size = 2\n[task_args]\nn_layer = 1\n')
    cfg = load_run_config({"run_dir": tmp_path / "r", "steps": 20, "seed": None}, f)
    assert (cfg.steps, cfg.seed, cfg.batch_size, cfg.task_args) == (20, 3, 2, {"n_layer": 1})


def test_file_errors_name_file_and_field(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('steps = -1\nbogus = 1\nprecision = "fp8"\n')
    with pytest.raises(ConfigError) as e:
        load_run_config({"run_dir": tmp_path}, f)
    lines = e.value.lines
    assert f"{f}: steps: Input should be greater than 0" in lines
    assert f"{f}: bogus: unknown setting" in lines
    assert any(line.startswith(f"{f}: precision: ") for line in lines)


def test_command_line_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load_run_config({"run_dir": tmp_path, "steps": 5, "gcs_uri": "s3://x"}, None)
    assert e.value.lines == ["command line: gcs_uri: must look like gs://BUCKET/PREFIX"]
    with pytest.raises(ConfigError) as e:
        load_run_config({"steps": 5}, None)
    assert e.value.lines == ["command line: run_dir: required (flag --run-dir)"]


def test_none_in_toml_turns_health_off(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('health_port = "none"\n')
    assert load_run_config({"run_dir": tmp_path, "steps": 1}, f).health_port is None


def test_invalid_toml_and_missing_file(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text("steps = = 1\n")
    with pytest.raises(ConfigError) as e:
        load_run_config({"run_dir": tmp_path}, f)
    assert e.value.lines[0].startswith(f"{f}: not valid TOML")
    with pytest.raises(ConfigError) as e:
        load_run_config({"run_dir": tmp_path}, tmp_path / "nope.toml")
    assert e.value.lines[0].startswith(f"{tmp_path / 'nope.toml'}: cannot read")


def test_fingerprint_excludes_checkpoint_cadence(tmp_path: Path) -> None:
    a = RunConfig(run_dir=tmp_path, steps=5, checkpoint_every_steps=2)
    b = RunConfig(run_dir=tmp_path, steps=5, checkpoint_every_steps=3, checkpoint_every_seconds=9)
    assert a.fingerprint(dataset_len=7) == b.fingerprint(dataset_len=7)
    c = RunConfig(run_dir=tmp_path, steps=5, seed=1)
    assert a.fingerprint(dataset_len=7) != c.fingerprint(dataset_len=7)


def test_cli_exit_2_in_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--run-dir", str(tmp_path), "--steps", "0"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "command line: steps: Input should be greater than 0"
    # ... and the structured failure a VM's "run stopped" alert counts (tests/stacks/test_watch.py).
    assert err[1].endswith(" ERROR trainer event=failed reason=bad_input command line: steps: Input should be "
                           "greater than 0") and len(err) == 2
    with pytest.raises(SystemExit) as e:
        main(["run", "--steps", "x"])
    assert e.value.code == 2


def test_bad_config_subprocess_has_no_traceback(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('batch_size = "big"\n')
    out = subprocess.run([sys.executable, "-m", "trainer", "run", "--run-dir", str(tmp_path / "r"), "--steps", "3",
                          "--config", str(f)], capture_output=True, text=True, env=trainer_env(), cwd=REPO, timeout=120)
    assert out.returncode == 2
    why = f"{f}: batch_size: Input should be a valid integer, unable to parse string as an integer"
    assert out.stderr.splitlines()[0] == why
    assert out.stderr.splitlines()[1].endswith(f" ERROR trainer event=failed reason=bad_input {why}")
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "r").exists()  # nothing was touched


def test_unknown_task_is_bad_input(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('watch_metadata = false\n')
    out = subprocess.run([sys.executable, "-m", "trainer", "run", "--run-dir", str(tmp_path / "r"), "--steps", "3",
                          "--task", "no_such_module:build", "--health-port", "0", "--config", str(f)],
                         capture_output=True, text=True, env=trainer_env(), cwd=REPO, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "task: cannot import module 'no_such_module'" in out.stderr
    assert "Traceback" not in out.stderr


def test_prices_are_checked_and_not_part_of_the_fingerprint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = RunConfig(run_dir=tmp_path, steps=5, price_per_hour=1.5, on_demand_price_per_hour=4.0)
    b = RunConfig(run_dir=tmp_path, steps=5, price_per_hour=2.0)
    assert a.fingerprint(dataset_len=7) == b.fingerprint(dataset_len=7)
    for bad in ("-1", "nan", "inf"):
        assert main(["run", "--run-dir", str(tmp_path), "--steps", "5", "--price-per-hour", bad]) == 2
        assert capsys.readouterr().err.startswith("command line: price_per_hour: ")
    assert main(["run", "--run-dir", str(tmp_path), "--steps", "5", "--on-demand-price-per-hour", "-0.5"]) == 2
    assert capsys.readouterr().err.startswith("command line: on_demand_price_per_hour: ")


def test_tiers_take_their_own_cadence_and_keep(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('keep = 4\n[tiers.local]\nevery_steps = 5\nkeep = 2\n[tiers.gcs]\nevery_seconds = 900\n')
    cfg = load_run_config({"run_dir": tmp_path / "r", "steps": 10, "local_dir": tmp_path / "l",
                           "gcs_uri": "gs://b/p", "checkpoint_every_steps": 50}, f)
    c, k = cfg.tier_cadence(), cfg.tier_keep()
    assert [(n, c[n].every_steps, c[n].every_seconds, k[n]) for n in ("local", "persistent", "gcs")] == [
        ("local", 5, None, 2), ("persistent", 50, None, 4), ("gcs", None, 900, 4)]


def test_the_configs_tier_names_are_the_tier_tables() -> None:
    """``[tiers.NAME]`` takes the names of the tier table (``trainer.checkpoint.tiers``), which says
    them; the config spells them out as a ``Literal`` so that reading it needs no store."""
    from typing import get_args

    from trainer.checkpoint.tiers import TIER_NAMES

    key = get_args(RunConfig.model_fields["tiers"].annotation)[0]
    assert get_args(key) == TIER_NAMES


def test_keep_reaches_tiers_on_the_automatic_interval(tmp_path: Path) -> None:
    cfg = RunConfig(run_dir=tmp_path, steps=10, keep=7)
    assert all(t.cadence.automatic and t.keep == 7 for t in cfg.tier_table())


def test_tier_settings_need_their_tier(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[tiers.local]\nevery_steps = 5\n[tiers.fast]\nevery_steps = 1\n')
    with pytest.raises(ConfigError) as e:
        load_run_config({"run_dir": tmp_path / "r", "steps": 10}, f)
    text = "\n".join(e.value.lines)
    assert "tiers.fast" in text
    f.write_text('[tiers.local]\nevery_steps = 5\n')
    with pytest.raises(ConfigError) as e:
        load_run_config({"run_dir": tmp_path / "r", "steps": 10}, f)
    assert f"{f}: tiers: [tiers.local] is set but there is no local_dir (the local tier)" in e.value.lines


def test_global_batch_size_sets_accumulation_per_world_size(tmp_path: Path) -> None:
    cfg = RunConfig(run_dir=tmp_path, steps=5, batch_size=2, global_batch_size=12, grad_accum_steps=7)
    assert [cfg.accum_steps(w) for w in (1, 2, 3, 6)] == [6, 3, 2, 1]
    with pytest.raises(ValueError, match="global_batch_size 12 is not a multiple of batch_size 2 x world size 4"):
        cfg.accum_steps(4)
    # Without it, grad_accum_steps holds at every world size (the global batch follows the world).
    assert RunConfig(run_dir=tmp_path, steps=5, grad_accum_steps=3).accum_steps(5) == 3
    fp = cfg.fingerprint(dataset_len=7)
    assert fp["global_batch_size"] == 12 and "grad_accum_steps" not in fp and "world_size" not in fp


def test_a_bad_input_exit_writes_its_reason_for_the_vm(tmp_path: Path, monkeypatch, capsys) -> None:
    reason = tmp_path / "bad-input"
    monkeypatch.setenv("SPOTTRAIN_BAD_INPUT_FILE", str(reason))
    assert main(["run", "--run-dir", str(tmp_path), "--steps", "0"]) == 2
    assert reason.read_text() == "command line: steps: Input should be greater than 0\n"
    with pytest.raises(SystemExit):
        main(["run", "--bogus"])
    assert reason.read_text().startswith("command line: unrecognized arguments: --bogus")


def test_init_from_settings_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load_run_config({"run_dir": tmp_path, "steps": 5, "init_from_step": 3, "init_from_optimizer": True}, None)
    assert e.value.lines == [
        "command line: init_from_step: is set but there is no init_from (the run to start from)",
        "command line: init_from_optimizer: is set but there is no init_from (the run to start from)"]
    with pytest.raises(ConfigError) as e:
        load_run_config({"run_dir": tmp_path, "steps": 5, "init_from": "gs://Bad_Bucket/x"}, None)
    assert e.value.lines[0].startswith("command line: init_from: invalid bucket name")
def test_data_dir_from_file_or_flag_is_not_part_of_the_fingerprint(tmp_path: Path) -> None:
    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text('data_dir = "/mnt/localssd/data"\n')
    a = load_run_config({"run_dir": tmp_path, "steps": 5}, cfg_file)
    b = load_run_config({"run_dir": tmp_path, "steps": 5, "data_dir": Path("/mnt/spottrain/data")}, cfg_file)
    assert a.data_dir == Path("/mnt/localssd/data") and b.data_dir == Path("/mnt/spottrain/data")
    assert a.fingerprint(dataset_len=10) == b.fingerprint(dataset_len=10)


def test_every_run_flag_reaches_the_config() -> None:
    """A flag the stack passes is never parsed and then dropped (`--preemption-budget-s` is how
    a VM's trainer gets its shutdown window's budget, `--startup-grace-s` its grace)."""
    from trainer.cli import parser, run_config

    args = parser().parse_args(["run", "--run-dir", "/tmp/r", "--steps", "5", "--preemption-budget-s", "110",
                                "--startup-grace-s", "1800"])
    cfg = run_config(args)
    assert (cfg.preemption_budget_s, cfg.startup_grace_s) == (110.0, 1800.0)
    assert run_config(parser().parse_args(["run", "--run-dir", "/tmp/r", "--steps", "5"])).preemption_budget_s == 20.0


def test_a_data_url_is_a_bucket_url_and_part_of_the_fingerprint_only_when_set(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('data_url = "/mnt/data/shard-{0..3}.tar"\n')
    with pytest.raises(ConfigError) as e:
        load_run_config({"run_dir": tmp_path, "steps": 5}, f)
    assert e.value.lines == [f"{f}: data_url: must look like gs://BUCKET/PREFIX[/NAME] (braces for ranges: "
                             "shard-{000000..000099}.tar)"]
    url = "gs://my-data/train/shard-{000000..000099}.tar"
    cfg = load_run_config({"run_dir": tmp_path, "steps": 5, "data_url": url}, None)
    assert cfg.fingerprint(dataset_len=0)["data_url"] == url
    assert "data_url" not in RunConfig(run_dir=tmp_path, steps=5).fingerprint(dataset_len=0)  # old runs' keys
