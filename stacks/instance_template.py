"""The trainer VM's instance template, made from the experiment's VM (`stacks.vm_spec`): machine,
GPUs, scheduling, disks, boot scripts.

Replaced, never edited: `name_prefix` plus create-before-destroy lets a changed template exist
next to the old one until the group has moved over. Its metadata is a pure function of the
experiment, so an unchanged experiment plans no diff.
"""

from __future__ import annotations

from dataclasses import dataclass

from cdktn import TerraformResourceLifecycle
from cdktn_provider_google.compute_instance_template import (
    ComputeInstanceTemplate,
    ComputeInstanceTemplateDisk,
    ComputeInstanceTemplateGuestAccelerator,
    ComputeInstanceTemplateNetworkInterface,
    ComputeInstanceTemplateReservationAffinity,
    ComputeInstanceTemplateScheduling,
    ComputeInstanceTemplateSchedulingMaxRunDuration,
    ComputeInstanceTemplateServiceAccount,
    ComputeInstanceTemplateShieldedInstanceConfig,
)
from constructs import Construct

from stacks import gcp_rules as R
from stacks.boot import DEVICE_NAME
from stacks.vm_spec import VmSpec
from trainer.cloud.vm_info import PROVISIONING_KEY, PROVISIONING_MODELS


@dataclass(frozen=True)
class TemplateProps:
    """The experiment's VM and what is this template's own."""

    vm: VmSpec
    depends_on: tuple = ()  # the code objects the startup script fetches
    role: str | None = None
    """Its VMs' part in a pool (`spottrain-role = worker`); None for a single VM."""
    name_suffix: str = ""
    """A second template of the same experiment (the on-demand fallback's, "od")."""
    checkpoint_disk_stateful: bool = True
    """The group keeps the checkpoint disk as a stateful disk (and deletes it on permanent
    deletion of the instance). False (flex-start, a zone change on repair): no stateful policy
    owns the disk, so it must go with its VM (`auto_delete`), or every VM the group or Compute
    Engine deletes leaves a disk behind that Terraform does not know."""


def scheduling(vm: VmSpec) -> ComputeInstanceTemplateScheduling:
    if vm.provisioning == "flex-start":
        assert vm.flex_max_run_s is not None  # vm_spec sets it for flex-start
        # Dynamic Workload Scheduler: not preemptible; deleted (DELETE is the only action) when
        # its run duration ends. The resize requests ask for the same duration, so the VM ends
        # at the same moment whichever of the two the group applies (docs/capacity.md).
        return ComputeInstanceTemplateScheduling(
            provisioning_model="FLEX_START",
            preemptible=False,
            automatic_restart=False,
            on_host_maintenance="TERMINATE",
            instance_termination_action="DELETE",
            max_run_duration=ComputeInstanceTemplateSchedulingMaxRunDuration(seconds=vm.flex_max_run_s),
        )
    if vm.provisioning == "spot":
        # The API's required Spot combination; GPUs also require TERMINATE on host maintenance.
        return ComputeInstanceTemplateScheduling(
            provisioning_model="SPOT",
            preemptible=True,
            automatic_restart=False,
            on_host_maintenance="TERMINATE",
            instance_termination_action=vm.termination_action,
        )
    return ComputeInstanceTemplateScheduling(
        provisioning_model="STANDARD",
        preemptible=False,
        automatic_restart=True,
        on_host_maintenance="TERMINATE",
    )


class TrainerTemplate(Construct):
    def __init__(self, scope: Construct, id_: str, props: TemplateProps) -> None:
        super().__init__(scope, id_)
        vm = props.vm
        disks = [
            ComputeInstanceTemplateDisk(
                boot=True,
                auto_delete=True,
                source_image=vm.image,
                disk_type="pd-balanced",
                disk_size_gb=vm.boot_disk_gb,
                labels=vm.labels,
            ),
            # The checkpoint disk; the startup script finds it at
            # /dev/disk/by-id/google-<device_name>. In a stateful group the group keeps it by
            # this device_name and its stateful policy deletes it on permanent deletion of the
            # instance; auto_delete = false is then a hedge: whether Compute Engine's own
            # deletion of a preempted Spot VM (termination action DELETE) spares a stateful disk
            # that is marked auto-delete is not documented. Without a stateful policy nothing
            # but auto_delete ever deletes it.
            ComputeInstanceTemplateDisk(
                boot=False,
                auto_delete=not props.checkpoint_disk_stateful,
                device_name=DEVICE_NAME,
                disk_type="pd-ssd",
                disk_size_gb=vm.checkpoint_disk_gb,
                type="PERSISTENT",
                mode="READ_WRITE",
                labels=vm.labels,
            ),
        ]
        disks += [
            ComputeInstanceTemplateDisk(
                type="SCRATCH", disk_type="local-ssd", interface="NVME",
                disk_size_gb=R.LOCAL_SSD_GB, auto_delete=True,
            )
            for _ in range(vm.local_ssd_count)
        ]
        self.template = ComputeInstanceTemplate(
            self,
            "template",
            project=vm.project,
            region=vm.region,
            name_prefix=f"{vm.name}-{props.name_suffix}-" if props.name_suffix else f"{vm.name}-",
            description=f"spottrain trainer VM for {vm.name}",
            machine_type=vm.machine_type,
            labels=vm.labels,
            tags=[vm.network_tag],
            disk=disks,
            guest_accelerator=[
                ComputeInstanceTemplateGuestAccelerator(type=vm.gpu_type, count=vm.gpu_count)
            ]
            if vm.attach_gpus
            else None,
            scheduling=scheduling(vm),
            # Flex-start capacity comes from Dynamic Workload Scheduler, never from a reservation
            # (the default affinity, ANY_RESERVATION, would let a matching one be consumed); as
            # in Google's resize-request examples.
            reservation_affinity=ComputeInstanceTemplateReservationAffinity(type="NO_RESERVATION")
            if vm.provisioning == "flex-start" else None,
            network_interface=[
                # No access_config: no external IP. Egress goes through Cloud NAT.
                ComputeInstanceTemplateNetworkInterface(
                    subnetwork=vm.subnetwork,
                    subnetwork_project=vm.subnetwork_project,
                    nic_type="GVNIC" if vm.gvnic else None,
                )
            ],
            service_account=ComputeInstanceTemplateServiceAccount(
                email=vm.service_account_email,
                # IAM on the dedicated account is what limits access; the scope only lets it apply.
                scopes=["cloud-platform"],
            ),
            shielded_instance_config=ComputeInstanceTemplateShieldedInstanceConfig(
                # The NVIDIA driver installed at first boot is not signed for Secure Boot.
                enable_secure_boot=False,
                enable_vtpm=True,
                enable_integrity_monitoring=True,
            ),
            metadata={
                "startup-script": vm.scripts.startup,
                **vm.metadata(role=props.role),
                # The goodput ledger's placement of each session (`trainer.cloud.vm_info`).
                PROVISIONING_KEY: PROVISIONING_MODELS[vm.provisioning],
            },
            depends_on=list(props.depends_on) or None,
            lifecycle=TerraformResourceLifecycle(create_before_destroy=True),
        )

    @property
    def self_link_unique(self) -> str:
        return self.template.self_link_unique
