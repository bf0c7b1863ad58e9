"""Cost arithmetic on known cases, and the `cost` command."""

from __future__ import annotations

import re
import subprocess
import sys
from datetime import date
from pathlib import Path

import pytest
from stack_support import ROOT, variant

from stacks import cost, pricing
from stacks.load import ExperimentFile


def _file(overrides, name="example") -> ExperimentFile:
    return ExperimentFile(name, Path(f"experiments/{name}.toml"), variant(overrides, name))


def test_known_case_arithmetic():
    # 36,000 steps at 2 steps/s = 5 h of training; 80% goodput on Spot = 6.25 h of VM.
    est = cost.estimate(variant({
        "trainer": {"steps": 36_000},
        "cost": {"steps_per_second": 2.0, "expected_goodput": 0.8, "spot_per_hour": 1.0,
                 "on_demand_per_hour": 3.0},
    }))
    assert est.training_hours == pytest.approx(5.0)
    assert est.spot_hours == pytest.approx(6.25)
    assert est.on_demand_hours == pytest.approx(5.0)
    assert est.spot_cost == pytest.approx(6.25)
    assert est.on_demand_cost == pytest.approx(15.0)
    assert est.savings == pytest.approx(8.75)
    assert est.savings_pct == pytest.approx(100 * 8.75 / 15)


def test_on_demand_goodput_and_catalog_prices():
    est = cost.estimate(variant({
        "trainer": {"steps": 3600}, "cost": {"steps_per_second": 1.0, "expected_goodput": 0.5,
                                             "on_demand_goodput": 0.8},
    }))
    spot, on_demand = pricing.hourly_price(variant({}))
    assert est.spot_cost == pytest.approx(2 * spot)
    assert est.on_demand_cost == pytest.approx(1.25 * on_demand)


def test_spot_dearer_than_on_demand_gives_negative_savings():
    est = cost.estimate(variant({"cost": {"expected_goodput": 0.1, "spot_per_hour": 1.0,
                                          "on_demand_per_hour": 1.0}}))
    assert est.savings < 0 and est.savings_pct == pytest.approx(-900)


def test_describe_states_the_assumptions():
    lines = cost.describe(_file({"cost": {"steps_per_second": 2.0, "spot_per_hour": 1.0,
                                          "on_demand_per_hour": 3.0},
                                 "trainer": {"steps": 36_000}}), today=pricing.CATALOG_DATE)
    text = "\n".join(lines)
    assert "hourly price      Spot $1.00/h   on-demand $3.00/h" in text
    assert "36,000 steps at 2 steps/s (set in [cost]) = 5.0 h of training" in text
    assert "goodput 90% on Spot (default), 100% on demand" in text
    assert "expected cost     Spot $5.56 (5.6 h of VM)   on-demand $15.00 (5.0 h of VM)" in text
    assert "savings           $9.44 (63%) with Spot" in text
    assert "not a bill" in text
    assert "days old" not in text  # fully overridden: the catalog's age does not matter


def test_describe_flags_a_stale_catalog_and_standard_provisioning():
    later = date.fromordinal(pricing.CATALOG_DATE.toordinal() + 45)
    text = "\n".join(cost.describe(
        _file({"machine": {"provisioning": "standard", "termination_action": None}}), today=later))
    assert "the catalog is 45 days old and Spot prices change up to once a month" in text
    assert '(not taken: provisioning = "standard")' in text


def test_the_catalogs_date_and_the_watch_costs():
    later = date.fromordinal(pricing.CATALOG_DATE.toordinal() + 10)
    text = "\n".join(cost.describe(_file({}), today=later))
    assert f"price catalog     {pricing.CATALOG_DATE.isoformat()} (10 days old; " in text
    assert "WARNING" not in text
    assert "alerts            8 alert conditions: $12.00/month while deployed ($1.50 each" in text
    m = re.search(r"logs              ~(\S+ \S+) over the run \((\d+) entries/h of ~(\d+) B\)", text)
    assert m and int(m.group(2)) == 3600 // 10 + cost.OTHER_LOG_LINES_PER_HOUR  # 1 step/s, a line per 10 steps
    assert 500 < int(m.group(3)) < 2000  # the shipper's own entry for a step line
    assert "budget" not in text
    off = "\n".join(cost.describe(_file({"alerts": {"enabled": False},
                                         "budget": {"billing_account": "012345-6789AB-CDEF01", "amount_usd": 50}}),
                                  today=later))
    assert "alerts            none" in off
    assert "budget            $50.00 a month on this experiment's resources, alerting at 50%, 90%, 100%" in off


def test_cost_command_on_the_repository_experiments():
    run = subprocess.run([sys.executable, "-m", "stacks.cost"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "cost of example (experiments/example.toml): g2-standard-8 with 1 x nvidia-l4" in \
        run.stdout
    assert "savings" in run.stdout


def test_cost_command_takes_an_experiment_by_name(capsys):
    """`make cost EXPERIMENT=example`, as `make deploy EXPERIMENT=example` takes it."""
    assert cost.main(["example"]) == 0
    assert "cost of example (experiments/example.toml)" in capsys.readouterr().out
    assert cost.main(["nope"]) == 2
    assert "experiments/nope.toml: no such experiment file (experiments/: " in capsys.readouterr().err


def test_cost_command_bad_input_exits_2_naming_file_and_field(tmp_path):
    text = (ROOT / "experiments" / "example.toml").read_text()
    bad = tmp_path / "cheap.toml"
    assert "\n[cost]\n" in text  # the bad values go into the example's own section
    bad.write_text(text.replace("\n[cost]\n", "\n[cost]\nexpected_goodput = 1.5\nspot_per_hour = -1\n"))
    run = subprocess.run([sys.executable, "-m", "stacks.cost", str(bad)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "cheap.toml: cost.expected_goodput: Input should be less than or equal to 1" in \
        run.stderr
    assert "cheap.toml: cost.spot_per_hour: Input should be greater than 0" in run.stderr
    assert "Traceback" not in run.stderr and run.stdout == ""
    assert cost.main(["a", "b"]) == 2


# --- the checkpoint bucket's storage -------------------------------------------------------------


def test_storage_estimate_known_case():
    # 1 GB checkpoints every 600 s for a 24 h run: 144 saves, each rotated out and billed 7 more
    # days by soft delete; 3 kept. Uploads in one stream: no parts (their case is below).
    exp = variant({"trainer": {"steps": 86_400, "param_count": None, "state_bytes": 10**9,
                               "config": {"gcs_streams": 1}},
                   "cost": {"steps_per_second": 1.0, "expected_goodput": 1.0,
                            "checkpoint_interval_s": 600}})
    st = cost.storage_estimate(exp, run_hours=24)
    assert (st.keep, st.kept_gb, st.saves_per_day) == (3, 3.0, 144)
    assert st.retention_days == 7 and st.retention_source == "soft delete 7 d"
    assert st.retained_gb == pytest.approx(144.0)  # a 1-day run fills 1 day of the window
    assert st.retention_cost == pytest.approx(144 * 1 * 7 / (730 / 24) * 0.020)
    assert st.price_gb_month == 0.020
    longer = cost.storage_estimate(exp, run_hours=30 * 24)
    assert longer.retained_gb == pytest.approx(144 * 7)  # the window is full: 7 days of saves


def test_versioning_with_soft_delete_doubles_what_each_rotated_checkpoint_costs():
    """The defaults keep a rotated checkpoint 7 days (soft delete); versioning on top would keep
    it its noncurrent days first, then soft delete's 7 more."""
    base = {"trainer": {"state_bytes": 10**9, "param_count": None, "config": {"gcs_streams": 1}}}
    default = cost.storage_estimate(variant(base), run_hours=24 * 30)
    versioned = cost.storage_estimate(variant({**base, "bucket": {"versioning": True}}),
                                      run_hours=24 * 30)
    assert default.retention_days == 7
    assert versioned.retention_days == 14
    assert versioned.retained_gb == pytest.approx(2 * default.retained_gb)
    off = cost.storage_estimate(variant({**base, "bucket": {"soft_delete_days": 0}}),
                                run_hours=24 * 30)
    assert off.retained_gb == 0 and off.retention_cost == 0


def test_the_parts_of_parallel_uploads_are_retained_by_soft_delete_too():
    """A checkpoint file of 64 MiB or more goes up as parts composed into its object; the deleted
    parts are soft-deleted like a rotated checkpoint, so each save is retained twice."""
    def estimate(state_bytes, config=None, bucket=None):
        return cost.storage_estimate(variant({"trainer": {"state_bytes": state_bytes, "param_count": None,
                                                          "config": config or {}},
                                              "bucket": bucket or {}}), run_hours=24 * 30)

    one = estimate(10**9, {"gcs_streams": 1})
    parallel = estimate(10**9)
    assert (one.parts_days, parallel.parts_days) == (0, 7)
    assert parallel.retained_gb == pytest.approx(2 * one.retained_gb)
    assert parallel.retention_cost == pytest.approx(2 * one.retention_cost)
    assert parallel.parts_source == "8 streams (the trainer's default)"
    assert estimate(10**9, {"gcs_streams": 4}).parts_source == "4 streams (trainer.config.gcs_streams)"
    assert estimate(32 << 20).parts_days == 0  # under 64 MiB: one stream, no parts
    assert estimate(10**9, bucket={"soft_delete_days": 0}).retained_gb == 0
    text = "\n".join(cost.describe(_file({"trainer": {"state_bytes": 2 * 10**9, "param_count": None},
                                          "cost": {"checkpoint_interval_s": 300}}), today=pricing.CATALOG_DATE))
    assert "and the parts of each save's upload in 8 streams (the trainer's default) 7 d" in text
    assert "trainer.config.gcs_streams = 1" in text


def test_storage_interval_comes_from_the_trainer_args_else_an_assumption():
    def interval(overrides):
        return cost.storage_estimate(variant(overrides), run_hours=1).interval_s

    assert interval({"trainer": {"args": ["--checkpoint-every-seconds=900"]}}) == 900
    assert interval({"trainer": {"args": ["--checkpoint-every-steps", "200"]},
                     "cost": {"steps_per_second": 4.0}}) == 50
    assert interval({"trainer": {"args": []}}) == cost.DEFAULT_CHECKPOINT_INTERVAL_S
    assert interval({"cost": {"checkpoint_interval_s": 42}}) == 42
    # [trainer.config]: the bucket's own cadence before the run-wide one, as the trainer does.
    assert interval({"trainer": {"args": [], "config": {
        "checkpoint_every_seconds": 60, "tiers": {"gcs": {"every_seconds": 900}}}}}) == 900
    assert interval({"trainer": {"args": [], "config": {"checkpoint_every_steps": 600}},
                     "cost": {"steps_per_second": 2.0}}) == 300


def test_storage_lines_in_the_cost_output():
    lines = cost.describe(_file({"trainer": {"state_bytes": 2 * 10**9, "param_count": None},
                                 "cost": {"checkpoint_interval_s": 300}}),
                          today=pricing.CATALOG_DATE)
    text = "\n".join(lines)
    assert "bucket storage    3 kept x 2.00 GB (declared state_bytes) = 6.0 GB; one save every " \
           "5 min (set in [cost]) rotates 288 a day out" in text
    assert "soft delete 7 d: each rotated checkpoint stays billed 7 d" in text
    assert "STANDARD $0.0200/GB-month in US-CENTRAL1" in text
    assert "retention holds" in text  # 7 days of 5-minute saves dwarf the 3 kept
    assert lines[-1].startswith("  These are estimates")
    unknown = cost.describe(_file({"trainer": {"param_count": None}}), today=pricing.CATALOG_DATE)
    assert any("unknown checkpoint size" in line for line in unknown)


@pytest.mark.parametrize(("overrides", "every"), [
    ({"cost": {"checkpoint_interval_s": 20}}, "one save every 20 s (set in [cost])"),
    ({"cost": {"steps_per_second": 40.0}, "trainer": {"args": ["--checkpoint-every-steps", "10"]}},
     "one save every 0.25 s (--checkpoint-every-steps 10 at the assumed steps/s)"),
    ({"cost": {"checkpoint_interval_s": 500}}, "one save every 8.3 min"),
    ({"cost": {"checkpoint_interval_s": 5400}}, "one save every 1.5 h"),
])
def test_a_save_interval_reads_in_its_own_unit_and_never_as_0(overrides, every):
    text = "\n".join(cost.storage_lines(variant(overrides), run_hours=1))
    assert every in text


def test_the_storage_estimate_keeps_what_the_trainer_keeps():
    from trainer.config import RunConfig

    assert cost.TRAINER_KEEP == RunConfig.model_fields["keep"].default
