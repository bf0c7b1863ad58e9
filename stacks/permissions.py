"""What the person who deploys needs: the IAM permissions of every resource in a synthesized
stack, derived from the resource types in it (as `stacks.apis` derives the APIs), checked by
`make preflight` (`stacks.preflight`) and listed in docs/reference/permissions.md.

`NEEDS` maps every Terraform resource and data-source type the stacks use to where its
permissions are checked (`PROJECT`, the experiment's project; `BILLING_ACCOUNT`, the budget's
billing account; `TOPIC`, the Pub/Sub topic's project), the permissions Terraform's create, read,
update and delete call, and a predefined role that grants them. `needed(stack)` returns them for
one stack; a `google_*` type missing from the table is an error that says to add it.

Billing-account permissions are the account's, not the project's: a project Owner alone cannot
create a budget ("To create a budget ... you need billing.budgets.create on the Cloud Billing
account"; cloud.google.com/billing/docs/how-to/budgets#budget-permissions). Sources of the
permission names: the IAM permissions reference (cloud.google.com/iam/docs/roles-permissions/
{compute,iam,resourcemanager,storage,secretmanager,dns,run,cloudscheduler,logging,monitoring,
pubsub,billing,serviceusage}).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PROJECT, BILLING_ACCOUNT, TOPIC = "project", "billing account", "Pub/Sub topic's project"


@dataclass(frozen=True)
class Need:
    scope: str
    role: str  # a predefined role that grants `permissions`
    permissions: tuple[str, ...]


def _crud(prefix: str, *extra: str, verbs: tuple[str, ...] = ("create", "get", "update", "delete")) -> tuple[str, ...]:
    return tuple(f"{prefix}.{v}" for v in verbs) + extra


_IAM_POLICY = ("getIamPolicy", "setIamPolicy")
_ACT_AS = "iam.serviceAccounts.actAs"  # a resource that runs as a service account
COMPUTE_ADMIN = "roles/compute.admin"

NEEDS: dict[str, Need] = {
    "google_project_service": Need(PROJECT, "roles/serviceusage.serviceUsageAdmin",
                                   ("serviceusage.services.enable", "serviceusage.services.get")),
    "google_compute_network": Need(PROJECT, COMPUTE_ADMIN, _crud("compute.networks", verbs=("create", "get", "delete"))),
    "google_compute_subnetwork": Need(PROJECT, COMPUTE_ADMIN, _crud("compute.subnetworks", "compute.networks.use",
                                                                    verbs=("create", "get", "update", "delete"))),
    "google_compute_router": Need(PROJECT, COMPUTE_ADMIN, _crud("compute.routers", "compute.networks.use")),
    "google_compute_router_nat": Need(PROJECT, COMPUTE_ADMIN, ("compute.routers.get", "compute.routers.update")),
    # Creating a firewall rule updates its network's policy.
    "google_compute_firewall": Need(PROJECT, COMPUTE_ADMIN, _crud("compute.firewalls", "compute.networks.updatePolicy")),
    "google_compute_address": Need(PROJECT, COMPUTE_ADMIN, _crud("compute.addresses", "compute.subnetworks.use",
                                                                 verbs=("create", "get", "delete"))),
    "google_compute_disk": Need(PROJECT, COMPUTE_ADMIN, _crud("compute.disks", "compute.disks.use")),
    "google_compute_instance": Need(PROJECT, COMPUTE_ADMIN, _crud(
        "compute.instances", "compute.instances.setMetadata", "compute.instances.setLabels",
        "compute.instances.setServiceAccount", "compute.disks.create", "compute.disks.use",
        "compute.subnetworks.use", "compute.addresses.use", _ACT_AS)),
    "google_compute_instance_template": Need(PROJECT, COMPUTE_ADMIN, _crud(
        "compute.instanceTemplates", "compute.networks.get", "compute.subnetworks.get", _ACT_AS,
        verbs=("create", "get", "delete"))),
    "google_compute_instance_group_manager": Need(PROJECT, COMPUTE_ADMIN, _crud(
        "compute.instanceGroupManagers", "compute.instanceTemplates.useReadOnly", "compute.healthChecks.useReadOnly",
        _ACT_AS)),
    "google_compute_region_instance_group_manager": Need(PROJECT, COMPUTE_ADMIN, _crud(
        "compute.instanceGroupManagers", "compute.instanceTemplates.useReadOnly", "compute.healthChecks.useReadOnly",
        _ACT_AS)),
    "google_compute_health_check": Need(PROJECT, COMPUTE_ADMIN, _crud("compute.healthChecks")),
    "google_compute_resize_request": Need(PROJECT, COMPUTE_ADMIN, ("compute.instanceGroupManagers.update",
                                                                   "compute.instanceGroupManagers.get")),
    "google_compute_region_resize_request": Need(PROJECT, COMPUTE_ADMIN, ("compute.instanceGroupManagers.update",
                                                                          "compute.instanceGroupManagers.get")),
    "google_compute_instance_iam_member": Need(PROJECT, COMPUTE_ADMIN,
                                               tuple(f"compute.instances.{v}" for v in _IAM_POLICY)),
    "google_compute_subnetwork_iam_member": Need(PROJECT, COMPUTE_ADMIN,
                                                 tuple(f"compute.subnetworks.{v}" for v in _IAM_POLICY)),
    "google_service_account": Need(PROJECT, "roles/iam.serviceAccountAdmin", _crud("iam.serviceAccounts")),
    "google_project_iam_custom_role": Need(PROJECT, "roles/iam.roleAdmin", _crud("iam.roles", "iam.roles.undelete")),
    "google_project_iam_member": Need(PROJECT, "roles/resourcemanager.projectIamAdmin",
                                      tuple(f"resourcemanager.projects.{v}" for v in _IAM_POLICY)),
    "data.google_project": Need(PROJECT, "roles/browser", ("resourcemanager.projects.get",)),
    "google_storage_bucket": Need(PROJECT, "roles/storage.admin", _crud("storage.buckets")),
    "google_storage_bucket_object": Need(PROJECT, "roles/storage.admin", _crud("storage.objects")),
    "google_storage_bucket_iam_member": Need(PROJECT, "roles/storage.admin",
                                             tuple(f"storage.buckets.{v}" for v in _IAM_POLICY)),
    "data.google_storage_bucket_objects": Need(PROJECT, "roles/storage.admin", ("storage.objects.list",)),
    "google_secret_manager_secret": Need(PROJECT, "roles/secretmanager.admin", _crud("secretmanager.secrets")),
    "google_secret_manager_secret_iam_member": Need(PROJECT, "roles/secretmanager.admin",
                                                    tuple(f"secretmanager.secrets.{v}" for v in _IAM_POLICY)),
    "google_dns_managed_zone": Need(PROJECT, "roles/dns.admin", _crud("dns.managedZones",
                                                                      "dns.networks.bindPrivateDNSZone")),
    "google_dns_record_set": Need(PROJECT, "roles/dns.admin", _crud("dns.resourceRecordSets", "dns.changes.create",
                                                                    "dns.changes.get")),
    "google_dns_policy": Need(PROJECT, "roles/dns.admin", _crud("dns.policies", "dns.networks.bindPrivateDNSPolicy")),
    "google_cloud_run_v2_job": Need(PROJECT, "roles/run.admin", _crud("run.jobs", _ACT_AS)),
    "google_cloud_run_v2_job_iam_member": Need(PROJECT, "roles/run.admin",
                                               tuple(f"run.jobs.{v}" for v in _IAM_POLICY)),
    "google_cloud_scheduler_job": Need(PROJECT, "roles/cloudscheduler.admin", _crud("cloudscheduler.jobs", _ACT_AS)),
    # Watching the run (docs/watch.md).
    "google_logging_metric": Need(PROJECT, "roles/logging.configWriter", _crud("logging.logMetrics")),
    "google_monitoring_alert_policy": Need(PROJECT, "roles/monitoring.editor", _crud("monitoring.alertPolicies")),
    "google_monitoring_notification_channel": Need(PROJECT, "roles/monitoring.editor",
                                                   _crud("monitoring.notificationChannels")),
    "google_monitoring_dashboard": Need(PROJECT, "roles/monitoring.editor", _crud("monitoring.dashboards")),
    "google_pubsub_topic_iam_member": Need(TOPIC, "roles/pubsub.admin",
                                           tuple(f"pubsub.topics.{v}" for v in _IAM_POLICY)),
    "google_billing_budget": Need(BILLING_ACCOUNT, "roles/billing.costsManager", _crud("billing.budgets")),
}
#: The budget's calls bill their quota to the experiment's project (`user_project_override`).
BUDGET_QUOTA = Need(PROJECT, "roles/serviceusage.serviceUsageConsumer", ("serviceusage.services.use",))


class UnknownResourceType(Exception):
    """A `google_*` type without a row in `NEEDS`: what it needs would never be checked."""


@dataclass
class Needed:
    """Permissions by scope, each with the resource types that need it."""

    by_scope: dict[str, dict[str, set[str]]] = field(default_factory=dict)
    billing_account: str | None = None

    def add(self, kind: str, need: Need) -> None:
        scope = self.by_scope.setdefault(need.scope, {})
        for p in need.permissions:
            scope.setdefault(p, set()).add(kind)

    def permissions(self, scope: str) -> list[str]:
        return sorted(self.by_scope.get(scope, {}))


def needed(stack: dict[str, Any]) -> Needed:
    """The deployer's permissions for a synthesized stack (the cdk.tf.json / `Testing.synth` JSON)."""
    out = Needed()
    kinds = [k for k in stack.get("resource", {})] + [f"data.{k}" for k in stack.get("data", {})]
    for kind in sorted(kinds):
        if kind not in NEEDS:
            if kind.removeprefix("data.").startswith("google_"):
                raise UnknownResourceType(
                    f"{kind}: no permissions known for this Terraform type; add it to NEEDS in "
                    "stacks/permissions.py, or `make preflight` cannot check what deploying it needs")
            continue
        out.add(kind, NEEDS[kind])
        if kind == "google_billing_budget":
            out.add(kind, BUDGET_QUOTA)
            (budget,) = stack["resource"][kind].values()
            out.billing_account = budget["billing_account"]
    return out


def page() -> str:
    """docs/reference/permissions.md: every type, where, which permissions, a role that grants them."""
    lines = ["# What deploying needs: permissions", "",
             "<!-- generated by `make docs` (python -m stacks.reference) from stacks/permissions.py: do not edit -->",
             "",
             _doc_intro(), "",
             "| resource type | checked on | permissions | a predefined role that grants them |",
             "|---|---|---|---|"]
    for kind, need in sorted(NEEDS.items()):
        # Running as a service account is Service Account User's, whatever the resource's role.
        role = f"`{need.role}`" + (" and `roles/iam.serviceAccountUser`" if _ACT_AS in need.permissions else "")
        lines.append(f"| `{kind}` | {need.scope} | {', '.join(f'`{p}`' for p in need.permissions)} | {role} |")
    q = BUDGET_QUOTA
    lines.append(f"| `google_billing_budget` (its API quota) | {q.scope} | "
                 f"{', '.join(f'`{p}`' for p in q.permissions)} | `{q.role}` |")
    return "\n".join(lines) + "\n"


def _doc_intro() -> str:
    return ("`make preflight` synthesizes the experiment's stack and checks, with your credentials, every permission "
            "its resource types need (`testIamPermissions` on the project, and on the billing account for a "
            "`[budget]`). Owner of the project covers every project row; the budget's row needs a role on the "
            "billing account itself (Billing Account Administrator or Costs Manager), which no project role "
            "grants. A `[alerts] pubsub_topic` in another project needs the Pub/Sub row there.")
