"""The price catalog: what one trainer VM costs per hour, Spot and on demand.

SOURCE: Google Cloud's public list prices, in USD, as of the table's date (CATALOG_DATE): the
table is stacks/prices.json, regenerated from the Cloud Billing Catalog API by `make prices`
(`stacks.price_catalog`, with your credentials) or entered by hand from the pricing pages
(cloud.google.com/compute/vm-instance-pricing, /compute/gpus-pricing, /compute/disks-image-pricing).
They are LIST PRICES TO BE CHECKED before they are relied on: no discounts (committed use, sustained
use), no taxes, and Spot prices change up to once a month (per region): `make cost` warns when the
table is older than that. An experiment's `[cost] spot_per_hour` / `on_demand_per_hour` override
the whole catalog.

How Google prices the families, and so how this catalog is laid out:
- n1: the machine (per vCPU + per GB of memory) plus each attached GPU, priced per GPU type.
- a2, g2: published per machine type, built from per-vCPU, per-GB and per-GPU rates of the family
  (a2-highgpu-1g = 12 vCPU x 0.031611 + 85 GB x 0.004237 + 1 A100 x 2.933908 = 3.6731/h), so the
  same three rates reproduce every size.
- a3: published per machine type only; the GPU rate here is the machine price / 8 with vCPUs and
  memory folded in (vCPU and GB rates 0). a3-highgpu-1g/2g/4g are Spot (or flex-start) only:
  their "on-demand" figure is the a3-highgpu-8g rate per GPU, a comparison, not an offer.
- e2 (a pool's CPU-only coordinator): per vCPU + per GB, like n1.
- disks: boot pd-balanced and checkpoint pd-ssd cost the same Spot or not; Local SSD attached
  to a Spot VM gets the Spot rate.

Updating: `make prices` (PRICE_REGIONS="us-central1 europe-west4" for more regions) rewrites
stacks/prices.json from the Catalog API and refuses to write a table it could not fill; regions
missing from the table use DEFAULT_REGION's prices and say so. The test
`tests/stacks/test_pricing.py` checks that every machine type and GPU the validation accepts has
a price, and pins a few published machine prices as worked examples.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

from stacks import gcp_rules as R
from stacks.experiment import Experiment
from stacks.pool import layout

#: The price table (`stacks.price_catalog` writes it).
TABLE_FILE = Path(__file__).resolve().parent / "prices.json"
#: Spot prices may change this often; an older catalog is flagged as possibly stale.
SPOT_PRICE_PERIOD_DAYS = 30
HOURS_PER_MONTH = 730  # Google's convention for per-month disk prices


@dataclass(frozen=True)
class Rate:
    """One price in USD per hour (per unit: per vCPU, per GB, per GPU or per GB-hour)."""

    on_demand: float
    spot: float

    def __mul__(self, k: float) -> Rate:
        return Rate(self.on_demand * k, self.spot * k)

    def __add__(self, other: Rate) -> Rate:
        return Rate(self.on_demand + other.on_demand, self.spot + other.spot)


ZERO = Rate(0.0, 0.0)


@dataclass(frozen=True)
class FamilyRates:
    """Per-vCPU and per-GB-of-memory hourly rates of one machine family."""

    vcpu: Rate
    memory_gb: Rate


@dataclass(frozen=True)
class RegionPrices:
    """Every rate of one region."""

    families: dict[str, FamilyRates]
    gpus: dict[str, Rate]
    #: Disks per GB-month (pd-balanced boot, pd-ssd checkpoint; local-ssd Spot-discounted).
    disk_gb_month: dict[str, Rate] = field(default_factory=dict)


def _region(table: dict) -> RegionPrices:
    pair = lambda v: Rate(float(v[0]), float(v[1]))  # noqa: E731 - [on demand, Spot]
    return RegionPrices(
        families={k: FamilyRates(vcpu=pair(v["vcpu"]), memory_gb=pair(v["memory_gb"]))
                  for k, v in table["families"].items()},
        gpus={k: pair(v) for k, v in table["gpus"].items()},
        disk_gb_month={k: pair(v) for k, v in table["disk_gb_month"].items()})


def load_table(path: Path = TABLE_FILE) -> tuple[date, str, dict[str, RegionPrices]]:
    """(the table's date, its source, its regions' prices)."""
    data = json.loads(path.read_text())
    return (date.fromisoformat(data["catalog_date"]), data["source"],
            {region: _region(t) for region, t in data["regions"].items()})


CATALOG_DATE, CATALOG_SOURCE, _REGIONS = load_table()
SOURCE = f"Google Cloud list prices ({CATALOG_SOURCE})"
US_CENTRAL1 = _REGIONS["us-central1"]

#: Watching a run (docs/watch.md), from cloud.google.com/stackdriver/pricing (Google Cloud
#: Observability pricing) and cloud.google.com/monitoring/alerts/cost-control, as of OBSERVABILITY_DATE:
#: Cloud Logging storage per GiB, beyond a free allotment per project and month; Cloud Monitoring's
#: chargeable metric data (user-defined log-based metrics and custom metrics) per MiB, beyond a
#: free allotment per billing account and month; an alert condition per month.
OBSERVABILITY_DATE = date(2026, 3, 1)
LOGGING_USD_PER_GIB, LOGGING_FREE_GIB_MONTH = 0.50, 50
MONITORING_USD_PER_MIB, MONITORING_FREE_MIB_MONTH = 0.258, 150
ALERT_CONDITION_USD_MONTH = 1.50
#: Bytes a metric point counts for (the same page): a scalar 8, a distribution 80.
POINT_BYTES, DISTRIBUTION_POINT_BYTES = 8, 80

#: Cloud Storage STANDARD class per GB-month (cloud.google.com/storage/pricing), list prices:
#: a region (us-central1's rate; most regions are within a few tenths of a cent) and the
#: multi-regions. Soft-deleted and noncurrent objects are billed at the same rate while kept.
GCS_STANDARD_GB_MONTH = {"region": 0.020, "multi-region": 0.026}
GCS_MULTI_REGIONS = ("US", "EU", "ASIA")
#: Secret Manager, per active (enabled or disabled) secret version and replica location per month
#: (cloud.google.com/secret-manager/pricing, list price; the first 6 active versions of a billing
#: account are free each month; an automatic replication policy bills as one location).
SECRET_VERSION_USD_MONTH = 0.06

DEFAULT_REGION = "us-central1"
#: The regions of the table; others use DEFAULT_REGION's prices.
REGIONS: dict[str, RegionPrices] = _REGIONS


@dataclass(frozen=True)
class Quote:
    """The hourly price of one experiment's VM, and where each number came from."""

    spot: float
    on_demand: float
    machine: Rate  # vCPUs, memory and GPUs
    disks: Rate
    region: str  # the region whose prices were used
    region_known: bool  # False: the experiment's region has no entry; DEFAULT_REGION's used
    overridden: tuple[str, ...]  # "spot" and/or "on_demand" when [cost] sets them
    on_demand_offered: bool  # False for the Spot/flex-only a3 sizes

    @property
    def source(self) -> str:
        parts = []
        if len(self.overridden) < 2:
            where = self.region if self.region_known else f"{self.region} prices (no entry for " \
                "this region)"
            parts.append(f"catalog of {CATALOG_DATE.isoformat()}, {where}, list prices")
        if self.overridden:
            parts.append(" and ".join(f"cost.{k}_per_hour" for k in self.overridden) + " set")
        return "; ".join(parts)


def region_prices(region: str) -> tuple[str, RegionPrices, bool]:
    if region in REGIONS:
        return region, REGIONS[region], True
    return DEFAULT_REGION, REGIONS[DEFAULT_REGION], False


def machine_rate(machine_type: str, gpu_type: str, gpu_count: int,
                 prices: RegionPrices = US_CENTRAL1) -> Rate:
    """vCPUs, memory and GPUs of one VM (KeyError for a type or GPU the catalog lacks)."""
    shape = R.MACHINE_TYPES.get(machine_type) or R.CPU_MACHINE_TYPES[machine_type]
    fam = prices.families[R.family(machine_type)]
    return fam.vcpu * shape.vcpus + fam.memory_gb * shape.memory_gb + prices.gpus[gpu_type] * \
        gpu_count


def disk_rate(exp: Experiment, prices: RegionPrices = US_CENTRAL1) -> Rate:
    d = prices.disk_gb_month
    gb_month = (
        d["pd-balanced"] * exp.machine.boot_disk_gb
        + d["pd-ssd"] * exp.disk.checkpoint_disk_gb
        + d["local-ssd"] * (exp.disk.local_ssd_count * R.LOCAL_SSD_GB)
    )
    return gb_month * (1 / HOURS_PER_MONTH)


def quote(exp: Experiment) -> Quote:
    """The experiment's hourly prices: the catalog's, unless `[cost]` overrides them."""
    m = exp.machine
    region, prices, known = region_prices(exp.gcp.region)
    machine = machine_rate(m.machine_type, m.gpu_type, m.gpu_count, prices)
    disks = disk_rate(exp, prices)
    total = machine + disks
    c = exp.cost
    overridden = tuple(k for k in ("spot", "on_demand") if getattr(c, f"{k}_per_hour") is not None)
    return Quote(
        spot=c.spot_per_hour if c.spot_per_hour is not None else total.spot,
        on_demand=c.on_demand_per_hour if c.on_demand_per_hour is not None else total.on_demand,
        machine=machine,
        disks=disks,
        region=region,
        region_known=known,
        overridden=overridden,
        on_demand_offered=not m.shape.spot_or_flex_only,
    )


@dataclass(frozen=True)
class PoolQuote:
    """The hourly price of a pool: the on-demand coordinator plus N workers as provisioned (Spot
    by default), and what the same pool would cost all on demand."""

    worker: Quote  # one worker VM: the experiment's machine, `[cost]` overrides applied
    coordinator: float  # the coordinator, on demand, with its disks (USD/h)
    coordinator_trains: bool
    min_workers: int
    max_workers: int
    spot_workers: bool  # machine.provisioning = "spot"

    def hourly(self, workers: int) -> float:
        per = self.worker.spot if self.spot_workers else self.worker.on_demand
        return self.coordinator + workers * per

    def on_demand_hourly(self, workers: int) -> float:
        return self.coordinator + workers * self.worker.on_demand


def pool_quote(exp: Experiment) -> PoolQuote:
    """The pool's prices (the experiment must have a `[pool]`)."""
    pool = layout("pool", exp)
    assert pool is not None
    m = exp.machine
    worker = quote(exp)
    _, prices, _ = region_prices(exp.gcp.region)
    if pool.coordinator_trains and pool.coordinator_machine_type == m.machine_type:
        coordinator = worker.on_demand  # the same VM on demand (an override applies too)
    else:
        gpus = m.gpu_count if pool.coordinator_trains else 0
        machine = machine_rate(pool.coordinator_machine_type, m.gpu_type, gpus, prices)
        d = prices.disk_gb_month
        disks = (d["pd-balanced"] * m.boot_disk_gb + d["pd-ssd"] * exp.disk.checkpoint_disk_gb
                 + d["local-ssd"] * (exp.disk.local_ssd_count * R.LOCAL_SSD_GB
                                     if pool.coordinator_trains else 0)) * (1 / HOURS_PER_MONTH)
        coordinator = (machine + disks).on_demand
    return PoolQuote(worker=worker, coordinator=coordinator,
                     coordinator_trains=pool.coordinator_trains, min_workers=pool.min_workers,
                     max_workers=pool.max_workers, spot_workers=m.provisioning == "spot")


def hourly_price(exp: Experiment) -> tuple[float, float]:
    """(Spot, on-demand) USD per hour of one VM of this experiment, overrides applied.

    The trainer's cost ledger records the price it runs at: `running_price(exp)`."""
    q = quote(exp)
    return q.spot, q.on_demand


def running_price(exp: Experiment) -> float:
    """USD per hour of the VM as the experiment provisions it (Spot or standard)."""
    spot, on_demand = hourly_price(exp)
    return spot if exp.machine.provisioning == "spot" else on_demand


def catalog_age_days(today: date | None = None) -> int:
    return ((today or date.today()) - CATALOG_DATE).days


#: The trainer flags that carry the prices to its cost ledger (see `trainer_price_args`).
PRICE_FLAG, ON_DEMAND_PRICE_FLAG = "--price-per-hour", "--on-demand-price-per-hour"


def trainer_price_args(exp: Experiment) -> list[str]:
    """The `python -m trainer run` arguments that tell the ledger what an hour of this VM costs
    (as provisioned) and what it would cost on demand; plain decimals, safe in a shell line."""
    _, on_demand = hourly_price(exp)
    return [PRICE_FLAG, f"{running_price(exp):.6f}", ON_DEMAND_PRICE_FLAG, f"{on_demand:.6f}"]


def coordinator_price_args(exp: Experiment) -> list[str]:
    """`trainer_price_args` for a pool's coordinator: it runs on demand, so both prices are its
    on-demand price (the ledger then records no Spot savings for it)."""
    price = f"{pool_quote(exp).coordinator:.6f}"
    return [PRICE_FLAG, price, ON_DEMAND_PRICE_FLAG, price]
