"""The Google Cloud APIs a stack needs, enabled in the experiment's project before anything uses
them.

One `google_project_service` per API, with `disable_on_destroy = false`: APIs are per project,
and a destroy must never switch one off for everything else in that project. Every other resource
and data source of the stack waits for all of them (`WaitForApis`, an aspect: a resource that a
later construct adds waits too, without naming the APIs).

Enabling needs the Service Usage API (on in every project by default) and
`serviceusage.services.enable` (roles/serviceusage.serviceUsageAdmin, or Owner/Editor). A shared
VPC's host project is not touched: its owner has enabled Compute Engine there already.

A feature that needs another API appends it in `required()`, with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import jsii
from cdktn import IAspect, TerraformDataSource, TerraformResource
from cdktn_provider_google.project_service import ProjectService
from constructs import Construct, IConstruct

from stacks.boot import needs_control
from stacks.experiment import Experiment

#: Every stack: API -> what of the stack uses it.
BASE: dict[str, str] = {
    "compute.googleapis.com": "VMs, network, firewall, instance template, group, health check",
    "iam.googleapis.com": "the trainer's service account",
    "cloudresourcemanager.googleapis.com": "project IAM bindings and the project lookup",
    "storage.googleapis.com": "the checkpoint bucket and the code objects in it",
    "secretmanager.googleapis.com": "the experiment's checkpoint key (stacks.checkpoint_key)",
}


def required(exp: Experiment) -> dict[str, str]:
    """The APIs this experiment's stack uses, each with its reason."""
    apis = dict(BASE)
    if exp.data is not None:
        apis["storage.googleapis.com"] += "; the [data] bucket's read grant and the staging reads"
    if exp.pool is not None or exp.dns_query_logging:
        apis["dns.googleapis.com"] = "the pool's private zone and the DNS query-logging policy"
    if needs_control(exp):
        apis["run.googleapis.com"] = "the experiment's control job (stacks.control)"
        apis["cloudscheduler.googleapis.com"] = "the control job's schedule"
    return apis


@dataclass(frozen=True)
class ApisProps:
    project: str
    services: dict[str, str]  # API -> reason (`required()`)


class ProjectApis(Construct):
    """`google_project_service` for each API; `services` for dependencies."""

    def __init__(self, scope: Construct, id_: str, props: ApisProps) -> None:
        super().__init__(scope, id_)
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
    """Every resource and data source of the stack (but the APIs) depends on every API."""

    def __init__(self, apis: ProjectApis) -> None:
        self.addresses = [f"{s.terraform_resource_type}.{s.friendly_unique_id}"
                          for s in apis.services]

    def visit(self, node: IConstruct) -> None:
        if isinstance(node, ProjectService):
            return
        if isinstance(node, (TerraformResource, TerraformDataSource)):
            node.depends_on = [*(node.depends_on or []), *self.addresses]
