"""A pool's coordinator: one on-demand VM that is never preempted, hosts the c10d rendezvous and,
by default, trains as one of the nodes.

It is the workers' VM (`stacks.vm_spec`) on the coordinator's machine type, with standard
provisioning: no external IP, the experiment's own service account, shielded VM like the
workers' template. Its internal IP is a reserved static address (the DNS record points at it, so
it survives a recreation) and its checkpoint disk is a separate persistent disk (kept when the VM
is replaced). The boot scripts are the workers' own; metadata `spottrain-role = coordinator` tells
them which part to play. The startup script goes in `metadata_startup_script`, which replaces the
VM when it changes: a code or setting change reaches the coordinator as it reaches the group
(recreation), instead of waiting for a reboot that may never come.
"""

from __future__ import annotations

from dataclasses import dataclass

from cdktn_provider_google.compute_address import ComputeAddress
from cdktn_provider_google.compute_disk import ComputeDisk
from cdktn_provider_google.compute_instance import (
    ComputeInstance,
    ComputeInstanceAttachedDisk,
    ComputeInstanceBootDisk,
    ComputeInstanceBootDiskInitializeParams,
    ComputeInstanceGuestAccelerator,
    ComputeInstanceNetworkInterface,
    ComputeInstanceScheduling,
    ComputeInstanceScratchDisk,
    ComputeInstanceServiceAccount,
    ComputeInstanceShieldedInstanceConfig,
)
from constructs import Construct

from stacks.boot import DEVICE_NAME
from stacks.pool import COORDINATOR
from stacks.vm_spec import VmSpec
from trainer.cloud.vm_info import PROVISIONING_KEY


@dataclass(frozen=True)
class CoordinatorProps:
    """The experiment's VM on the coordinator's machine type (`VmSpec.on_machine`), and what is
    the coordinator's own."""

    vm: VmSpec
    zone: str
    name: str  # the VM's name, "<experiment>-coordinator"
    trains: bool  # False: a CPU VM that only hosts the rendezvous store
    running: bool  # False (group.workers = 0): stopped, disks and IP kept
    depends_on: tuple = ()  # grants and code objects, as for the group
    #: Overrides `running`: an expression that stops the coordinator once the job is done
    #: (`stacks.scale_to_zero`).
    desired_status: str | None = None


class Coordinator(Construct):
    """Exposes `address` (the static internal IP) and `instance`."""

    def __init__(self, scope: Construct, id_: str, props: CoordinatorProps) -> None:
        super().__init__(scope, id_)
        p, vm = props, props.vm
        self.address = ComputeAddress(
            self,
            "address",
            project=vm.project,
            region=vm.region,
            name=p.name,
            description="spottrain: the pool coordinator's internal IP (rendezvous endpoint)",
            address_type="INTERNAL",
            subnetwork=vm.subnetwork if vm.subnetwork_project is None else
            f"projects/{vm.subnetwork_project}/regions/{vm.region}/subnetworks/{vm.subnetwork}",
            labels=vm.labels,
        )
        self.disk = ComputeDisk(
            self,
            "checkpoint-disk",
            project=vm.project,
            zone=p.zone,
            name=f"{p.name}-ckpt",
            description="spottrain: the coordinator's persistent checkpoint tier",
            type="pd-ssd",
            size=vm.checkpoint_disk_gb,
            labels=vm.labels,
        )
        self.instance = ComputeInstance(
            self,
            "instance",
            project=vm.project,
            zone=p.zone,
            name=p.name,
            description="spottrain pool coordinator: on demand, hosts the rendezvous",
            machine_type=vm.machine_type,
            labels=vm.labels,
            tags=[vm.network_tag],
            desired_status=p.desired_status or ("RUNNING" if p.running else "TERMINATED"),
            allow_stopping_for_update=True,
            boot_disk=ComputeInstanceBootDisk(
                auto_delete=True,
                initialize_params=ComputeInstanceBootDiskInitializeParams(
                    image=vm.image,
                    size=vm.boot_disk_gb,
                    type="pd-balanced",
                    labels=vm.labels,
                ),
            ),
            # Same device name as the workers' disk: the startup script finds it by that name.
            attached_disk=[ComputeInstanceAttachedDisk(
                source=self.disk.id, device_name=DEVICE_NAME, mode="READ_WRITE")],
            scratch_disk=[ComputeInstanceScratchDisk(interface="NVME")
                          for _ in range(vm.local_ssd_count if p.trains else 0)] or None,
            guest_accelerator=[
                ComputeInstanceGuestAccelerator(type=vm.gpu_type, count=vm.gpu_count)
            ] if p.trains and vm.attach_gpus else None,
            scheduling=ComputeInstanceScheduling(
                provisioning_model="STANDARD",
                preemptible=False,
                automatic_restart=True,
                # GPUs cannot live-migrate; a CPU-only coordinator can, and so is never stopped
                # for host maintenance.
                on_host_maintenance="TERMINATE" if p.trains else "MIGRATE",
            ),
            network_interface=[
                # No access_config: no external IP. Egress goes through Cloud NAT.
                ComputeInstanceNetworkInterface(
                    subnetwork=vm.subnetwork,
                    subnetwork_project=vm.subnetwork_project,
                    network_ip=self.address.address,
                    nic_type="GVNIC" if vm.gvnic and p.trains else None,
                )
            ],
            service_account=ComputeInstanceServiceAccount(
                email=vm.service_account_email, scopes=["cloud-platform"]),
            shielded_instance_config=ComputeInstanceShieldedInstanceConfig(
                # As the template: the driver installed at first boot is not signed.
                enable_secure_boot=False,
                enable_vtpm=True,
                enable_integrity_monitoring=True,
            ),
            # Its shutdown window (the startup script's) and its ledger's placement: standard.
            metadata={**vm.metadata(role=COORDINATOR, gpus=p.trains), PROVISIONING_KEY: "STANDARD"},
            metadata_startup_script=vm.scripts.startup,
            depends_on=list(p.depends_on) or None,
        )
