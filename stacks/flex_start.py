"""The flex-start group: one VM at a time from Dynamic Workload Scheduler, through resize requests.

A flex-start VM is not preempted; it is queued until capacity exists (at a discount of up to 53%)
and deleted when its run duration ends (at most 7 days). So the group differs from the Spot
group (`stacks.group`):

- it starts at target size 0 and grows only through resize requests: one created here
  (`<experiment>-flex`, `resize_by` 1, the run duration of `capacity.flex_max_run_hours`), and
  the next ones created by the VM itself before its end (`trainer.cloud.scale deadline`, then
  `successor`): a job longer than 7 days continues VM after VM, each restoring from the bucket.
  Terraform ignores the target size after creation (the requests move it);
- nothing repairs or autoheals a flex-start VM (`DO_NOTHING`): the trainer unit restarts a crashed
  trainer, and the VM's deadline unit asks for a successor;
- the checkpoint disk is not stateful: the VM and its disks (all `auto_delete`, see
  `TemplateProps.checkpoint_disk_stateful`) go at the end of the run duration, so the bucket is
  the tier every VM restores from;
- template changes reach the next VM only (`OPPORTUNISTIC`), never interrupting the running one,
  and the first VM's request is never replaced (`REQUEST_FIXED`): a changed
  `capacity.flex_max_run_hours` would otherwise cancel it or add a second VM;
- a regional group keeps all its VMs in one zone (`ANY_SINGLE_ZONE`), as resize requests need.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cdktn import TerraformResourceLifecycle
from cdktn_provider_google.compute_instance_group_manager import (
    ComputeInstanceGroupManager,
    ComputeInstanceGroupManagerInstanceLifecyclePolicy,
    ComputeInstanceGroupManagerNamedPort,
    ComputeInstanceGroupManagerUpdatePolicy,
    ComputeInstanceGroupManagerVersion,
)
from cdktn_provider_google.compute_region_instance_group_manager import (
    ComputeRegionInstanceGroupManager,
    ComputeRegionInstanceGroupManagerInstanceLifecyclePolicy,
    ComputeRegionInstanceGroupManagerNamedPort,
    ComputeRegionInstanceGroupManagerUpdatePolicy,
    ComputeRegionInstanceGroupManagerVersion,
)
from cdktn_provider_google.compute_region_resize_request import (
    ComputeRegionResizeRequest,
    ComputeRegionResizeRequestRequestedRunDuration,
)
from cdktn_provider_google.compute_resize_request import (
    ComputeResizeRequest,
    ComputeResizeRequestRequestedRunDuration,
)
from constructs import Construct

from stacks.boot import group_name

#: What the first VM's request keeps after creation, whatever the experiment says later.
REQUEST_FIXED = ("requested_run_duration", "resize_by", "description")


@dataclass(frozen=True)
class FlexStartProps:
    project: str
    region: str
    zones: tuple[str, ...]
    name: str
    regional: bool
    workers: int  # 1: a resize request for the first VM; 0: none (a paused job)
    template_self_link: str
    health_port: int
    run_duration_s: int
    depends_on: tuple[Any, ...] = field(default_factory=tuple)


class FlexStartGroup(Construct):
    """Exposes `manager` (like `stacks.group.TrainerGroup`) and `request` (None when paused)."""

    def __init__(self, scope: Construct, id_: str, props: FlexStartProps) -> None:
        super().__init__(scope, id_)
        p = props
        common: dict[str, Any] = dict(
            project=p.project,
            name=group_name(p.name),
            base_instance_name=p.name,
            target_size=0,
            description=f"spottrain flex-start group for {p.name}",
            wait_for_instances=False,
            depends_on=list(p.depends_on) or None,
            lifecycle=TerraformResourceLifecycle(ignore_changes=["target_size"]),
        )
        if p.regional:
            self.manager: ComputeInstanceGroupManager | ComputeRegionInstanceGroupManager = \
                ComputeRegionInstanceGroupManager(
                    self, "group", **common, region=p.region,
                    distribution_policy_zones=list(p.zones),
                    distribution_policy_target_shape="ANY_SINGLE_ZONE",
                    version=[ComputeRegionInstanceGroupManagerVersion(
                        name="trainer", instance_template=p.template_self_link)],
                    named_port=[ComputeRegionInstanceGroupManagerNamedPort(name="health", port=p.health_port)],
                    instance_lifecycle_policy=ComputeRegionInstanceGroupManagerInstanceLifecyclePolicy(
                        default_action_on_failure="DO_NOTHING"),
                    update_policy=ComputeRegionInstanceGroupManagerUpdatePolicy(
                        type="OPPORTUNISTIC", minimal_action="REPLACE",
                        instance_redistribution_type="NONE",
                        max_surge_fixed=0, max_unavailable_fixed=len(p.zones)),
                )
        else:
            self.manager = ComputeInstanceGroupManager(
                self, "group", **common, zone=p.zones[0],
                version=[ComputeInstanceGroupManagerVersion(
                    name="trainer", instance_template=p.template_self_link)],
                named_port=[ComputeInstanceGroupManagerNamedPort(name="health", port=p.health_port)],
                instance_lifecycle_policy=ComputeInstanceGroupManagerInstanceLifecyclePolicy(
                    default_action_on_failure="DO_NOTHING"),
                update_policy=ComputeInstanceGroupManagerUpdatePolicy(
                    type="OPPORTUNISTIC", minimal_action="REPLACE", max_surge_fixed=0,
                    max_unavailable_fixed=1),
            )
        self.request: ComputeResizeRequest | ComputeRegionResizeRequest | None = None
        if p.workers == 0:
            return
        request: dict[str, Any] = dict(
            project=p.project, name=f"{p.name}-flex", resize_by=1,
            instance_group_manager=self.manager.name,
            description="spottrain: the job's first flex-start VM; later VMs ask for themselves",
            # A resize request cannot be updated: any change replaces it, and a new request adds
            # a VM beside the running one. It asked for the job's first VM once; a new run
            # duration reaches later VMs through the template and their own requests.
            lifecycle=TerraformResourceLifecycle(ignore_changes=list(REQUEST_FIXED)),
        )
        seconds = str(p.run_duration_s)
        if p.regional:
            self.request = ComputeRegionResizeRequest(
                self, "first-vm", **request, region=p.region,
                requested_run_duration=ComputeRegionResizeRequestRequestedRunDuration(seconds=seconds))
        else:
            self.request = ComputeResizeRequest(
                self, "first-vm", **request, zone=p.zones[0],
                requested_run_duration=ComputeResizeRequestRequestedRunDuration(seconds=seconds))
