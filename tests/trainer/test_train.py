"""trainer/train.py in-process with docs/trainer.md's example task: gradient accumulation, a real
SIGTERM in the middle of an accumulation cycle, and an exact resume."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest

from trainer.config import RunConfig
from trainer.config import StatusConfig
from trainer.status import collect
from trainer.train import run
from tests.trainer import example_task
from tests.trainer.support import restore_logging  # noqa: F401  (fixture)


pytestmark = pytest.mark.usefixtures("restore_logging")


def _cfg(run_dir: Path, **kw: object) -> RunConfig:
    return RunConfig(run_dir=run_dir, steps=30, task="tests.trainer.example_task:build", batch_size=4,
                     grad_accum_steps=3, health_port=None, watch_metadata=False, checkpoint_every_steps=7,
                     **kw)


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals need the main thread")
def test_sigterm_mid_accumulation_resumes_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    example_task.FETCHES[0] = 0
    assert run(_cfg(tmp_path / "ref")).code == 0
    ref = collect(StatusConfig(run_dir=tmp_path / "ref"))

    # 4 samples per micro-batch, 3 micro-batches per step: fetch 50 is inside step 5's 2nd micro-batch.
    monkeypatch.setenv("SIGTERM_AT_FETCH", "50")
    example_task.FETCHES[0] = 0
    out = run(_cfg(tmp_path / "run"))
    assert (out.code, out.steps_run) == (75, 5)
    s = collect(StatusConfig(run_dir=tmp_path / "run"))
    assert s["latest_step"] == 5 and s["data"]["consumed"] == 5 * 3 * 4

    monkeypatch.delenv("SIGTERM_AT_FETCH")
    out = run(_cfg(tmp_path / "run", checkpoint_every_seconds=0.05))
    assert (out.code, out.steps_run) == (0, 25)
    s = collect(StatusConfig(run_dir=tmp_path / "run"))
    assert s["model_digest"] == ref["model_digest"]
    assert s["goodput"]["preemptions"] == 1 and s["goodput"]["finished"]


def test_a_sharded_checkpoint_the_disk_fails_to_read_is_tried_again_never_bad_input(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A verified FSDP checkpoint whose shard read meets EIO: start-up tries the restore again
    (a disk error says nothing about the checkpoint) and continues from it; a disk that keeps
    failing ends in 69 (try again later), never 2 (stop for good), and nothing is deleted."""
    from torch.distributed.checkpoint import filesystem

    from tests.trainer.support import failing_shard_reads

    monkeypatch.setattr(filesystem.FileSystem, "create_stream", filesystem.FileSystem.create_stream)  # undone after
    for name in ("once", "always"):
        assert run(_cfg(tmp_path / name, parallelism="fsdp", stop_at_step=7)).code == 75
    left = failing_shard_reads("eio", 1)
    out = run(_cfg(tmp_path / "once", parallelism="fsdp"))
    assert (out.code, out.steps_run, left) == (0, 23, [0])
    left = failing_shard_reads("eio", 10**9)
    out = run(_cfg(tmp_path / "always", parallelism="fsdp", wait_for_tiers_s=2))
    assert (out.code, out.steps_run) == (69, 0) and left[0] < 10**9
    monkeypatch.undo()
    assert collect(StatusConfig(run_dir=tmp_path / "always"))["latest_step"] == 7


def test_resume_with_other_accumulation_is_refused(tmp_path: Path) -> None:
    assert run(_cfg(tmp_path / "run")).code == 0
    assert run(_cfg(tmp_path / "run").model_copy(update={"grad_accum_steps": 2})).code == 2


def test_status_json_reports_the_cost_at_each_session_price(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import json

    from trainer.status import main as status_main

    example_task.FETCHES[0] = 0
    assert run(_cfg(tmp_path / "run", price_per_hour=2.0, on_demand_price_per_hour=6.0)).code == 0
    # A restart at another price is the same run (prices are not in the fingerprint).
    assert run(_cfg(tmp_path / "run", price_per_hour=3.0)).code == 0
    capsys.readouterr()
    assert status_main(StatusConfig(run_dir=tmp_path / "run", json_output=True)) == 0
    c = json.loads(capsys.readouterr().out)["goodput"]["cost"]
    assert (c["priced_sessions"], c["unpriced_sessions"]) == (2, 0)
    assert c["cost_so_far"] > 0 and c["cost_per_1000_steps"] == pytest.approx(c["cost_so_far"] / 30 * 1000, rel=1e-3)
    assert c["on_demand_equivalent"] > 0 and c["savings"] is None  # the second session had no on-demand price
    assert status_main(StatusConfig(run_dir=tmp_path / "run")) == 0
    assert "cost: $" in capsys.readouterr().out


def test_a_checkpoint_of_the_old_data_order_is_refused_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture) -> None:
    """A checkpoint written before the order became a bijection has no ``data_order`` in its
    fingerprint: resuming it would continue on another sample stream, so it is refused (exit 2)."""
    real = RunConfig.fingerprint

    def old_fingerprint(self: RunConfig, **kw: object) -> dict:
        return {k: v for k, v in real(self, **kw).items() if k != "data_order"}

    monkeypatch.setattr(RunConfig, "fingerprint", old_fingerprint)
    assert run(_cfg(tmp_path / "run", stop_at_step=7)).code == 75
    monkeypatch.setattr(RunConfig, "fingerprint", real)
    assert run(_cfg(tmp_path / "run")).code == 2
    assert "data_order: checkpoint has None, this run has 2" in capsys.readouterr().err


def test_status_of_a_run_known_only_by_its_bucket(tmp_path: Path, gcs_proxy, capsys: pytest.CaptureFixture) -> None:
    """`status --gcs-uri` alone (a deployed run, seen from a laptop): the bucket's newest
    checkpoint and the ledger's copy there; no stand-in disk in the report, nothing written."""
    import json

    from trainer.cli import main as cli

    example_task.FETCHES[0] = 0
    assert run(_cfg(tmp_path / "vm-disk", gcs_uri=gcs_proxy.uri)).code == 0
    on_vm = collect(StatusConfig(run_dir=tmp_path / "vm-disk", gcs_uri=gcs_proxy.uri))
    capsys.readouterr()
    assert cli(["status", "--gcs-uri", gcs_proxy.uri, "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert (s["latest_step"], s["tier"]) == (30, "gcs")
    assert s["model_digest"] == on_vm["model_digest"]
    assert list(s["tiers"]) == ["gcs"]
    assert s["goodput"]["finished"] and s["goodput"]["sessions"] == 1
    assert cli(["status"]) == 2
    assert "run_dir: the run to inspect is required (flag --run-dir DIR or --gcs-uri" in capsys.readouterr().err


def test_a_pause_whose_checkpoint_gcs_refuses_exits_74_and_status_says_why(tmp_path: Path, gcs_proxy) -> None:
    prefix = gcs_proxy.uri.split("/", 3)[3]
    rule = gcs_proxy.proxy.add("POST", rf"object={prefix}/step-00000003/manifest[.]json$", "status", status=403,
                               times=None)
    cfg = _cfg(tmp_path / "run", gcs_uri=gcs_proxy.uri, stop_at_step=3, durable_timeout_s=2.0).model_copy(
        update={"steps": 6, "checkpoint_every_steps": 100})
    example_task.FETCHES[0] = 0
    assert run(cfg).code == 74  # not 75: the pause's checkpoint is not on GCS
    s = collect(StatusConfig(run_dir=tmp_path / "run", gcs_uri=gcs_proxy.uri))
    assert s["tiers"]["persistent"]["newest_valid"] == 3 and s["tiers"]["gcs"]["newest_valid"] is None
    assert list(s["failing"]) == ["gcs"] and "403" in s["failing"]["gcs"]["error"]
    assert s["failing"]["gcs"]["failures"] >= 2  # saved again before giving up
    assert s["goodput"]["failures"] == 1 and not s["goodput"]["finished"]
    gcs_proxy.proxy.release(rule)
    assert run(cfg.model_copy(update={"stop_at_step": None})).code == 0
    s = collect(StatusConfig(run_dir=tmp_path / "run", gcs_uri=gcs_proxy.uri))
    assert s["tiers"]["gcs"]["newest_valid"] == 6 and s["failing"] == {} and s["goodput"]["finished"]


def test_the_spend_cap_pauses_with_the_state_durable_and_a_higher_cap_continues_exactly(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from trainer import EXIT_SPEND_CAP

    example_task.FETCHES[0] = 0
    assert run(_cfg(tmp_path / "ref")).code == 0
    reference = collect(StatusConfig(run_dir=tmp_path / "ref"))["model_digest"]

    # $3600 an hour: a dollar a second, so a few steps have cost something.
    example_task.FETCHES[0] = 0
    assert run(_cfg(tmp_path / "run", price_per_hour=3600.0, stop_at_step=6)).code == 75
    spent = collect(StatusConfig(run_dir=tmp_path / "run"))["goodput"]["cost"]["cost_so_far"]
    assert spent > 0
    capsys.readouterr()
    out = run(_cfg(tmp_path / "run", price_per_hour=3600.0, max_usd=spent / 2))
    assert (out.code, out.steps_run) == (EXIT_SPEND_CAP, 0) and EXIT_SPEND_CAP == 77
    line = next(x for x in capsys.readouterr().err.splitlines() if "event=paused" in x)
    fields = dict(p.split("=", 1) for p in line.split() if "=" in p)
    assert (fields["reason"], fields["step"]) == ("max_usd", "6")
    assert float(fields["cost_usd"]) >= float(fields["max_usd"]) == pytest.approx(spent / 2, abs=1e-4)
    s = collect(StatusConfig(run_dir=tmp_path / "run"))
    assert s["latest_step"] == 6 and not s["goodput"]["finished"]
    paused = [e for e in read_ledger(tmp_path / "run") if e["event"] == "paused"]
    assert paused[-1]["reason"] == "max_usd" and paused[-1]["max_usd"] == pytest.approx(spent / 2)

    # A cap above what it has cost goes on (the same weights as never paused).
    out = run(_cfg(tmp_path / "run", price_per_hour=0.0, max_usd=1e9))
    assert out.code == 0
    assert collect(StatusConfig(run_dir=tmp_path / "run"))["model_digest"] == reference


def read_ledger(run_dir: Path) -> list[dict]:
    from trainer.observe.ledger import LEDGER_DIR, LEDGER_FILE, read_events

    return read_events(run_dir / LEDGER_DIR / LEDGER_FILE)
