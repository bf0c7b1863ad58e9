"""`make cost`: the job under Spot, flex-start and on demand side by side, and the chosen options."""

from __future__ import annotations

import pytest
from stack_support import variant

from stacks import pricing
from stacks.policy_cost import FLEX_START_DISCOUNT, compare, policy_lines


def test_three_policies_from_one_set_of_assumptions() -> None:
    exp = variant({"cost": {"steps_per_second": 1.0, "expected_goodput": 0.8, "on_demand_goodput": 1.0}})
    q = pricing.quote(exp)
    p = compare(exp)
    training = 20000 / 3600
    assert p.spot_hours == pytest.approx(training / 0.8) and p.spot == pytest.approx(training / 0.8 * q.spot)
    assert p.on_demand == pytest.approx(training * q.on_demand)
    assert p.flex_per_hour == pytest.approx(q.machine.on_demand * (1 - FLEX_START_DISCOUNT) + q.disks.on_demand)
    assert p.flex_vms == 1 and p.flex_hours == pytest.approx(training + 10 / 60)  # the final stop margin


def test_a_job_longer_than_a_flex_start_vm_pays_each_handover() -> None:
    # 400 h of training on VMs of at most 100 h: each loses 10 min before its end and 10 min of
    # start-up on the next, so 5 VMs.
    exp = variant({"trainer": {"steps": 400 * 3600}, "capacity": {"flex_max_run_hours": 100},
                   "cost": {"on_demand_goodput": 1.0, "restart_minutes": 10}})
    p = compare(exp)
    assert p.flex_vms == 5
    assert p.flex_hours == pytest.approx(400 + 4 * 20 / 60 + 10 / 60)


def test_a_quoted_flex_price_replaces_the_best_case() -> None:
    exp = variant({"cost": {"flex_start_per_hour": 0.6}})
    p = compare(exp)
    assert (p.flex_per_hour, p.flex_quoted) == (0.6, True)
    assert "quoted in [cost]" in policy_lines(exp)[0]


def test_the_chosen_policy_names_its_options() -> None:
    exp = variant({"capacity": {"on_demand_fallback_minutes": 30}})
    lines = policy_lines(exp)
    assert lines[0].startswith("  by policy         Spot $")
    assert "flex-start $" in lines[0] and "on-demand $" in lines[0]
    assert lines[1].startswith("  chosen policy     Spot; on-demand fallback after 30 min without Spot")
    assert f"${pricing.quote(exp).on_demand:,.4f} instead of waiting" in lines[1]
