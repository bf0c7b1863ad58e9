"""The experiment's log-based metrics, notification channels and alert policies in Cloud
Monitoring (docs/watch.md). What they are is data (`stacks.run_metrics`, `stacks.alert_rules`);
this construct declares them.

- **Metrics:** one `google_logging_metric` per `run_metrics.metrics` entry: DELTA INT64 counters,
  or DELTA DISTRIBUTION of an extracted number (exponential buckets), with their labels.
- **Channels:** `[alerts]` email addresses, a webhook (token authentication: the URL is the
  secret) and a Pub/Sub topic of yours, on which the stack grants Cloud Monitoring's notification
  service agent (service-NUMBER@gcp-sa-monitoring-notification.iam.gserviceaccount.com, created
  with the first Pub/Sub channel) roles/pubsub.publisher, on that topic only.
- **Policies:** one per `alert_rules.rules`, each a single condition: a log-match on the metric's
  Logging filter for a rule that fires on one entry (no metric descriptor to wait for), else a
  threshold on its metric (the filter names the metric resource), created only once the metric's
  wait has run (below); notifying every channel, its
  documentation saying what happened and the command to see more; incidents close by themselves
  `AUTO_CLOSE_S` after the condition stops holding.
- **The wait:** Monitoring refuses an alert policy that names a log-based metric created moments
  before (404 "Cannot find metric(s) that match type = ..."; "it could take up to 10 minutes to
  become available", cloud.google.com/logging/docs/logs-based-metrics#monitoring; the provider
  retries only 409, hashicorp/terraform-provider-google#11102). So each counted metric carries a
  `local-exec` provisioner that sleeps `METRIC_VISIBLE_S` after the metric is created: Terraform
  marks the metric created only then, and the policies that name it wait for that. A provisioner
  runs when its resource is created, so the wait costs the first apply (and one that creates or
  renames a counted metric), never a later one; the metrics of one apply wait side by side. (A
  `terraform_data` for the wait would make synthesis run `terraform version`: cdktn validates
  that resource's Terraform version, and synthesis must not need Terraform.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cdktn import LocalExecProvisioner
from cdktn_provider_google.data_google_project import DataGoogleProject
from cdktn_provider_google.logging_metric import LoggingMetric, LoggingMetricMetricDescriptorLabels
from cdktn_provider_google.monitoring_alert_policy import (
    MonitoringAlertPolicy,
    MonitoringAlertPolicyConditions,
    MonitoringAlertPolicyConditionsConditionMatchedLog,
    MonitoringAlertPolicyConditionsConditionThreshold,
    MonitoringAlertPolicyConditionsConditionThresholdAggregations,
)
from cdktn_provider_google.monitoring_notification_channel import MonitoringNotificationChannel
from cdktn_provider_google.pubsub_topic_iam_member import PubsubTopicIamMember
from constructs import Construct

from stacks import alert_rules, run_metrics
from stacks.experiment import Experiment, PUBSUB_TOPIC

#: Exponential buckets of every distribution metric: 1e-3 * 1.25^k up to about 5.6e4 (80 finite
#: buckets): steps/s, losses and step counts of any ordinary run fall inside.
BUCKETS = {"num_finite_buckets": 80, "growth_factor": 1.25, "scale": 0.001}
STEP_BUCKETS = {"num_finite_buckets": 80, "growth_factor": 1.25, "scale": 1.0}
#: How long Monitoring may take to know a new log-based metric ("up to 10 minutes").
METRIC_VISIBLE_S = 600


@dataclass(frozen=True)
class AlertsProps:
    project: str
    name: str
    exp: Experiment
    labels: dict[str, str] = field(default_factory=dict)


class RunAlerts(Construct):
    """Log-based metrics, channels and alert policies of one experiment."""

    def __init__(self, scope: Construct, id_: str, props: AlertsProps) -> None:
        super().__init__(scope, id_)
        p, name, a = props.project, props.name, props.exp.alerts
        self.metrics: dict[str, LoggingMetric] = {}
        counted = {r.metric for r in alert_rules.rules(props.exp) if not r.matched_log}
        for m in run_metrics.metrics(p, name):
            descriptor: dict = {"metric_kind": "DELTA", "value_type": "DISTRIBUTION" if m.distribution else "INT64",
                                "unit": m.unit, "display_name": f"spottrain {name} {m.name}"}
            if m.labels:
                descriptor["labels"] = [LoggingMetricMetricDescriptorLabels(key=k, value_type="STRING")
                                        for k in sorted(m.labels)]
            self.metrics[m.name] = LoggingMetric(
                self, f"metric-{m.name}", project=p, name=run_metrics.metric_id(name, m.name),
                description=m.description, filter=m.filter, metric_descriptor=descriptor,
                label_extractors={k: f"EXTRACT({v})" for k, v in sorted(m.labels.items())} or None,
                value_extractor=f"EXTRACT({m.value_field})" if m.value_field else None,
                bucket_options={"exponential_buckets": STEP_BUCKETS if m.name == "step" else BUCKETS}
                if m.distribution else None,
                # The wait: a counted metric is created, then Monitoring needs up to 10 minutes to know
                # it; Terraform marks it created (and lets what names it start) after the sleep. Once:
                # a provisioner runs when its resource is created (or replaced: a renamed metric).
                provisioners=[LocalExecProvisioner(type="local-exec", command=f"sleep {METRIC_VISIBLE_S}")]
                if m.name in counted else None)

        rules = alert_rules.rules(props.exp)
        self.channels: list[MonitoringNotificationChannel] = []
        #: The email channels alone: the only kind a billing budget takes (stacks.billing_budget).
        self.email_channels: list[MonitoringNotificationChannel] = []
        if rules:
            user_labels = dict(props.labels)
            for i, address in enumerate(a.email):
                self.channels.append(MonitoringNotificationChannel(
                    self, f"email-{i}", project=p, type="email", display_name=f"spottrain {name}: {address}",
                    labels={"email_address": address}, user_labels=user_labels))
            self.email_channels = list(self.channels)
            if a.webhook_url is not None:
                self.channels.append(MonitoringNotificationChannel(
                    self, "webhook", project=p, type="webhook_tokenauth", display_name=f"spottrain {name}: webhook",
                    labels={"url": a.webhook_url}, user_labels=user_labels))
            if a.pubsub_topic is not None:
                channel = MonitoringNotificationChannel(
                    self, "pubsub", project=p, type="pubsub", display_name=f"spottrain {name}: Pub/Sub",
                    labels={"topic": a.pubsub_topic}, user_labels=user_labels)
                self.channels.append(channel)
                topic = PUBSUB_TOPIC.match(a.pubsub_topic)
                assert topic is not None  # validated upstream
                number = DataGoogleProject(self, "project", project_id=p).number
                # The agent exists once the first Pub/Sub channel does: the grant waits for it.
                PubsubTopicIamMember(
                    self, "pubsub-publisher", project=topic.group(1), topic=a.pubsub_topic.rsplit("/", 1)[1],
                    role="roles/pubsub.publisher", depends_on=[channel],
                    member=f"serviceAccount:service-{number}@gcp-sa-monitoring-notification.iam.gserviceaccount.com")
        names = [c.name for c in self.channels]
        self.policies: list[MonitoringAlertPolicy] = []
        by_name = run_metrics.by_name(p, name)
        for r in rules:
            metric = self.metrics[r.metric]
            if r.matched_log:
                self.policies.append(MonitoringAlertPolicy(
                    self, f"alert-{r.key}", project=p, display_name=f"spottrain {name}: {r.title}", combiner="OR",
                    conditions=[MonitoringAlertPolicyConditions(
                        display_name=r.title, condition_matched_log=MonitoringAlertPolicyConditionsConditionMatchedLog(
                            filter=by_name[r.metric].filter))],
                    documentation={"content": alert_rules.documentation(props.exp, name, r),
                                   "mime_type": "text/markdown", "subject": f"spottrain {name}: {r.title}"},
                    alert_strategy={"auto_close": f"{alert_rules.AUTO_CLOSE_S}s",
                                    "notification_rate_limit": {"period": f"{r.period_s}s"}},
                    notification_channels=names or None, severity=r.severity, user_labels=dict(props.labels)))
                continue
            flt = (f'metric.type="{run_metrics.USER_PREFIX}{metric.name}" '
                   f'AND resource.type="{by_name[r.metric].resource}"'
                   + (f" AND {r.label_filter}" if r.label_filter else ""))
            self.policies.append(MonitoringAlertPolicy(
                self, f"alert-{r.key}", project=p, display_name=f"spottrain {name}: {r.title}", combiner="OR",
                conditions=[MonitoringAlertPolicyConditions(
                    display_name=r.title, condition_threshold=MonitoringAlertPolicyConditionsConditionThreshold(
                        filter=flt, comparison="COMPARISON_GT", threshold_value=r.threshold,
                        duration=f"{r.duration_s}s", trigger={"count": 1},
                        aggregations=[MonitoringAlertPolicyConditionsConditionThresholdAggregations(
                            alignment_period=f"{r.period_s}s", per_series_aligner="ALIGN_SUM",
                            cross_series_reducer="REDUCE_SUM")]))],
                documentation={"content": alert_rules.documentation(props.exp, name, r), "mime_type": "text/markdown",
                               "subject": f"spottrain {name}: {r.title}"},
                alert_strategy={"auto_close": f"{alert_rules.AUTO_CLOSE_S}s"},
                notification_channels=names or None, severity=r.severity, user_labels=dict(props.labels)))
