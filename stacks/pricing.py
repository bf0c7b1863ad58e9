"""The price catalog: what one trainer VM costs per hour, Spot and on demand.

SOURCE: Google Cloud's public list prices (cloud.google.com/compute/vm-instance-pricing,
/compute/gpus-pricing, /compute/disks-image-pricing), us-central1, in USD, as known on
CATALOG_DATE. They are LIST PRICES TO BE CHECKED before they are relied on: no discounts
(committed use, sustained use), no taxes, and Spot prices change up to once a month (per region).
An experiment's `[cost] spot_per_hour` / `on_demand_per_hour` override the whole catalog.

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

Updating: change the numbers below (and CATALOG_DATE) from the pricing pages; add a region with
a different price to REGIONS (missing regions use DEFAULT_REGION's prices and say so). The test
`tests/stacks/test_pricing.py` checks that every machine type and GPU the validation accepts has
a price, and pins a few published machine prices as worked examples.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import date

from stacks import gcp_rules as R
from stacks.experiment import Experiment
from stacks.pool import layout

CATALOG_DATE = date(2025, 6, 1)
SOURCE = "Google Cloud list prices (cloud.google.com/compute/vm-instance-pricing), us-central1"
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


US_CENTRAL1 = RegionPrices(
    families={
        "n1": FamilyRates(vcpu=Rate(0.031611, 0.006655), memory_gb=Rate(0.004237, 0.000892)),
        "a2": FamilyRates(vcpu=Rate(0.031611, 0.012644), memory_gb=Rate(0.004237, 0.001695)),
        "g2": FamilyRates(vcpu=Rate(0.024988, 0.009995), memory_gb=Rate(0.002927, 0.001171)),
        "a3": FamilyRates(vcpu=ZERO, memory_gb=ZERO),  # folded into the GPU rate
        "e2": FamilyRates(vcpu=Rate(0.021811, 0.006543), memory_gb=Rate(0.002923, 0.000877)),
    },
    gpus={
        # n1: attached GPUs, priced on their own
        R.T4: Rate(0.35, 0.14),
        R.V100: Rate(2.48, 0.992),
        R.P100: Rate(1.46, 0.584),
        R.P4: Rate(0.60, 0.24),
        # built in: a2 (A100 40 GB, A100 80 GB), g2 (L4), a3 (H100, whole machine / 8)
        R.A100_40: Rate(2.933908, 1.173563),
        R.A100_80: Rate(3.969174, 1.587670),
        R.L4: Rate(0.560150, 0.224060),
        R.H100: Rate(11.061250, 3.720000),
        R.H100_MEGA: Rate(12.170000, 4.090000),
    },
    disk_gb_month={
        "pd-balanced": Rate(0.10, 0.10),
        "pd-ssd": Rate(0.17, 0.17),
        "local-ssd": Rate(0.08, 0.048),
    },
)

#: Cloud Storage STANDARD class per GB-month (cloud.google.com/storage/pricing), list prices:
#: a region (us-central1's rate; most regions are within a few tenths of a cent) and the
#: multi-regions. Soft-deleted and noncurrent objects are billed at the same rate while kept.
GCS_STANDARD_GB_MONTH = {"region": 0.020, "multi-region": 0.026}
GCS_MULTI_REGIONS = ("US", "EU", "ASIA")

DEFAULT_REGION = "us-central1"
#: Regions whose prices are known to differ get their own entry; others use DEFAULT_REGION's.
REGIONS: dict[str, RegionPrices] = {DEFAULT_REGION: US_CENTRAL1}


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
