"""The Google Cloud APIs a stack needs, derived from the resources in it and enabled in the
experiment's project before anything uses them.

`SERVICE_OF` maps every Terraform resource and data-source type the stacks use to the API that
serves it. `required(stack)` walks the finished stack and returns the APIs of the types in it, so
a feature that adds a resource enables its API by existing; a `google_*` type missing from the
table fails synthesis with a message that says to add it (`UnknownResourceType`).

One `google_project_service` per API, with `disable_on_destroy = false`: APIs are per project,
and a destroy must never switch one off for everything else in that project. Every other resource
and data source of the stack waits for all of them (`WaitForApis`, an aspect that also refuses a
resource added after the APIs were chosen whose API is not among them).

Enabling needs the Service Usage API (on in every project by default, and the one API a stack
cannot enable for itself: `PREREQUISITE`) and `serviceusage.services.enable`
(roles/serviceusage.serviceUsageAdmin, or Owner/Editor). A resource in another project (a shared
VPC's subnetwork binding, the `[data]` bucket's grant) is served by the same API there, which that
project's owner has enabled already.
"""

from __future__ import annotations

from dataclasses import dataclass

import jsii
from cdktn import IAspect, TerraformDataSource, TerraformResource, TerraformStack
from cdktn_provider_google.project_service import ProjectService
from constructs import Construct, IConstruct

COMPUTE, IAM, CRM = "compute.googleapis.com", "iam.googleapis.com", "cloudresourcemanager.googleapis.com"
STORAGE, SECRETS, DNS = "storage.googleapis.com", "secretmanager.googleapis.com", "dns.googleapis.com"
RUN, SCHEDULER = "run.googleapis.com", "cloudscheduler.googleapis.com"
LOGGING, MONITORING = "logging.googleapis.com", "monitoring.googleapis.com"
PUBSUB, BUDGETS = "pubsub.googleapis.com", "billingbudgets.googleapis.com"
#: Enables the others: a stack cannot enable it for itself, and every project has it on.
PREREQUISITE = "serviceusage.googleapis.com"

#: Terraform type (resources, and data sources as "data.<type>") -> the API that serves it.
SERVICE_OF: dict[str, str] = {
    "google_project_service": PREREQUISITE,
    # Compute Engine: VMs, network, firewall, templates, groups, health checks, resize requests.
    **{f"google_compute_{t}": COMPUTE for t in (
        "network", "subnetwork", "router", "router_nat", "firewall", "address", "disk",
        "instance", "instance_template", "instance_group_manager",
        "region_instance_group_manager", "health_check", "resize_request",
        "region_resize_request", "instance_iam_member", "subnetwork_iam_member")},
    # IAM: service accounts and custom roles; project bindings go through Resource Manager.
    "google_service_account": IAM,
    "google_project_iam_custom_role": IAM,
    "google_project_iam_member": CRM,
    "data.google_project": CRM,
    # Cloud Storage: the checkpoint bucket, its code objects and bindings, the stop markers.
    "google_storage_bucket": STORAGE,
    "google_storage_bucket_object": STORAGE,
    "google_storage_bucket_iam_member": STORAGE,
    "data.google_storage_bucket_objects": STORAGE,
    # Secret Manager: the checkpoint key.
    "google_secret_manager_secret": SECRETS,
    "google_secret_manager_secret_iam_member": SECRETS,
    # Cloud DNS: a pool's private zone and the query-logging policy.
    "google_dns_managed_zone": DNS,
    "google_dns_record_set": DNS,
    "google_dns_policy": DNS,
    # The on-demand fallback's check: a Cloud Run job that Cloud Scheduler starts.
    "google_cloud_run_v2_job": RUN,
    "google_cloud_run_v2_job_iam_member": RUN,
    "google_cloud_scheduler_job": SCHEDULER,
    # Watching the run (docs/watch.md): log-based metrics, alerts and their channels, the
    # dashboard; a Pub/Sub channel's grant on your topic; the billing budget.
    "google_logging_metric": LOGGING,
    "google_monitoring_alert_policy": MONITORING,
    "google_monitoring_notification_channel": MONITORING,
    "google_monitoring_dashboard": MONITORING,
    "google_pubsub_topic_iam_member": PUBSUB,
    "google_billing_budget": BUDGETS,
}


class UnknownResourceType(Exception):
    """A `google_*` type without a row in `SERVICE_OF`: its API would never be enabled."""


def type_key(node: TerraformResource | TerraformDataSource) -> str:
    kind = node.terraform_resource_type
    return f"data.{kind}" if isinstance(node, TerraformDataSource) else kind


def service_of(key: str) -> str | None:
    """The API behind a Terraform type key; None for types of other providers."""
    if key in SERVICE_OF:
        return SERVICE_OF[key]
    if key.removeprefix("data.").startswith("google_"):
        raise UnknownResourceType(
            f"{key}: no API known for this Terraform type; add it to SERVICE_OF in stacks/apis.py "
            "with the API that serves it, or the first apply on a fresh project fails")
    return None


def required(stack: TerraformStack) -> list[str]:
    """The APIs of every resource and data source in `stack`, but the prerequisite, sorted."""
    found = {service_of(type_key(n)) for n in stack.node.find_all()
             if isinstance(n, (TerraformResource, TerraformDataSource))}
    return sorted(a for a in found if a is not None and a != PREREQUISITE)


@dataclass(frozen=True)
class ApisProps:
    project: str
    services: tuple[str, ...]  # `required(stack)`


class ProjectApis(Construct):
    """`google_project_service` for each API; `services` for dependencies."""

    def __init__(self, scope: Construct, id_: str, props: ApisProps) -> None:
        super().__init__(scope, id_)
        self.apis = frozenset(props.services)
        self.services = [
            ProjectService(
                self,
                api.split(".", 1)[0],
                project=props.project,
                service=api,
                # Shared by everything in the project: a destroy leaves it on.
                disable_on_destroy=False,
            )
            for api in sorted(props.services)
        ]


@jsii.implements(IAspect)
class WaitForApis:
    """Every resource and data source of the stack (but the APIs) depends on every API, and is
    served by one of them (a resource added after `required` ran would otherwise slip through)."""

    def __init__(self, apis: ProjectApis) -> None:
        self.enabled = apis.apis | {PREREQUISITE}
        self.addresses = [f"{s.terraform_resource_type}.{s.friendly_unique_id}"
                          for s in apis.services]

    def visit(self, node: IConstruct) -> None:
        if isinstance(node, ProjectService):
            return
        if isinstance(node, (TerraformResource, TerraformDataSource)):
            api = service_of(type_key(node))
            if api is not None and api not in self.enabled:
                raise UnknownResourceType(
                    f"{type_key(node)} ({node.node.path}) needs {api}, which this stack does not "
                    "enable: choose the APIs (`stacks.apis.required`) after every resource exists")
            node.depends_on = [*(node.depends_on or []), *self.addresses]
