"""The managed instance group that keeps the trainer VMs alive (one, or a pool's Spot workers),
and its TCP health check.

Repair on failure recreates preempted or failed VMs from the template; autohealing recreates a
VM whose trainer stops answering `ok`. The checkpoint disk is stateful: kept and reattached on
repair, deleted only when the instance is deleted for good. Zonal or regional; a regional
stateful group takes the constraints the API imposes (no redistribution, no surge, at least one
unavailable per zone, zone kept on repair).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypedDict

from cdktn import ITerraformDependable, TerraformResourceLifecycle

from cdktn_provider_google.compute_health_check import (
    ComputeHealthCheck,
    ComputeHealthCheckLogConfig,
    ComputeHealthCheckTcpHealthCheck,
)
from cdktn_provider_google.compute_instance_group_manager import (
    ComputeInstanceGroupManager,
    ComputeInstanceGroupManagerAutoHealingPolicies,
    ComputeInstanceGroupManagerInstanceLifecyclePolicy,
    ComputeInstanceGroupManagerNamedPort,
    ComputeInstanceGroupManagerStatefulDisk,
    ComputeInstanceGroupManagerUpdatePolicy,
    ComputeInstanceGroupManagerVersion,
)
from cdktn_provider_google.compute_region_instance_group_manager import (
    ComputeRegionInstanceGroupManager,
    ComputeRegionInstanceGroupManagerAutoHealingPolicies,
    ComputeRegionInstanceGroupManagerInstanceFlexibilityPolicy,
    ComputeRegionInstanceGroupManagerInstanceFlexibilityPolicyInstanceSelections as Selection,
    ComputeRegionInstanceGroupManagerInstanceLifecyclePolicy,
    ComputeRegionInstanceGroupManagerInstanceLifecyclePolicyOnRepair as OnRepair,
    ComputeRegionInstanceGroupManagerNamedPort,
    ComputeRegionInstanceGroupManagerStatefulDisk,
    ComputeRegionInstanceGroupManagerUpdatePolicy,
    ComputeRegionInstanceGroupManagerVersion,
)
from constructs import Construct

from stacks.boot import DEVICE_NAME, group_name
from stacks.health import SINGLE_VM, HealthTiming

#: The health protocol shared with the trainer: this request, and only an answer starting "ok"
#: passes (the trainer answers "starting", "stalled" or "finished" otherwise).
HEALTH_REQUEST = "spottrain-health"
HEALTH_RESPONSE = "ok"
DELETE_RULE = "ON_PERMANENT_INSTANCE_DELETION"
#: A regional group's target distribution shape: the one that follows Spot capacity.
TARGET_SHAPE = "BALANCED"


@dataclass(frozen=True)
class GroupProps:
    project: str
    region: str
    zones: tuple[str, ...]
    name: str
    regional: bool
    workers: int
    template_self_link: str
    health_port: int
    initial_delay_sec: int
    #: The health check's interval, timeout and thresholds. A pool's workers answer nothing while
    #: torchrun re-forms the world after another node was lost: `stacks.health.pool_timing`.
    health: HealthTiming = SINGLE_VM
    depends_on: tuple[ITerraformDependable, ...] = field(default_factory=tuple)
    #: "" for the experiment's group, "od" for its on-demand fallback group (`stacks.fallback`).
    kind: str = ""
    #: The checkpoint disk follows the instance across repairs. False with `zone_change`: a disk
    #: cannot leave its zone, so every new VM restores from the bucket.
    stateful: bool = True
    #: Regional only: a repaired VM may come back in another zone (`capacity.zone_change_on_repair`).
    zone_change: bool = False
    #: Regional only: instance flexibility, the template's machine type first, then these ranked.
    machine_types: tuple[str, ...] = ()
    primary_machine_type: str = ""
    #: Someone else sets the size after creation (the on-demand fallback's Cloud Run job).
    size_managed_elsewhere: bool = False


class _Common(TypedDict):
    """What the zonal and the regional group managers are given alike."""

    project: str
    name: str
    base_instance_name: str
    target_size: int
    description: str
    wait_for_instances: bool
    depends_on: list[ITerraformDependable] | None
    lifecycle: TerraformResourceLifecycle | None


class TrainerGroup(Construct):
    def __init__(self, scope: Construct, id_: str, props: GroupProps) -> None:
        super().__init__(scope, id_)
        self.health_check = ComputeHealthCheck(
            self,
            "health-check",
            project=props.project,
            name=f"{props.name}-{props.kind}-health" if props.kind else f"{props.name}-health",
            description="spottrain trainer answers ok while steps progress",
            check_interval_sec=props.health.interval_s,
            timeout_sec=props.health.timeout_s,
            healthy_threshold=props.health.healthy_threshold,
            unhealthy_threshold=props.health.unhealthy_threshold,
            tcp_health_check=ComputeHealthCheckTcpHealthCheck(
                port=props.health_port, request=HEALTH_REQUEST, response=HEALTH_RESPONSE
            ),
            log_config=ComputeHealthCheckLogConfig(enable=True),
        )
        common = _Common(
            project=props.project,
            name=group_name(props.name, props.kind),
            base_instance_name=f"{props.name}-{props.kind}" if props.kind else props.name,
            target_size=props.workers,
            description=f"spottrain trainer group for {props.name}",
            # Terraform returns at once; VMs take minutes (driver install, restore).
            wait_for_instances=False,
            depends_on=list(props.depends_on) or None,
            lifecycle=TerraformResourceLifecycle(ignore_changes=["target_size"])
            if props.size_managed_elsewhere else None,
        )
        flexible = bool(props.machine_types)
        if props.regional:
            self.manager: ComputeInstanceGroupManager | ComputeRegionInstanceGroupManager = (
                ComputeRegionInstanceGroupManager(
                    self,
                    "group",
                    **common,
                    region=props.region,
                    distribution_policy_zones=list(props.zones),
                    # BALANCED creates a VM "in zones where resources are available" while
                    # spreading as evenly as it can; EVEN keeps equal counts per zone whatever
                    # the capacity (for serving). The comparison table of
                    # compute/docs/instance-groups/regional-mig-distribution-shape lists
                    # BALANCED for stateful workloads and for batch; it needs proactive
                    # redistribution off, which a stateful group needs anyway (NONE below).
                    distribution_policy_target_shape=TARGET_SHAPE,
                    instance_flexibility_policy=ComputeRegionInstanceGroupManagerInstanceFlexibilityPolicy(
                        instance_selections=[
                            Selection(name=f"rank-{i}", rank=i, machine_types=[t])
                            for i, t in enumerate((props.primary_machine_type, *props.machine_types))
                        ]) if flexible else None,
                    version=[ComputeRegionInstanceGroupManagerVersion(
                        name="trainer", instance_template=props.template_self_link)],
                    named_port=[ComputeRegionInstanceGroupManagerNamedPort(
                        name="health", port=props.health_port)],
                    auto_healing_policies=ComputeRegionInstanceGroupManagerAutoHealingPolicies(
                        health_check=self.health_check.id,
                        initial_delay_sec=props.initial_delay_sec,
                    ),
                    stateful_disk=[ComputeRegionInstanceGroupManagerStatefulDisk(
                        device_name=DEVICE_NAME, delete_rule=DELETE_RULE)] if props.stateful else None,
                    instance_lifecycle_policy=(
                        ComputeRegionInstanceGroupManagerInstanceLifecyclePolicy(
                            default_action_on_failure="REPAIR",
                            force_update_on_repair="YES",
                            # A zonal disk cannot follow its VM to another zone: only a group
                            # without a stateful disk may move a repaired VM.
                            on_repair=OnRepair(allow_changing_zone="YES" if props.zone_change else "NO"),
                        )
                    ),
                    update_policy=ComputeRegionInstanceGroupManagerUpdatePolicy(
                        type="PROACTIVE",
                        minimal_action="REPLACE",
                        replacement_method="RECREATE",
                        instance_redistribution_type="NONE",
                        max_surge_fixed=0,
                        max_unavailable_fixed=len(props.zones),
                    ),
                )
            )
        else:
            self.manager = ComputeInstanceGroupManager(
                self,
                "group",
                **common,
                zone=props.zones[0],
                version=[ComputeInstanceGroupManagerVersion(
                    name="trainer", instance_template=props.template_self_link)],
                named_port=[ComputeInstanceGroupManagerNamedPort(
                    name="health", port=props.health_port)],
                auto_healing_policies=ComputeInstanceGroupManagerAutoHealingPolicies(
                    health_check=self.health_check.id, initial_delay_sec=props.initial_delay_sec
                ),
                stateful_disk=[ComputeInstanceGroupManagerStatefulDisk(
                    device_name=DEVICE_NAME, delete_rule=DELETE_RULE)] if props.stateful else None,
                instance_lifecycle_policy=ComputeInstanceGroupManagerInstanceLifecyclePolicy(
                    default_action_on_failure="REPAIR", force_update_on_repair="YES"
                ),
                # A template change replaces the VM (the trainer saves on SIGTERM); stateful
                # disks need RECREATE, which also rules out surge.
                update_policy=ComputeInstanceGroupManagerUpdatePolicy(
                    type="PROACTIVE",
                    minimal_action="REPLACE",
                    replacement_method="RECREATE",
                    max_surge_fixed=0,
                    max_unavailable_fixed=1,
                ),
            )
