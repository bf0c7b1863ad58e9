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

The checkpoint bucket's storage is its own section (`storage_estimate`): the checkpoints the
trainer keeps, plus what soft delete (and versioning, when on) keeps of every checkpoint it
rotates out, given the save interval and the retention, and, for a checkpoint uploaded in
parallel streams (a composite upload: `trainer.checkpoint.gcs_streams`), what soft delete keeps
of the parts it deletes after each upload.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from datetime import date

from stacks import pricing
from stacks.budget import BYTES_PER_PARAM, size_text
from stacks.experiment import Experiment
from stacks.load import ExperimentError, ExperimentFile, argument, display, load_all
from stacks.policy_cost import policy_lines
from trainer.checkpoint.stores import GcsStore
from trainer.checkpoint.tiers import GCS
from trainer.config import RunConfig


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


def _interval_text(seconds: float) -> str:
    """A save interval in the unit that reads best; never rounded to 0."""
    if seconds < 60:
        return f"{seconds:.3g} s"
    if seconds < 3600:
        return f"{seconds / 60:,.1f}".removesuffix(".0") + " min"
    return f"{seconds / 3600:,.1f}".removesuffix(".0") + " h"


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
    lines += policy_lines(exp)
    if not q.on_demand_offered:
        lines.append(f"  note              {m.machine_type} is not offered on demand; the "
                     "on-demand figure is the a3-highgpu-8g rate per GPU, for comparison")
    lines += catalog_lines(q, today)
    lines += storage_lines(exp, est.spot_hours)
    lines += watch_lines(exp, e.name, est.spot_hours)
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
    lines += catalog_lines(pq.worker, today)
    lines += storage_lines(exp, est.spot_hours)
    lines += watch_lines(exp, e.name, est.spot_hours)
    lines.append("  These are estimates from list prices and stated assumptions, not a bill.")
    return lines


def catalog_lines(q: pricing.Quote, today: date | None = None) -> list[str]:
    """The price table's date, and a warning when it is older than Spot prices last (unless
    [cost] overrides both prices)."""
    if len(q.overridden) == 2:
        return []
    age = pricing.catalog_age_days(today)
    lines = [f"  price catalog     {pricing.CATALOG_DATE.isoformat()} ({age} days old; {pricing.CATALOG_SOURCE})"]
    if age > pricing.SPOT_PRICE_PERIOD_DAYS:
        lines.append(f"  WARNING           the catalog is {age} days old and Spot prices change up to once a "
                     "month: `make prices` refreshes it from the Cloud Billing Catalog API, or set "
                     "[cost] spot_per_hour")
    return lines


# --- watching the run ----------------------------------------------------------------------------

#: Log lines an hour besides the step lines (boots, checkpoints, restores, the shipper's own).
OTHER_LOG_LINES_PER_HOUR = 30


def _entry_bytes(name: str) -> int:
    """The size of a step line's entry, as the VM's shipper writes it."""
    import json

    from trainer.cloud.log_shipper import entry

    record = {"__CURSOR": "s=0123456789abcdef;i=1a2b3c;b=" + "f" * 32 + ";m=9f8e7d;t=5f3e2d1c0b;x=0123456789abcdef",
              "__REALTIME_TIMESTAMP": "1767225600000000", "_BOOT_ID": "f" * 32, "_HOSTNAME": f"{name}-x1y2",
              "_SYSTEMD_UNIT": "spottrain.service", "_SYSTEMD_INVOCATION_ID": "e" * 32, "PRIORITY": "6",
              "MESSAGE": "2026-01-01T00:00:00.000 INFO trainer event=step step=12340/20000 loss=2.4210 "
                         "lr=3.000e-04 steps_per_s=1.00 tokens_per_s=65536 eta_s=7660"}
    resource = {"type": "gce_instance", "labels": {"project_id": "p" * 30, "instance_id": "1" * 19,
                                                   "zone": "us-central1-a"}}
    return len(json.dumps(entry(record, {"project": "p" * 30, "experiment": name, "run": f"runs/{name}"}, resource)))


def watch_lines(exp: Experiment, name: str, run_hours: float) -> list[str]:
    """What the run's logs, metrics and alerts cost (docs/watch.md), beside the VM."""
    from stacks import alert_rules
    from trainer.config import RunConfig

    every = exp.trainer.config.get("log_every_steps", RunConfig.model_fields["log_every_steps"].default)
    per_hour = exp.cost.steps_per_second * 3600 / max(1, int(every)) + OTHER_LOG_LINES_PER_HOUR
    size = _entry_bytes(name)
    gib = per_hour * run_hours * size / 2**30
    months = max(1.0, run_hours / pricing.HOURS_PER_MONTH)
    log_cost = max(0.0, gib - pricing.LOGGING_FREE_GIB_MONTH * months) * pricing.LOGGING_USD_PER_GIB
    # A point a minute while training: three distributions (steps/s, loss, step), the steps counter,
    # and the trainer's four custom gauges; the other metrics count rare events.
    mib = run_hours * 60 * (3 * pricing.DISTRIBUTION_POINT_BYTES + 5 * pricing.POINT_BYTES) / 2**20
    metric_cost = max(0.0, mib - pricing.MONITORING_FREE_MIB_MONTH * months) * pricing.MONITORING_USD_PER_MIB
    n = len(alert_rules.rules(exp))
    lines = [
        f"  logs              ~{_size(gib)} over the run ({per_hour:,.0f} entries/h of ~{size} B) to Cloud "
        f"Logging: {_money(log_cost) if log_cost else 'within'} its {pricing.LOGGING_FREE_GIB_MONTH} GiB free per "
        f"project-month (then {_money(pricing.LOGGING_USD_PER_GIB)}/GiB)",
        f"  metrics           ~{mib:,.1f} MiB of log-based and trainer metrics: {_money(metric_cost) if metric_cost else 'within'} "
        f"Monitoring's {pricing.MONITORING_FREE_MIB_MONTH} MiB free per billing account-month (then "
        f"{_money(pricing.MONITORING_USD_PER_MIB)}/MiB)",
        "  alerts            " + (f"{n} alert conditions: {_money(n * pricing.ALERT_CONDITION_USD_MONTH)}/month while "
                                   f"deployed ({_money(pricing.ALERT_CONDITION_USD_MONTH)} each; [alerts] enabled = "
                                   "false removes them)" if n else "none ([alerts] enabled = false)"),
    ]
    if exp.budget is not None:
        lines.append(f"  budget            {_money(exp.budget.amount_usd)} a {exp.budget.period} on this experiment's "
                     "resources, alerting at " + ", ".join(f"{t:.0%}" for t in exp.budget.thresholds)
                     + " (budgets cost nothing)")
    return lines


# --- the checkpoint bucket's storage -------------------------------------------------------------

#: Checkpoints the trainer keeps on each tier unless told otherwise (`trainer.config.RunConfig.keep`).
TRAINER_KEEP = 3
#: Assumed seconds between checkpoints reaching the bucket when nothing says otherwise.
DEFAULT_CHECKPOINT_INTERVAL_S = 300.0


@dataclass(frozen=True)
class StorageEstimate:
    """What the checkpoint bucket holds at its fullest: the kept checkpoints, plus every rotated
    checkpoint that soft delete (and versioning) retains for its retention time."""

    checkpoint_bytes: int | None  # None: the experiment declares no size
    size_source: str
    keep: int
    interval_s: float
    interval_source: str
    retention_days: float  # how long a rotated checkpoint stays billed
    retention_source: str
    parts_days: float  # how long the deleted parts of each save's composite upload stay billed (0: none)
    parts_source: str
    run_days: float  # a run shorter than the retention never fills it
    price_gb_month: float
    location: str

    @property
    def saves_per_day(self) -> float:
        return 86400 / self.interval_s

    @property
    def kept_gb(self) -> float:
        return self.keep * (self.checkpoint_bytes or 0) / 1e9

    @property
    def retained_gb(self) -> float:
        """Rotated checkpoints still billed at the fullest: the saves of the last retention
        window (or of the whole run, when shorter)."""
        days = min(self.retention_days, self.run_days) + min(self.parts_days, self.run_days)
        return self.saves_per_day * days * (self.checkpoint_bytes or 0) / 1e9

    @property
    def run_saves(self) -> float:
        return self.run_days * self.saves_per_day

    @property
    def retention_cost(self) -> float:
        """What the run's rotated checkpoints cost over their retention, each billed that long."""
        days_per_month = pricing.HOURS_PER_MONTH / 24
        return (self.run_saves * (self.checkpoint_bytes or 0) / 1e9 * (self.retention_days + self.parts_days)
                / days_per_month * self.price_gb_month)


def _flag(args: list[str], flag: str) -> str | None:
    """The value of `--flag V` or `--flag=V` in trainer arguments (the last one wins)."""
    found = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            found = args[i + 1]
        elif arg.startswith(flag + "="):
            found = arg.split("=", 1)[1]
    return found


def _interval(exp: Experiment) -> tuple[float, str]:
    if exp.cost.checkpoint_interval_s is not None:
        return exp.cost.checkpoint_interval_s, "set in [cost]"
    # [trainer.config]: the bucket's own cadence first, then the run-wide one (as the trainer does).
    config = exp.trainer.config
    gcs = config.get("tiers", {}).get(GCS, {}) if isinstance(config.get("tiers"), dict) else {}
    for where, table in ((f"trainer.config.tiers.{GCS}.", gcs), ("trainer.config.checkpoint_", config)):
        prefix = "" if table is gcs else "checkpoint_"
        seconds, steps = table.get(f"{prefix}every_seconds"), table.get(f"{prefix}every_steps")
        if isinstance(seconds, (int, float)) and seconds > 0:
            return float(seconds), f"{where}every_seconds"
        if isinstance(steps, int) and steps > 0:
            return steps / exp.cost.steps_per_second, f"{where}every_steps {steps} at the assumed steps/s"
    for flag, per_step in (("--checkpoint-every-seconds", False),
                           ("--checkpoint-every-steps", True)):
        value = _flag(exp.trainer.args, flag)
        try:
            v = float(value) if value is not None else 0.0
        except ValueError:
            continue
        if v > 0:
            if per_step:
                return v / exp.cost.steps_per_second, f"{flag} {value} at the assumed steps/s"
            return v, f"{flag} in trainer.args"
    return DEFAULT_CHECKPOINT_INTERVAL_S, "assumed default; the trainer logs its own"


def _streams(exp: Experiment) -> tuple[int, str]:
    """The trainer's streams per large checkpoint file to the bucket, and where that comes from."""
    value = exp.trainer.config.get("gcs_streams")
    if isinstance(value, int) and not isinstance(value, bool):
        return value, "trainer.config.gcs_streams"
    return int(RunConfig.model_fields["gcs_streams"].default), "the trainer's default"


def storage_estimate(exp: Experiment, run_hours: float) -> StorageEstimate:
    t = exp.trainer
    if t.state_bytes is not None:
        size, source = t.state_bytes, "declared state_bytes"
    elif t.param_count is not None:
        size, source = t.param_count * BYTES_PER_PARAM, f"{t.param_count:,} params x " \
            f"{BYTES_PER_PARAM} B"
    else:
        size, source = None, "undeclared"
    interval, interval_source = _interval(exp)
    b = exp.bucket
    retention = float(b.soft_delete_days)
    parts = [f"soft delete {b.soft_delete_days} d" if b.soft_delete_days else "soft delete off"]
    if b.versioning:
        retention += b.noncurrent_days
        parts.append(f"versions {b.noncurrent_days} d")
    location = b.bucket_location.upper()
    kind = "multi-region" if location in pricing.GCS_MULTI_REGIONS else "region"
    streams, streams_source = _streams(exp)
    composite = streams > 1 and size is not None and size >= GcsStore.PARALLEL_MIN_BYTES
    parts_days = float(b.soft_delete_days) if composite else 0.0
    return StorageEstimate(
        checkpoint_bytes=size, size_source=source, keep=TRAINER_KEEP, interval_s=interval,
        interval_source=interval_source, retention_days=retention,
        retention_source=" + ".join(parts), parts_days=parts_days,
        parts_source=f"{streams} streams ({streams_source})", run_days=run_hours / 24,
        price_gb_month=pricing.GCS_STANDARD_GB_MONTH[kind], location=location)


def _size(gb: float) -> str:
    if gb < 1:
        return f"{gb * 1000:,.1f} MB"
    return f"{gb / 1000:,.1f} TB" if gb >= 1000 else f"{gb:,.1f} GB"


def storage_lines(exp: Experiment, run_hours: float) -> list[str]:
    """The bucket's lines of the cost estimate."""
    st = storage_estimate(exp, run_hours)
    if st.checkpoint_bytes is None:
        return ["  bucket storage    unknown checkpoint size (declare trainer.param_count or "
                "trainer.state_bytes); soft delete and versioning retain every rotated "
                "checkpoint for their retention"]
    every = _interval_text(st.interval_s)
    if st.retention_days:
        parts = (f", and the parts of each save's upload in {st.parts_source} {st.parts_days:g} d"
                 if st.parts_days else "")
        retained = (f"{st.retention_source}: each rotated checkpoint stays billed "
                    f"{st.retention_days:g} d{parts}: up to {_size(st.retained_gb)} at once "
                    f"({_money(st.retained_gb * st.price_gb_month)}/month while it lasts), "
                    f"{_money(st.retention_cost)} over this run's {st.run_saves:,.0f} saves")
    else:
        retained = "soft delete off, no versioning: a rotated checkpoint is gone at once"
    lines = [
        f"  bucket storage    {st.keep} kept x {size_text(st.checkpoint_bytes)} ({st.size_source}) = "
        f"{_size(st.kept_gb)}; one save every {every} ({st.interval_source}) rotates "
        f"{st.saves_per_day:,.0f} a day out",
        f"  retained          {retained}",
        f"  storage price     STANDARD {_money(st.price_gb_month)}/GB-month in {st.location}: "
        f"the {_size(st.kept_gb)} kept cost {_money(st.kept_gb * st.price_gb_month)}/month",
    ]
    if st.retained_gb > 10 * st.kept_gb:
        lines.append(f"  note              retention holds {st.retained_gb / st.kept_gb:,.0f}x "
                     "what the trainer keeps: a longer GCS interval or a shorter (or no) soft "
                     "delete lowers it" + (", and so does trainer.config.gcs_streams = 1 (uploads "
                                           "in one stream leave no parts), at the cost of upload "
                                           "speed" if st.parts_days else ""))
    return lines


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) > 1 or (args and args[0].startswith("-")):
        print("usage: python -m stacks.cost [EXPERIMENT.toml | DIR | NAME]", file=sys.stderr)
        return 2
    try:
        experiments = load_all(argument(args[0]) if args else None)
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
