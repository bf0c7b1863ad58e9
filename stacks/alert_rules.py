"""The alert policies of one experiment, as data: what each watches, when it fires, what its
notification says (the command to see more included). `stacks.alerts` turns them into Cloud
Monitoring resources; the tests, the cost estimate and docs/watch.md read them here.

An alert that fires on one entry (a stall, a failure, the finish) is a log-match condition on
the metric's own Logging filter (`matched_log`): it needs no metric descriptor, so it works on the
first deploy, when the log-based metrics it would otherwise read were created moments before in
the same apply and Monitoring answers 404 "Cannot find metric(s)" for up to 10 minutes (the
provider retries only 409: hashicorp/terraform-provider-google#11102). Its notifications are
rate-limited to one per `period_s` (the API requires `notification_rate_limit` on log-match).

A rule that counts ("more than N in an hour", "for 120 minutes") is a threshold on its log-based
metric, summed over an alignment period that slides with each evaluation (cloud.google.com/
monitoring/alerts/concepts-indepth): "more than N in an hour" is a sum over 3600 s compared with N.
A condition whose count stays above 0 for `duration_s` says that something lasted that long.
Those need their metric to exist in Monitoring, so `stacks.alerts` creates them only after the
apply has waited 10 minutes for it (a `sleep` provisioner on the metric; docs/watch.md,
"The first deploy"). `drill.alert_eval` evaluates both kinds over the drill's shipped entries.
"""

from __future__ import annotations

from dataclasses import dataclass

from stacks.boot import needs_control
from stacks.experiment import Experiment

#: How long an incident stays open once its condition no longer holds (it closes by itself).
AUTO_CLOSE_S = 1800


@dataclass(frozen=True)
class AlertRule:
    key: str  # the resource's id in the stack
    title: str
    metric: str  # a `stacks.run_metrics` metric name
    threshold: int  # fires when the sum over `period_s` is above this
    period_s: int
    what: str  # what happened, for the notification
    duration_s: int = 0
    severity: str | None = None  # CRITICAL, ERROR, WARNING or none
    label_filter: str = ""  # more of the Monitoring filter (metric labels)
    matched_log: bool = False  # a log-match condition on the metric's Logging filter (no descriptor)


def rules(exp: Experiment) -> list[AlertRule]:
    """The experiment's alert policies (none when `[alerts] enabled = false`)."""
    a = exp.alerts
    if not a.enabled:
        return []
    out = [
        AlertRule("stall", "training stalled", "stalls", 0, 300,
                  f"The trainer ran on a VM for {a.stall_minutes} minutes without completing a step "
                  "(a hung collective or data loader, a tier it keeps waiting for, or a start-up that "
                  "takes longer than that).", severity="WARNING", matched_log=True),
        repair_loop(exp),
        AlertRule("preemptions", "frequent preemptions", "preemptions", a.preemptions_per_hour, 3600,
                  f"More than {a.preemptions_per_hour} Spot preemptions within an hour: each costs a restore "
                  "and the work since the last checkpoint (see docs/capacity.md for other capacity options).",
                  severity="WARNING"),
        AlertRule("stopped", "run stopped", "failures", 0, 300,
                  "The run stopped on bad input (exit 2: it stays stopped and stops paying until you fix the "
                  "experiment and deploy again) or failed (a crash the unit restarts a few times, a boot that "
                  "failed).", severity="ERROR", matched_log=True),
        # The run did not stop (a bucket writer must not be able to stop it for good), so nothing
        # else says that someone put checkpoints in its bucket, or deleted its own.
        AlertRule("set-aside", "checkpoints set aside", "set_aside", 0, 300,
                  "A restore found no checkpoint of this run's own, only ones nobody can vouch for in its bucket "
                  "(another run's, or without a valid HMAC), set them aside and started from scratch. "
                  "saved_before=0: planted before the run ever saved; saved_before=1: the run saved before and its "
                  "checkpoints were deleted (soft delete may keep them). Look at them and remove them "
                  "(docs/security.md).", severity="ERROR", matched_log=True),
        AlertRule("capacity", "waiting for capacity", "capacity_waits", 0, 1800,
                  f"Compute Engine has refused to create the VM for lack of capacity for {a.capacity_wait_minutes} "
                  "minutes (a stockout): the run waits and costs nothing meanwhile (see docs/capacity.md).",
                  duration_s=a.capacity_wait_minutes * 60, severity="WARNING"),
    ]
    if needs_control(exp):
        out.append(AlertRule("marker-refused", "stop marker refused", "markers_refused", 0, 3600,
                             "The control job found a stop marker it would not act on: not signed with the run's "
                             "checkpoint key (planted by a writer of the bucket), or one the bucket no longer backs "
                             "(a replay). It left the groups alone, so nothing was deleted, but a VM that asked to "
                             "stop may still be running and paying. Read the job's outcome "
                             "(runs/<experiment>/control/outcome.json: `refused` says why) and who wrote the marker "
                             "(the bucket's data access logs); docs/security.md, stop markers.", severity="CRITICAL",
                             matched_log=True))
    if a.notify_finished:
        out.append(AlertRule("finished", "run finished", "finished", 0, 300,
                             "The run finished: its final checkpoint is durable on every tier, and the VM scales "
                             "its group to zero (stop_when_done).", matched_log=True))
    return out


def keeps_boot_notes(exp: Experiment) -> bool:
    """Whether a recreated VM finds its predecessor's note on a stateful checkpoint disk (why it
    booted). A flex-start group and one with `zone_change_on_repair` keep no stateful disk: every
    VM boots on a blank disk and says `after=first`."""
    return not exp.capacity.zone_change_on_repair and exp.machine.provisioning != "flex-start"


def repair_loop(exp: Experiment) -> AlertRule:
    """VMs recreated again and again. Where boots can say why, boots no preemption explains;
    where they cannot (a blank disk on every VM), the shutdown script's own word: VMs that shut
    down other than by a preemption (a VM lost without its shutdown script is not seen there)."""
    n = exp.alerts.repairs_per_hour
    if keeps_boot_notes(exp):
        return AlertRule("repair-loop", "repair loop", "boots", n, 3600,
                         f"More than {n} VM boots within an hour that no preemption explains: the group keeps "
                         "recreating the VM (its health check fails), or its boot keeps failing.",
                         severity="ERROR", label_filter='metric.labels.after=one_of("stop", "unknown")')
    return AlertRule("repair-loop", "repair loop", "stops", n, 3600,
                     f"More than {n} VMs shut down within an hour other than by a preemption: the group keeps "
                     "recreating the VM (its health check fails), or its boot keeps failing.", severity="ERROR")


def see_more(exp: Experiment, name: str) -> str:
    return (f"See more: `make logs EXPERIMENT={name}` (or `python -m trainer logs --project "
            f"{exp.gcp.project} --experiment {name} --since 1d --lines`), and the dashboard "
            f"\"spottrain {name}\" in Cloud Monitoring.")


def documentation(exp: Experiment, name: str, rule: AlertRule) -> str:
    """The notification's text (markdown): what happened, and the command to see more."""
    return (f"**spottrain {name}: {rule.title}** (project {exp.gcp.project})\n\n{rule.what}\n\n"
            f"{see_more(exp, name)}")


def note(exp: Experiment) -> str | None:
    """What synthesis says when the alerts notify nobody (None: they notify someone, or none exist)."""
    n = len(rules(exp))
    if n == 0 or exp.alerts.channels:
        return None
    return (f"alerts: {n} alert policies notify nobody (no email, webhook_url or pubsub_topic in [alerts]); "
            "their incidents show in Cloud Monitoring only")
