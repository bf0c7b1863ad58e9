"""What a deployed run is measured by: the stack's log-based metrics (counted and extracted from
the entries the VMs' log shipper writes, `trainer.cloud.log_shipper`) and the custom metrics the trainer
writes itself. The alerts (`stacks.alerts`), the dashboard (`stacks.dashboard`), the cost
estimate and the tests all take their names and filters from here; docs/watch.md lists them.

Every log-based metric counts entries of one experiment (its `spottrain-experiment` label in the
spottrain log) and is named `spottrain/EXPERIMENT/NAME`, so experiments sharing a project never
mix; Cloud Monitoring sees it as `logging.googleapis.com/user/spottrain/EXPERIMENT/NAME` on the
`gce_instance` resource (cloud.google.com/logging/docs/logs-based-metrics). Counters are DELTA
INT64; distributions extract a number from `jsonPayload.fields` (the line's `key=value`s).

The trainer's events are counted by the name of their log line, imported from where it is said
once (`trainer.observe.events`: an event's `line`).

The filters use only what the log entries carry (docs/watch.md, "Logs that outlive the VM"), and
only the part of the Logging query language that the loopback Logging API understands
(`drill.fake_observability.Filter`), so the tests evaluate each one against real shipped entries.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainer.cloud.log_shipper import STALL_EVENT
from trainer.cloud.stop_marker import REFUSED_EVENT
from trainer.observe.events import CheckpointsSetAside, Eval, Failed, Finished, Restored, Step, TierFailing

LOG_ID = "spottrain"
LABEL = "spottrain-experiment"
#: Monitoring's prefix of a user-defined log-based metric.
USER_PREFIX = "logging.googleapis.com/user/"
#: The custom metrics the trainer writes (its sink `trainer.observe.sinks.monitoring`; resource
#: `global`, labels `experiment` and `run`, a GAUGE DOUBLE point at most once a minute from the
#: job's rank 0).
CUSTOM_PREFIX = "custom.googleapis.com/spottrain/"
CUSTOM_METRICS: dict[str, str] = {
    f"{CUSTOM_PREFIX}goodput": "the job's goodput so far, 0-1 (trainer.goodput's report)",
    f"{CUSTOM_PREFIX}cost_usd": "what the job has cost so far, USD (the ledger's cost_so_far)",
    f"{CUSTOM_PREFIX}on_demand_cost_usd": "what the same work would have cost on demand, USD (the ledger's on_demand_equivalent)",
    f"{CUSTOM_PREFIX}step": "the newest step the job completed",
}
#: Compute Engine's answers when a zone has no capacity for the VM the group asks for.
STOCKOUT_MESSAGES = ("ZONE_RESOURCE_POOL_EXHAUSTED", "STOCKOUT", "does not have enough resources available")


@dataclass(frozen=True)
class LogMetric:
    """One log-based metric: `filter` is what it counts, within the experiment's entries."""

    name: str
    description: str
    filter: str
    unit: str = "1"
    value_field: str | None = None  # jsonPayload path: a DISTRIBUTION of that number
    labels: dict[str, str] = field(default_factory=dict)  # label -> jsonPayload path
    own_log: bool = True  # False: a filter over other logs (Compute Engine's audit log, the control job's)
    resource: str = "gce_instance"  # the monitored resource of the entries it counts (what an alert filters on)

    @property
    def distribution(self) -> bool:
        return self.value_field is not None


def metric_id(experiment: str, name: str) -> str:
    """The log-based metric's name (at most 100 characters: experiments are at most 21)."""
    return f"spottrain/{experiment}/{name}"


def metric_type(experiment: str, name: str) -> str:
    return USER_PREFIX + metric_id(experiment, name)


def base_filter(project: str, experiment: str) -> str:
    """The experiment's entries: its label in the spottrain log."""
    return f'logName="projects/{project}/logs/{LOG_ID}" AND labels."{LABEL}"="{experiment}"'


def instance_pattern(experiment: str) -> str:
    """The experiment's VMs, exactly (a regular expression on an audit entry's resourceName): its
    groups' `NAME-xxxx` and `NAME-od-xxxx` (a group's base name and its 4 random characters,
    stacks.group) and the pool's `NAME-coordinator`. Never a prefix: experiment `exp` must not
    count `exp-big`'s VMs. (`exp-od`'s would be `exp`'s fallback's names, but the two cannot share
    a project: their groups would both be `exp-od-group`, stacks.boot.group_name.)"""
    return f"/instances/{experiment}(-od)?-[a-z0-9]{{4}}$|/instances/{experiment}-coordinator$"


def _trainer(event: str) -> str:
    return f'jsonPayload.source="trainer" AND jsonPayload.event="{event}"'


def metrics(project: str, experiment: str) -> list[LogMetric]:
    """Every log-based metric of one experiment, with its complete filter."""
    base = base_filter(project, experiment)
    audit = (f'logName="projects/{project}/logs/cloudaudit.googleapis.com%2Factivity" AND '
             f'protoPayload.methodName:"compute.instances.insert" AND '
             f'protoPayload.resourceName=~"{instance_pattern(experiment)}" AND severity>=ERROR AND ('
             + " OR ".join(f'protoPayload.status.message:"{m}"' for m in STOCKOUT_MESSAGES) + ")")
    own = [
        LogMetric("steps", "Step lines the trainer logged (one per logging interval)", _trainer(Step.line)),
        LogMetric("steps_per_s", "Optimizer steps per second over each logging interval", _trainer(Step.line),
                  unit="1/s", value_field="jsonPayload.fields.steps_per_s"),
        LogMetric("loss", "Mean training loss over each logging interval", _trainer(Step.line),
                  value_field="jsonPayload.fields.loss"),
        LogMetric("step", "The step each step line reached", _trainer(Step.line), value_field="jsonPayload.step"),
        LogMetric("eval_loss", "Evaluation loss", _trainer(Eval.line), value_field="jsonPayload.fields.loss"),
        LogMetric("restores", "Sessions that resumed from a checkpoint, by tier",
                  _trainer(Restored.line) + " AND jsonPayload.step>0", labels={"tier": "jsonPayload.fields.tier"}),
        LogMetric("preemptions", "VMs preempted (the shutdown script's event=shutdown reason=preemption)",
                  'jsonPayload.event="shutdown" AND jsonPayload.fields.reason="preemption"'),
        LogMetric("stops", "VMs that shut down other than by a preemption (a repair, a resize, a finish: the "
                  "shutdown script's event=shutdown reason=stop)",
                  'jsonPayload.event="shutdown" AND jsonPayload.fields.reason="stop"'),
        LogMetric("boots", "VM boots, by why the VM booted (after=first, preemption, stop, unknown)",
                  'jsonPayload.source="startup" AND jsonPayload.event="boot"',
                  labels={"after": "jsonPayload.fields.after"}),
        LogMetric("stalls", "The log shipper saw no step for alerts.stall_minutes while the trainer ran",
                  f'jsonPayload.event="{STALL_EVENT}"'),
        LogMetric("failures", "A run stopped on bad input or failure (the trainer's event=failed, a failed boot)",
                  f'({_trainer(Failed.line)}) OR jsonPayload.event="boot_failed"',
                  labels={"reason": "jsonPayload.fields.reason"}),
        LogMetric("finished", "The run finished (its final checkpoint durable on every tier)",
                  _trainer(Finished.line) + f' AND NOT jsonPayload.message:"{Finished.AGAIN}"'),
        LogMetric("tier_failing", "A checkpoint tier kept failing, by tier", _trainer(TierFailing.line),
                  labels={"tier": "jsonPayload.fields.tier"}),
        LogMetric("set_aside", "A restore set aside checkpoints nobody can vouch for and started from scratch",
                  _trainer(CheckpointsSetAside.line)),
    ]
    out = [LogMetric(m.name, m.description, f"{base} AND ({m.filter})", m.unit, m.value_field, m.labels)
           for m in own]
    out.append(LogMetric("capacity_waits", "The group's VM creations refused for lack of capacity (Compute "
                         "Engine's audit log: a stockout)", audit, own_log=False))
    # The control job (a Cloud Run job, `trainer.cloud.control`) writes JSON lines to stderr, which
    # Cloud Run turns into jsonPayload entries of the `cloud_run_job` resource in its own log;
    # `<experiment>-control` is `stacks.boot.control_job_name` (not imported: this module stays light).
    refused = (f'logName="projects/{project}/logs/run.googleapis.com%2Fstderr" AND resource.type="cloud_run_job" AND '
               f'resource.labels.job_name="{experiment}-control" AND jsonPayload.event="{REFUSED_EVENT}"')
    out.append(LogMetric("markers_refused", "Stop markers the control job refused to act on (not signed by the run, "
                         "or no longer backed by the bucket: the groups were left alone)", refused, own_log=False,
                         resource="cloud_run_job"))
    return out


def by_name(project: str, experiment: str) -> dict[str, LogMetric]:
    return {m.name: m for m in metrics(project, experiment)}
