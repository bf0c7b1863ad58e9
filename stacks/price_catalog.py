"""`python -m stacks.price_catalog [REGION ...]` (`make prices`): stacks/prices.json regenerated from
the Cloud Billing Catalog API, with your application-default credentials.

One `services.skus.list` of Compute Engine (service 6F81-5844-456A), every page
(cloud.google.com/billing/v1/how-tos/catalog-api; `GET /v1/services/ID/skus?currencyCode=USD`,
5,000 SKUs a page, `nextPageToken`). A SKU prices one component of a VM in a set of regions: a
family's vCPU ("N1 Predefined Instance Core running in Americas") or memory ("... Instance Ram
..."), a GPU ("Nvidia L4 GPU running in ..."), a disk's GB-month ("SSD backed PD Capacity"). For each
rate of the table (`stacks.pricing.RegionPrices`: per family vCPU and GB, per GPU, per disk type;
on demand and Spot) and each region, exactly one SKU must match: its description (`WANTED`), its
usage type (OnDemand, or Preemptible for Spot; never a commitment), a region among its
`serviceRegions`, and the usage unit the rate is in (h, GiBy.h, GiBy.mo). Its price is the newest
`pricingInfo`'s first non-zero tier (units + nanos).

a3 is priced per machine type only on the pricing page, so the table folds its vCPUs and memory
into the GPU rate (`stacks.pricing`): a3's GPU rate here is (vCPUs x core rate + GB x memory rate)
/ GPUs + the GPU's own rate, of its 8-GPU machine type, and its vCPU and GB rates are 0.

Nothing is written unless every rate was found once: a missing or ambiguous SKU is listed and the
command exits 1 (`--keep-missing` keeps those rates from the current table, and says which). The
table records each rate's SKU id, the date, and the regions.

Exit status: 0 written, 1 a rate not found (or the API refused), 2 bad arguments, 3 no credentials.
`SPOTTRAIN_BILLING_API` points the calls at another endpoint (the loopback fake in the tests).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from datetime import date
from pathlib import Path
from typing import Any, Callable

from stacks import gcp_rules as R
from stacks import pricing

COMPUTE_SERVICE = "6F81-5844-456A"
DEFAULT_BILLING_API = "https://cloudbilling.googleapis.com/v1"
PAGE_SIZE = 5000

_GPU_NAMES = {R.T4: "Tesla T4", R.V100: "Tesla V100", R.P100: "Tesla P100", R.P4: "Tesla P4",
              R.A100_40: "Tesla A100", R.A100_80: "A100 80GB", R.L4: "L4", R.H100: "H100 80GB",
              R.H100_MEGA: "H100 80GB Mega"}
#: a3's 8-GPU machine type per GPU (its vCPUs and memory are folded into the GPU rate).
_A3_MACHINE = {R.H100: "a3-highgpu-8g", R.H100_MEGA: "a3-megagpu-8g"}
_SPOT = r"(?:Spot Preemptible )?"
_IN = r" (?:attached to Spot Preemptible VMs )?running in "


def wanted() -> dict[str, tuple[re.Pattern[str], str]]:
    """Each rate's key ("families.n1.vcpu", "gpus.nvidia-l4", "disk_gb_month.pd-ssd", and the a3
    parts "a3.vcpu", "a3.memory_gb") -> (its description pattern, its usage unit)."""
    out: dict[str, tuple[re.Pattern[str], str]] = {}
    for fam in pricing.US_CENTRAL1.families:
        name = fam.upper()
        predefined = "(?:Predefined )?" if fam == "n1" else ""
        key = "a3" if fam == "a3" else f"families.{fam}"
        out[f"{key}.vcpu"] = (re.compile(rf"^{_SPOT}{name} {predefined}Instance Core running in "), "h")
        out[f"{key}.memory_gb"] = (re.compile(rf"^{_SPOT}{name} {predefined}Instance Ram running in "), "GiBy.h")
    for gpu, label in _GPU_NAMES.items():
        out[f"gpus.{gpu}"] = (re.compile(rf"^{_SPOT}Nvidia {re.escape(label)} GPU{_IN}"), "h")
    out["disk_gb_month.pd-balanced"] = (re.compile(r"^Balanced PD Capacity( in |$)"), "GiBy.mo")
    out["disk_gb_month.pd-ssd"] = (re.compile(r"^SSD backed PD Capacity( in |$)"), "GiBy.mo")
    out["disk_gb_month.local-ssd"] = (re.compile(rf"^{_SPOT}SSD backed Local Storage( attached to Spot "
                                                 r"Preemptible VMs)?( in |$)"), "GiBy.mo")
    return out


def price_of(sku: dict[str, Any]) -> float | None:
    """USD per usage unit: the newest pricing's first non-zero tier."""
    infos = sorted(sku.get("pricingInfo") or [], key=lambda p: p.get("effectiveTime", ""))
    if not infos:
        return None
    expression = infos[-1].get("pricingExpression") or {}
    for tier in expression.get("tieredRates") or []:
        unit = tier.get("unitPrice") or {}
        if unit.get("currencyCode", "USD") != "USD":
            return None
        value = int(unit.get("units") or 0) + int(unit.get("nanos") or 0) / 1e9
        if value > 0:
            return value
    return None


def match(skus: list[dict[str, Any]], region: str) -> tuple[dict[str, tuple[float, str]], list[str]]:
    """{rate key + ".on_demand"/".spot": (price, SKU id)} for one region, and what went wrong."""
    found: dict[str, list[tuple[float, str]]] = {}
    problems: list[str] = []
    patterns = wanted()
    for sku in skus:
        category = sku.get("category") or {}
        if category.get("resourceFamily") not in ("Compute", "Storage") or region not in (sku.get("serviceRegions") or []):
            continue
        usage = category.get("usageType")
        if usage not in ("OnDemand", "Preemptible"):
            continue  # commitments, reservations
        description = sku.get("description", "")
        spot = usage == "Preemptible"
        for key, (pattern, unit) in patterns.items():
            if not pattern.match(description):
                continue
            if ("Spot" in description or "Preemptible" in description) != spot:
                continue  # a Spot description under an on-demand usage type, or the reverse
            expression = (sorted(sku.get("pricingInfo") or [], key=lambda p: p.get("effectiveTime", ""))
                          or [{}])[-1].get("pricingExpression") or {}
            if expression.get("usageUnit") != unit:
                problems.append(f"{key}: SKU {sku.get('skuId')} ({description!r}) is priced per "
                                f"{expression.get('usageUnit')!r}, expected {unit!r}")
                continue
            value = price_of(sku)
            if value is None:
                problems.append(f"{key}: SKU {sku.get('skuId')} ({description!r}) has no USD price")
                continue
            found.setdefault(f"{key}.{'spot' if spot else 'on_demand'}", []).append((value, str(sku.get("skuId"))))
    out: dict[str, tuple[float, str]] = {}
    for key in patterns:
        for model in ("on_demand", "spot"):
            k = f"{key}.{model}"
            hits = found.get(k, [])
            if key.startswith("disk_gb_month.pd-") and model == "spot":
                continue  # persistent disks cost the same Spot or not: the on-demand SKU prices both
            if len(hits) == 1:
                out[k] = hits[0]
            elif not hits:
                problems.append(f"{region}: no SKU for {k}")
            else:
                problems.append(f"{region}: {len(hits)} SKUs for {k}: {', '.join(h[1] for h in hits)}")
    for key in ("disk_gb_month.pd-balanced", "disk_gb_month.pd-ssd"):
        if f"{key}.on_demand" in out:
            out[f"{key}.spot"] = out[f"{key}.on_demand"]
    return out, problems


def region_table(rates: dict[str, tuple[float, str]], old: dict[str, Any] | None = None
                 ) -> tuple[dict[str, Any], dict[str, str], list[str], list[str]]:
    """The region's part of prices.json (a3 folded), its rate -> SKU id record, the entries kept
    from `old` (the current table's region) and those neither found nor kept."""
    table: dict[str, Any] = {"families": {}, "gpus": {}, "disk_gb_month": {}}
    skus: dict[str, str] = {}
    kept: list[str] = []
    missing: list[str] = []

    def pair(key: str) -> list[float] | None:
        if not all(f"{key}.{m}" in rates for m in ("on_demand", "spot")):
            return None
        for m in ("on_demand", "spot"):
            skus[f"{key}.{m}"] = rates[f"{key}.{m}"][1]
        return [round(rates[f"{key}.on_demand"][0], 6), round(rates[f"{key}.spot"][0], 6)]

    def put(part: str, key: str, value: Any) -> None:
        if value is None and old is not None and key in old.get(part, {}):
            value = old[part][key]
            kept.append(f"{part}.{key}")
        if value is None:
            missing.append(f"{part}.{key}")
        table[part][key] = value

    for fam in pricing.US_CENTRAL1.families:
        if fam == "a3":
            put("families", "a3", {"vcpu": [0.0, 0.0], "memory_gb": [0.0, 0.0]})
            continue
        vcpu, memory = pair(f"families.{fam}.vcpu"), pair(f"families.{fam}.memory_gb")
        put("families", fam, {"vcpu": vcpu, "memory_gb": memory} if vcpu and memory else None)
    for gpu in _GPU_NAMES:
        rate = pair(f"gpus.{gpu}")
        if gpu in _A3_MACHINE and rate is not None:
            shape = R.MACHINE_TYPES[_A3_MACHINE[gpu]]
            cores, ram = pair("a3.vcpu"), pair("a3.memory_gb")
            rate = None if cores is None or ram is None else [
                round(rate[i] + (shape.vcpus * cores[i] + shape.memory_gb * ram[i]) / shape.gpu_count, 6)
                for i in (0, 1)]
        put("gpus", gpu, rate)
    for disk in ("pd-balanced", "pd-ssd", "local-ssd"):
        put("disk_gb_month", disk, pair(f"disk_gb_month.{disk}"))
    return table, skus, kept, missing


def dump(table: dict[str, Any]) -> str:
    """prices.json's text: sorted keys, each [on demand, Spot] pair on one line."""
    text = json.dumps(table, indent=1, sort_keys=True)
    return re.sub(r"\[\s+([-0-9.e]+),\s+([-0-9.e]+)\s+\]", r"[\1, \2]", text) + "\n"


def list_skus(client: Any, service: str = COMPUTE_SERVICE, *, api: str | None = None) -> list[dict[str, Any]]:
    base = (api or os.environ.get("SPOTTRAIN_BILLING_API") or DEFAULT_BILLING_API).rstrip("/")
    out: list[dict[str, Any]] = []
    query: dict[str, Any] = {"currencyCode": "USD", "pageSize": PAGE_SIZE}
    while True:
        page = client.request("GET", f"{base}/services/{service}/skus", query=query) or {}
        out += page.get("skus", [])
        token = page.get("nextPageToken")
        if not token:
            return out
        query = {**query, "pageToken": token}


def regenerate(skus: list[dict[str, Any]], regions: list[str], *, today: date, current: dict[str, Any] | None = None,
               keep_missing: bool = False) -> tuple[dict[str, Any] | None, list[str]]:
    """The new table (None when a rate has no single SKU and is not kept), and the lines to say:
    what was done, or why nothing was."""
    lines: list[str] = []
    failures: list[str] = []
    out: dict[str, Any] = {"catalog_date": today.isoformat(), "currency": "USD",
                           "source": f"Cloud Billing Catalog API, service {COMPUTE_SERVICE} (make prices)",
                           "regions": {}, "skus": {}}
    for region in regions:
        rates, problems = match(skus, region)
        old = (current or {}).get("regions", {}).get(region) if keep_missing else None
        table, ids, kept, missing = region_table(rates, old)
        if missing:
            failures += problems + [f"{region}: so these cannot be priced: {', '.join(missing)}"]
            continue
        out["regions"][region] = table
        out["skus"][region] = ids
        lines.append(f"{region}: {len(ids)} rates from SKUs"
                     + (f"; kept from the current table: {', '.join(kept)}" if kept else ""))
    if failures:
        return None, failures
    return out, lines


def changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """One line per entry whose price moved, for the human who commits the table."""
    out = []
    for region, table in new["regions"].items():
        before = old.get("regions", {}).get(region)
        if before is None:
            out.append(f"{region}: new")
            continue
        for part in ("families", "gpus", "disk_gb_month"):
            for key, value in table[part].items():
                if before.get(part, {}).get(key) != value:
                    out.append(f"{region} {part}.{key}: {before.get(part, {}).get(key)} -> {value}")
    return out


def main(argv: list[str] | None = None, *, today: date | None = None,
         token: Callable[[], tuple[str, float]] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stacks.price_catalog", description=__doc__.split("\n\n")[0])
    p.add_argument("regions", nargs="*", help=f"regions to price (default: those in the table, "
                                              f"else {pricing.DEFAULT_REGION})")
    p.add_argument("--out", type=Path, default=pricing.TABLE_FILE, help="where to write (default stacks/prices.json)")
    p.add_argument("--keep-missing", action="store_true", help="keep rates no SKU matched from the current table")
    args = p.parse_args(argv)
    for r in args.regions:
        if not R.REGION.match(r):
            print(f"prices: {r!r} is not a region name such as us-central1", file=sys.stderr)
            return 2
    current = json.loads(args.out.read_text()) if args.out.exists() else {}
    regions = args.regions or sorted(current.get("regions", {})) or [pricing.DEFAULT_REGION]
    from trainer.cloud.gce import ApiError, Client

    if token is None:
        from stacks.preflight import adc_token

        try:
            token = adc_token()
            token()
        except Exception as e:  # google.auth raises several kinds; none is worth a traceback here
            print(f"prices: no usable application-default credentials ({type(e).__name__}); run `gcloud auth "
                  "application-default login`", file=sys.stderr)
            return 3
    try:
        skus = list_skus(Client(token=token, retries=2))
    except ApiError as e:
        print(f"prices: the Cloud Billing Catalog API answered {e.code} {e.status}: {e.message}", file=sys.stderr)
        return 1
    table, lines = regenerate(skus, regions, today=today or date.today(), current=current,
                              keep_missing=args.keep_missing)
    if table is None:
        print(f"prices: {len(skus)} SKUs read; not writing {args.out}: some rates have no single SKU "
              "(--keep-missing keeps those from the current table):", file=sys.stderr)
        print("\n".join(f"  {line}" for line in lines), file=sys.stderr)
        return 1
    moved = changes(current, table)
    args.out.write_text(dump(table))
    print(f"prices: {len(skus)} SKUs read; wrote {args.out} ({table['catalog_date']}):")
    print("\n".join(f"  {line}" for line in lines + (["changed:"] + moved if moved else ["no price changed"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
