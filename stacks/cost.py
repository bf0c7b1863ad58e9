"""`python -m stacks.cost [FILE|DIR]`: what an experiment should cost, Spot against on demand.

Expected cost of the configured steps = steps / (steps_per_second x 3600) hours of training,
divided by the goodput (the productive share of VM time) to get VM hours, times the hourly price
(`stacks.pricing`). Throughput and goodput are assumptions from the experiment's `[cost]`
section (documented defaults otherwise) and are printed beside every result, so nobody takes
them for measurements. Savings = on-demand cost - Spot cost, and its share of the on-demand cost.

A `[pool]` is priced as the on-demand coordinator plus its Spot workers, at the fewest and at the
most nodes (`stacks.pricing.pool_quote`). `steps_per_second` is then the pool's throughput at its
most nodes, assumed to scale with the node count (the global batch stays constant), so the run
takes max/min times as long at the fewest nodes; the comparison is the same pool all on demand at
its most nodes.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from datetime import date
from pathlib import Path

from stacks import pricing
from stacks.experiment import Experiment
from stacks.load import ExperimentError, ExperimentFile, display, load_all


@dataclass(frozen=True)
class Estimate:
    """The expected cost of one experiment's run, Spot and on demand."""

    steps: int
    steps_per_second: float
    spot_goodput: float
    on_demand_goodput: float
    quote: pricing.Quote

    @property
    def training_hours(self) -> float:
        """Hours of productive training the steps take at the assumed throughput."""
        return self.steps / (self.steps_per_second * 3600)

    @property
    def spot_hours(self) -> float:
        return self.training_hours / self.spot_goodput

    @property
    def on_demand_hours(self) -> float:
        return self.training_hours / self.on_demand_goodput

    @property
    def spot_cost(self) -> float:
        return self.spot_hours * self.quote.spot

    @property
    def on_demand_cost(self) -> float:
        return self.on_demand_hours * self.quote.on_demand

    @property
    def savings(self) -> float:
        return self.on_demand_cost - self.spot_cost

    @property
    def savings_pct(self) -> float:
        return 100 * self.savings / self.on_demand_cost if self.on_demand_cost else 0.0


def estimate(exp: Experiment) -> Estimate:
    c = exp.cost
    return Estimate(
        steps=exp.trainer.steps,
        steps_per_second=c.steps_per_second,
        spot_goodput=c.expected_goodput,
        on_demand_goodput=c.on_demand_goodput,
        quote=pricing.quote(exp),
    )


def _money(x: float) -> str:
    return f"${x:,.2f}" if abs(x) >= 1 else f"${x:,.4f}"


def _hours(h: float) -> str:
    return f"{h:,.1f} h" if h >= 1 else f"{h * 60:,.0f} min"


def _assumed(exp: Experiment, key: str) -> str:
    return "set in [cost]" if key in exp.cost.model_fields_set else "default"


def describe(e: ExperimentFile, today: date | None = None) -> list[str]:
    """The cost lines `make demo` and the `cost` command print for one experiment."""
    if e.spec.pool is not None:
        return describe_pool(e, today)
    exp, est = e.spec, estimate(e.spec)
    q, m = est.quote, exp.machine
    gpus = f"{m.gpu_count} x {m.gpu_type}"
    lines = [
        f"cost of {e.name} ({display(e.path)}): {m.machine_type} with {gpus}, "
        f"{exp.gcp.region}, provisioning {m.provisioning}",
        f"  hourly price      Spot {_money(q.spot)}/h   on-demand {_money(q.on_demand)}/h   "
        f"(one VM with its disks; {q.source})",
        f"  assumed           {exp.trainer.steps:,} steps at {est.steps_per_second:g} steps/s "
        f"({_assumed(exp, 'steps_per_second')}) = {_hours(est.training_hours)} of training; "
        f"goodput {est.spot_goodput:.0%} on Spot ({_assumed(exp, 'expected_goodput')}), "
        f"{est.on_demand_goodput:.0%} on demand",
        f"  expected cost     Spot {_money(est.spot_cost)} ({_hours(est.spot_hours)} of VM)   "
        f"on-demand {_money(est.on_demand_cost)} ({_hours(est.on_demand_hours)} of VM)",
        f"  savings           {_money(est.savings)} ({est.savings_pct:.0f}%) with Spot"
        + ("" if m.provisioning == "spot" else
           ' (not taken: provisioning = "standard")'),
    ]
    if not q.on_demand_offered:
        lines.append(f"  note              {m.machine_type} is not offered on demand; the "
                     "on-demand figure is the a3-highgpu-8g rate per GPU, for comparison")
    age = pricing.catalog_age_days(today)
    if len(q.overridden) < 2 and age > pricing.SPOT_PRICE_PERIOD_DAYS:
        lines.append(f"  note              the catalog is {age} days old and Spot prices change "
                     "up to once a month: check them, or set [cost] spot_per_hour")
    lines.append("  These are estimates from list prices and stated assumptions, not a bill.")
    return lines


def describe_pool(e: ExperimentFile, today: date | None = None) -> list[str]:
    """A pool's cost lines: coordinator on demand + workers, at the fewest and the most nodes."""
    exp, est = e.spec, estimate(e.spec)
    pq = pricing.pool_quote(exp)
    m, p = exp.machine, exp.pool
    assert p is not None
    lo, hi = pq.min_workers, pq.max_workers
    role = "trains" if pq.coordinator_trains else "rendezvous only"
    ctype = p.coordinator_type(m)
    at_lo, at_hi, od_hi = pq.hourly(lo), pq.hourly(hi), pq.on_demand_hourly(hi)
    od_cost = est.on_demand_hours * od_hi
    hi_cost = est.spot_hours * at_hi
    lo_hours = est.spot_hours * p.max_nodes / p.min_nodes  # throughput scales with nodes
    savings = od_cost - hi_cost
    lines = [
        f"cost of {e.name} ({display(e.path)}): pool of {p.min_nodes}-{p.max_nodes} nodes of "
        f"{m.machine_type} with {m.gpu_count} x {m.gpu_type}, {exp.gcp.region}; coordinator "
        f"{ctype} on demand ({role}), workers {m.provisioning}",
        f"  hourly price      worker Spot {_money(pq.worker.spot)}/h   on-demand "
        f"{_money(pq.worker.on_demand)}/h   coordinator on demand {_money(pq.coordinator)}/h   "
        f"(each VM with its disks; {pq.worker.source})",
        f"  pool per hour     {_money(at_lo)}/h at {p.min_nodes} nodes (coordinator + {lo} "
        f"workers)   {_money(at_hi)}/h at {p.max_nodes} nodes (coordinator + {hi} workers)",
        f"  assumed           {exp.trainer.steps:,} steps at {est.steps_per_second:g} steps/s at "
        f"{p.max_nodes} nodes ({_assumed(exp, 'steps_per_second')}; proportional to the nodes) "
        f"= {_hours(est.training_hours)} of training; goodput {est.spot_goodput:.0%} on Spot "
        f"({_assumed(exp, 'expected_goodput')}), "
        f"{est.on_demand_goodput:.0%} on demand",
        f"  expected cost     {_money(lo_hours * at_lo)} at {p.min_nodes} nodes "
        f"({_hours(lo_hours)} of pool) to {_money(hi_cost)} at {p.max_nodes} nodes "
        f"({_hours(est.spot_hours)})   all on "
        f"demand {_money(od_cost)} at {p.max_nodes} nodes ({_hours(est.on_demand_hours)})",
        f"  savings           {_money(savings)} "
        f"({100 * savings / od_cost if od_cost else 0:.0f}%) at {p.max_nodes} nodes against the "
        "pool all on demand"
        + ("" if m.provisioning == "spot" else ' (not taken: provisioning = "standard")'),
    ]
    age = pricing.catalog_age_days(today)
    if len(pq.worker.overridden) < 2 and age > pricing.SPOT_PRICE_PERIOD_DAYS:
        lines.append(f"  note              the catalog is {age} days old and Spot prices change "
                     "up to once a month: check them, or set [cost] spot_per_hour")
    lines.append("  These are estimates from list prices and stated assumptions, not a bill.")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) > 1 or (args and args[0].startswith("-")):
        print("usage: python -m stacks.cost [EXPERIMENT.toml | DIR]", file=sys.stderr)
        return 2
    try:
        experiments = load_all(Path(args[0]) if args else None)
    except ExperimentError as err:
        print("\n".join(err.lines), file=sys.stderr)
        return 2
    for i, e in enumerate(experiments):
        if i:
            print()
        print("\n".join(describe(e)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
