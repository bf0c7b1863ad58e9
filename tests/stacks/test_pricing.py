"""The price catalog: complete for what the validation accepts, and right on published prices."""

from __future__ import annotations

from datetime import date

import pytest
from stack_support import variant

from stacks import gcp_rules as R
from stacks import pricing
from stacks.pricing import Rate


def test_every_accepted_machine_type_and_gpu_has_a_price():
    for region, prices in pricing.REGIONS.items():
        cpu_families = {R.family(t) for t in R.CPU_MACHINE_TYPES}
        assert set(prices.families) == set(R.FAMILIES) | cpu_families, region
        for machine_type, shape in R.MACHINE_TYPES.items():
            gpu = shape.gpu_type or R.T4
            rate = pricing.machine_rate(machine_type, gpu, shape.gpu_count or 1, prices)
            assert 0 < rate.spot < rate.on_demand, (region, machine_type)
        # A pool's coordinator that does not train: CPU machine types, no GPU.
        for machine_type in R.CPU_MACHINE_TYPES:
            rate = pricing.machine_rate(machine_type, R.T4, 0, prices)
            assert 0 < rate.spot < rate.on_demand, (region, machine_type)
        for gpu in [*R.N1_GPU_LIMITS, *{s.gpu_type for s in R.MACHINE_TYPES.values()} - {None}]:
            assert 0 < prices.gpus[gpu].spot < prices.gpus[gpu].on_demand, (region, gpu)
        assert set(prices.disk_gb_month) == {"pd-balanced", "pd-ssd", "local-ssd"}
    assert pricing.DEFAULT_REGION in pricing.REGIONS


@pytest.mark.parametrize(("machine_type", "gpu", "count", "published"), [
    # Google's published us-central1 on-demand machine prices (GPUs included, or attached).
    ("a2-highgpu-1g", R.A100_40, 1, 3.6731),
    ("a2-megagpu-16g", R.A100_40, 16, 55.7395),
    ("a2-ultragpu-1g", R.A100_80, 1, 5.0688),
    ("a3-highgpu-8g", R.H100, 8, 88.49),
    ("g2-standard-4", R.L4, 1, 0.70683),
    ("g2-standard-8", R.L4, 1, 0.85354),
    ("n1-standard-8", R.T4, 1, 0.379998 + 0.35),
    ("n1-highmem-8", R.V100, 2, 0.473212 + 2 * 2.48),
    ("e2-standard-4", R.T4, 0, 0.134012),  # a pool's CPU-only coordinator
])
def test_catalog_reproduces_published_on_demand_prices(machine_type, gpu, count, published):
    rate = pricing.machine_rate(machine_type, gpu, count)
    assert rate.on_demand == pytest.approx(published, rel=1e-3)


def test_quote_adds_disks_and_uses_the_default_region_for_unknown_ones():
    exp = variant({"gcp": {"region": "europe-west4", "zones": ["europe-west4-a"]},
                   "bucket": {"bucket_location": "EUROPE-WEST4"},
                   "disk": {"checkpoint_disk_gb": 730}, "machine": {"boot_disk_gb": 730}})
    q = pricing.quote(exp)
    assert (q.region, q.region_known) == ("us-central1", False)
    # 730 GB-month of pd-ssd (0.17) + pd-balanced (0.10) = 0.27 per hour, Spot or not.
    assert q.disks == Rate(pytest.approx(0.27), pytest.approx(0.27))
    assert q.on_demand == pytest.approx(q.machine.on_demand + 0.27)
    assert "no entry for this region" in q.source


def test_local_ssd_gets_the_spot_rate():
    exp = variant({"machine": {"machine_type": "n1-standard-8", "gpu_type": R.T4, "gpu_count": 1},
                   "disk": {"local_ssd_count": 2}})
    base = variant({"machine": {"machine_type": "n1-standard-8", "gpu_type": R.T4,
                                "gpu_count": 1}})
    extra = pricing.quote(exp).disks + pricing.quote(base).disks * -1
    assert extra.on_demand == pytest.approx(750 * 0.08 / 730)
    assert extra.spot == pytest.approx(750 * 0.048 / 730)


def test_overrides_replace_the_catalog_price():
    exp = variant({"cost": {"spot_per_hour": 0.25, "on_demand_per_hour": 1.5}})
    assert pricing.hourly_price(exp) == (0.25, 1.5)
    assert pricing.quote(exp).source == "cost.spot_per_hour and cost.on_demand_per_hour set"
    one = variant({"cost": {"spot_per_hour": 0.25}})
    spot, on_demand = pricing.hourly_price(one)
    assert spot == 0.25 and on_demand == pytest.approx(pricing.quote(variant({})).on_demand)
    assert "catalog of" in pricing.quote(one).source and "cost.spot_per_hour set" in \
        pricing.quote(one).source


def test_running_price_follows_provisioning():
    spot, on_demand = pricing.hourly_price(variant({}))
    assert pricing.running_price(variant({})) == spot
    standard = variant({"machine": {"provisioning": "standard", "termination_action": None}})
    assert pricing.running_price(standard) == on_demand


def test_spot_only_a3_sizes_are_marked_not_offered_on_demand():
    exp = variant({"machine": {"machine_type": "a3-highgpu-1g", "gpu_type": R.H100,
                               "gpu_count": 1}})
    q = pricing.quote(exp)
    assert not q.on_demand_offered
    assert q.machine.on_demand == pytest.approx(88.49 / 8)


def test_catalog_age():
    assert pricing.catalog_age_days(pricing.CATALOG_DATE) == 0
    assert pricing.catalog_age_days(date(pricing.CATALOG_DATE.year + 1, 1, 1)) > 0


def test_trainer_price_args():
    exp = variant({"cost": {"spot_per_hour": 0.25, "on_demand_per_hour": 1.5}})
    assert pricing.trainer_price_args(exp) == [
        "--price-per-hour", "0.250000", "--on-demand-price-per-hour", "1.500000"]
    standard = variant({"machine": {"provisioning": "standard", "termination_action": None},
                        "cost": {"spot_per_hour": 0.25, "on_demand_per_hour": 1.5}})
    assert pricing.trainer_price_args(standard)[1] == "1.500000"
