"""`make prices` (stacks/price_catalog.py): stacks/prices.json from the Cloud Billing Catalog API's
SKUs, against the loopback catalog (drill/fake_observability.py) with its real paging."""

from __future__ import annotations

import json
from datetime import date
from pathlib import Path
from typing import Any, Iterator

import pytest

from drill.fake_observability import FakeObservability
from drill.net import free_port
from stacks import gcp_rules as R
from stacks import price_catalog, pricing

TOKEN = "catalog-token"
TODAY = date(2026, 3, 2)
GPU_WORDS = {R.T4: "Tesla T4", R.V100: "Tesla V100", R.P100: "Tesla P100", R.P4: "Tesla P4",
             R.A100_40: "Tesla A100", R.A100_80: "A100 80GB", R.L4: "L4", R.H100: "H100 80GB",
             R.H100_MEGA: "H100 80GB Mega"}
#: a3's cores and memory per unit (the rest of its folded GPU rate is the GPU SKU's)
A3_CORE, A3_RAM = (0.03, 0.01), (0.004, 0.0015)


def sku(n: int, description: str, usage: str, regions: list[str], unit: str, price: float,
        family: str = "Compute") -> dict[str, Any]:
    units = int(price)
    return {"name": f"services/6F81-5844-456A/skus/S-{n:04d}", "skuId": f"S-{n:04d}", "description": description,
            "category": {"serviceDisplayName": "Compute Engine", "resourceFamily": family, "resourceGroup": "X",
                         "usageType": usage},
            "serviceRegions": regions, "pricingInfo": [
                {"effectiveTime": "2025-01-01T00:00:00Z", "pricingExpression": {"usageUnit": unit, "tieredRates": [
                    {"startUsageAmount": 0, "unitPrice": {"currencyCode": "USD", "units": "9", "nanos": 0}}]}},
                {"effectiveTime": "2026-03-01T00:00:00Z", "pricingExpression": {"usageUnit": unit, "tieredRates": [
                    {"startUsageAmount": 0, "unitPrice": {"currencyCode": "USD", "units": str(units),
                                                          "nanos": round((price - units) * 1e9)}}]}}]}


def catalog(table: pricing.RegionPrices, region: str, where: str, scale: float = 1.0,
            first_id: int = 0) -> list[dict[str, Any]]:
    """The SKUs that price `table` in `region` (described as Google describes them, in `where`)."""
    out: list[dict[str, Any]] = []

    def add(description: str, spot: bool, unit: str, price: float, family: str = "Compute") -> None:
        out.append(sku(first_id + len(out), description,
                       "Preemptible" if spot else "OnDemand", [region], unit, price * scale, family))

    for fam, rates in table.families.items():
        name = fam.upper()
        predefined = "Predefined " if fam == "n1" else ""
        cores, ram = (A3_CORE, A3_RAM) if fam == "a3" else ((rates.vcpu.on_demand, rates.vcpu.spot),
                                                            (rates.memory_gb.on_demand, rates.memory_gb.spot))
        for spot in (False, True):
            prefix = "Spot Preemptible " if spot else ""
            add(f"{prefix}{name} {predefined}Instance Core running in {where}", spot, "h", cores[spot])
            add(f"{prefix}{name} {predefined}Instance Ram running in {where}", spot, "GiBy.h", ram[spot])
    for gpu, words in GPU_WORDS.items():
        rate = table.gpus[gpu]
        for spot in (False, True):
            price = rate.spot if spot else rate.on_demand
            if gpu in (R.H100, R.H100_MEGA):  # unfold: the table holds the a3 machine per GPU
                shape = R.MACHINE_TYPES["a3-highgpu-8g" if gpu == R.H100 else "a3-megagpu-8g"]
                price -= (shape.vcpus * A3_CORE[spot] + shape.memory_gb * A3_RAM[spot]) / shape.gpu_count
            tail = f"attached to Spot Preemptible VMs running in {where}" if spot else f"running in {where}"
            add(f"Nvidia {words} GPU {tail}", spot, "h", price)
    d = table.disk_gb_month
    add(f"Balanced PD Capacity in {where}", False, "GiBy.mo", d["pd-balanced"].on_demand, "Storage")
    add(f"SSD backed PD Capacity in {where}", False, "GiBy.mo", d["pd-ssd"].on_demand, "Storage")
    add(f"SSD backed Local Storage in {where}", False, "GiBy.mo", d["local-ssd"].on_demand, "Storage")
    add(f"SSD backed Local Storage attached to Spot Preemptible VMs in {where}", True, "GiBy.mo",
        d["local-ssd"].spot, "Storage")
    return out


def noise(n: int) -> list[dict[str, Any]]:
    """What else the service lists: commitments, regional disks, other families and regions."""
    kinds = [("Commitment v1: N1 Predefined Instance Core in Americas for 1 Year", "Commit1Yr", "us-central1"),
             ("Regional SSD backed PD Capacity in Iowa", "OnDemand", "us-central1"),
             ("N2 Instance Core running in Americas", "OnDemand", "us-central1"),
             ("Nvidia L4 GPU running in Tokyo", "OnDemand", "asia-northeast1"),
             ("Nvidia L4 GPU Virtual Workstation running in Americas", "OnDemand", "us-central1")]
    return [sku(10_000 + i, kinds[i % len(kinds)][0], kinds[i % len(kinds)][1], [kinds[i % len(kinds)][2]],
                "GiBy.mo" if "PD" in kinds[i % len(kinds)][0] else "h", 1.0) for i in range(n)]


@pytest.fixture
def fake(monkeypatch) -> Iterator[FakeObservability]:
    with FakeObservability(token=TOKEN) as f:
        monkeypatch.setenv("SPOTTRAIN_BILLING_API", f.billing_api)
        yield f


def run(tmp_path: Path, *args: str) -> int:
    return price_catalog.main(["--out", str(tmp_path / "prices.json"), *args], today=TODAY,
                              token=lambda: (TOKEN, 3600.0))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, list):
        return all(abs(x - y) <= 2e-6 for x, y in zip(a, b)) and len(a) == len(b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def test_the_table_is_rebuilt_from_every_page_of_skus(fake, tmp_path, capsys) -> None:
    us = pricing.REGIONS["us-central1"]
    skus = catalog(us, "us-central1", "Americas") + catalog(us, "europe-west4", "Netherlands", 1.1, first_id=1000) + noise(5200)
    fake.add_service(price_catalog.COMPUTE_SERVICE, "Compute Engine", skus)
    (tmp_path / "prices.json").write_text(pricing.TABLE_FILE.read_text())
    assert run(tmp_path, "us-central1", "europe-west4") == 0
    new = json.loads((tmp_path / "prices.json").read_text())
    current = json.loads(pricing.TABLE_FILE.read_text())
    assert _same(new["regions"]["us-central1"], current["regions"]["us-central1"])
    assert new["regions"]["europe-west4"]["gpus"][R.L4][0] == pytest.approx(1.1 * us.gpus[R.L4].on_demand)
    assert new["catalog_date"] == "2026-03-02" and "Cloud Billing Catalog API" in new["source"]
    assert new["skus"]["us-central1"]["gpus.nvidia-l4.spot"].startswith("S-")
    # Every page was read (over 5,000 SKUs, the API's page), with the token it gave.
    pages = [c for c in fake.calls if c[1].endswith("/skus")]
    assert len(pages) == 2 and all(c[2] == 200 for c in pages)
    # The table loads, and prices an experiment in the new region from it.
    when, source, regions = pricing.load_table(tmp_path / "prices.json")
    assert when == TODAY and set(regions) == {"us-central1", "europe-west4"}
    out = capsys.readouterr().out
    assert "europe-west4: new" in out and "us-central1: 44 rates from SKUs" in out


def test_a_rate_without_exactly_one_sku_writes_nothing(fake, tmp_path, capsys) -> None:
    us = pricing.REGIONS["us-central1"]
    skus = [s for s in catalog(us, "us-central1", "Americas")
            if s["description"] != "Nvidia L4 GPU attached to Spot Preemptible VMs running in Americas"]
    twice = next(s for s in skus if s["description"] == "G2 Instance Core running in Americas")
    skus.append({**twice, "skuId": "S-TWICE"})
    fake.add_service(price_catalog.COMPUTE_SERVICE, "Compute Engine", skus)
    assert run(tmp_path, "us-central1") == 1
    assert not (tmp_path / "prices.json").exists()
    err = capsys.readouterr().err
    assert "no SKU for gpus.nvidia-l4.spot" in err and "2 SKUs for families.g2.vcpu.on_demand" in err
    assert "gpus.nvidia-l4" in err and "families.g2" in err
    # --keep-missing keeps those entries from the current table, and says which.
    (tmp_path / "prices.json").write_text(pricing.TABLE_FILE.read_text())
    assert run(tmp_path, "us-central1", "--keep-missing") == 0
    out = capsys.readouterr().out
    assert "kept from the current table: families.g2, gpus.nvidia-l4" in out
    new = json.loads((tmp_path / "prices.json").read_text())
    assert new["regions"]["us-central1"]["gpus"][R.L4] == [us.gpus[R.L4].on_demand, us.gpus[R.L4].spot]


def test_a_sku_in_another_unit_is_refused(fake, tmp_path, capsys) -> None:
    skus = catalog(pricing.REGIONS["us-central1"], "us-central1", "Americas")
    for s in skus:
        if s["description"] == "SSD backed PD Capacity in Americas":
            s["pricingInfo"][-1]["pricingExpression"]["usageUnit"] = "GiBy.h"
    fake.add_service(price_catalog.COMPUTE_SERVICE, "Compute Engine", skus)
    assert run(tmp_path, "us-central1") == 1
    assert "is priced per 'GiBy.h', expected 'GiBy.mo'" in capsys.readouterr().err


def test_refusals_and_bad_arguments(fake, tmp_path, capsys, monkeypatch) -> None:
    fake.fail("GET", "/skus", 403, times=None)
    fake.add_service(price_catalog.COMPUTE_SERVICE, "Compute Engine", [])
    assert run(tmp_path, "us-central1") == 1 and "403" in capsys.readouterr().err
    assert run(tmp_path, "US Central") == 2
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "none.json"))
    monkeypatch.setenv("GCE_METADATA_HOST", f"127.0.0.1:{free_port()}")
    monkeypatch.setenv("NO_GCE_CHECK", "True")
    assert price_catalog.main(["--out", str(tmp_path / "p.json"), "us-central1"]) == 3
    assert "application-default" in capsys.readouterr().err
