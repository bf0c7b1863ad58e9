"""The same job under each provisioning policy, side by side: Spot, flex-start and on demand, and
what the chosen capacity options add (`make cost`, beside the bucket's storage).

- **Spot**: the VM hours at the assumed Spot goodput, at the Spot price. Time waiting for
  capacity costs no money, only time (the ledger shows it: `trainer status`).
- **flex-start**: never preempted, so on-demand goodput; but every VM ends after
  `capacity.flex_max_run_hours`, and each costs a stop before its end
  (`flex_stop_before_minutes`) plus a start-up and restore on the next (`cost.restart_minutes`).
  The price is the on-demand machine less the flex-start discount ("up to 53% for vCPUs, memory
  and GPUs", the resize-request documentation) plus the disks: a best case, so it says so;
  `[cost] flex_start_per_hour` replaces it with a quoted price. Time queued is not billed.
- **on demand**: the VM hours at the on-demand goodput and price.
- **fallback** (`capacity.on_demand_fallback_minutes`): Spot while there is Spot; a stockout
  longer than the threshold runs on demand instead of waiting: each such hour costs the on-demand
  price (and a switch, a save and a restore, each way). The capacity simulation in BENCHMARKS.md
  shows the timeline and the cost for stockouts of several lengths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from stacks import pricing
from stacks.experiment import Experiment

#: Flex-start's discount on the machine (vCPUs, memory, GPUs), at its documented best.
FLEX_START_DISCOUNT = 0.53


@dataclass(frozen=True)
class Policies:
    training_hours: float
    spot: float
    spot_hours: float
    flex: float
    flex_hours: float
    flex_vms: int
    flex_per_hour: float
    flex_quoted: bool  # [cost] flex_start_per_hour set
    on_demand: float
    on_demand_hours: float


def flex_start_per_hour(exp: Experiment) -> tuple[float, bool]:
    """(USD per hour of one flex-start VM with its disks, whether [cost] quoted it)."""
    if exp.cost.flex_start_per_hour is not None:
        return exp.cost.flex_start_per_hour, True
    q = pricing.quote(exp)
    return q.machine.on_demand * (1 - FLEX_START_DISCOUNT) + q.disks.on_demand, False


def compare(exp: Experiment) -> Policies:
    c, cap = exp.cost, exp.capacity
    q = pricing.quote(exp)
    training = exp.trainer.steps / (c.steps_per_second * 3600)
    spot_h, od_h = training / c.expected_goodput, training / c.on_demand_goodput
    per_vm_overhead_h = (cap.flex_stop_before_minutes + c.restart_minutes) / 60
    usable = max(cap.flex_max_run_hours - per_vm_overhead_h, 1 / 60)
    vms = max(1, math.ceil(od_h / usable))
    flex_h = od_h + (vms - 1) * per_vm_overhead_h + cap.flex_stop_before_minutes / 60
    flex_rate, quoted = flex_start_per_hour(exp)
    return Policies(training, spot_h * q.spot, spot_h, flex_h * flex_rate, flex_h, vms, flex_rate, quoted,
                    od_h * q.on_demand, od_h)


def _money(x: float) -> str:
    return f"${x:,.2f}" if abs(x) >= 1 else f"${x:,.4f}"


def policy_lines(exp: Experiment) -> list[str]:
    """The `make cost` lines that compare the policies and describe the chosen one."""
    p, m, cap = compare(exp), exp.machine, exp.capacity
    q = pricing.quote(exp)
    flex_note = "quoted in [cost]" if p.flex_quoted else f"best case: on demand less {FLEX_START_DISCOUNT:.0%}"
    lines = [
        f"  by policy         Spot {_money(p.spot)} ({p.spot_hours:,.1f} h of VM)   flex-start {_money(p.flex)} "
        f"({p.flex_hours:,.1f} h in {p.flex_vms} VM(s) of at most {cap.flex_max_run_hours} h; "
        f"{_money(p.flex_per_hour)}/h, {flex_note}; queue time unbilled)   on-demand {_money(p.on_demand)} "
        f"({p.on_demand_hours:,.1f} h)",
    ]
    chosen = {"spot": "Spot", "standard": "on demand", "flex-start": "flex-start"}[m.provisioning]
    extra = []
    if cap.on_demand_fallback_minutes is not None:
        extra.append(f"on-demand fallback after {cap.on_demand_fallback_minutes} min without Spot: each hour "
                     f"of a longer stockout costs {_money(q.on_demand)} instead of waiting, plus a save and a "
                     f"restore each way (BENCHMARKS.md: capacity simulation)")
    if cap.machine_types:
        extra.append("ranked machine types: " + ", ".join(cap.machine_types)
                     + " cost more per hour than " + m.machine_type + " when the group takes them")
    lines.append(f"  chosen policy     {chosen}" + ("" if not extra else "; " + "; ".join(extra)))
    return lines
