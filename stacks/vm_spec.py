"""The trainer VM as the experiment declares it: one `VmSpec`, built once by `vm_spec`.

It owns what every spottrain VM of an experiment shares: the project and region, the machine
type and its GPUs (attached or built in) and network interface, the provisioning as declared
(Spot with its termination action, standard, or flex-start with its run duration), the image
and boot disk, the checkpoint disk and local SSDs, the service account, the subnetwork and
network tag, the boot scripts, the labels, and the instance metadata every VM carries.

Its readers build the resources from it and keep only what differs between them in their own
props: the group's template (`stacks.instance_template`: its part in a pool, its name suffix,
whether the group keeps the disk), the on-demand fallback's template (the same VM on standard
provisioning, `VmSpec.on_demand`) and the pool's coordinator (`stacks.coordinator`: its own
machine type through `VmSpec.on_machine`, whether it trains or runs). So a new property of the
VM is one field here, filled in `vm_spec`, and read where a resource sets it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from stacks import gcp_rules as R
from stacks.boot import BootScripts
from stacks.experiment import Experiment
from stacks.pool import ROLE_KEY

Provisioning = Literal["spot", "standard", "flex-start"]


@dataclass(frozen=True)
class VmSpec:
    project: str
    region: str
    name: str  # the experiment: templates are named after it
    machine_type: str
    gpu_type: str
    gpu_count: int
    attach_gpus: bool  # only N1 takes guest_accelerator; a2/a3/g2 have theirs built in
    gvnic: bool  # A3 boots only with the gVNIC interface
    provisioning: Provisioning
    termination_action: str  # what Compute Engine does to a preempted Spot VM
    flex_max_run_s: int | None  # flex-start: each VM runs at most this long, then is deleted
    image_project: str
    image_family: str
    boot_disk_gb: int
    checkpoint_disk_gb: int
    local_ssd_count: int
    service_account_email: str
    subnetwork: str  # id, or name with subnetwork_project (a shared VPC)
    subnetwork_project: str | None
    network_tag: str
    scripts: BootScripts
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def image(self) -> str:
        return f"projects/{self.image_project}/global/images/family/{self.image_family}"

    def metadata(self, *, role: str | None, gpus: bool = True) -> dict[str, str]:
        """The instance metadata every VM carries, but the startup script: a template holds it
        as metadata, the coordinator as `metadata_startup_script` (which replaces the VM when
        it changes). `role`: the VM's part in a pool (`stacks.pool`), None for a single VM."""
        metadata = {
            "shutdown-script": self.scripts.shutdown,
            "enable-oslogin": "TRUE",
            "block-project-ssh-keys": "TRUE",
            # The boot path reports its state (training, finished, ...) as guest attributes.
            "enable-guest-attributes": "TRUE",
        }
        if gpus:
            metadata["install-nvidia-driver"] = "True"
        if role is not None:
            metadata[ROLE_KEY] = role
        return metadata

    def on_demand(self) -> VmSpec:
        """The same VM with standard provisioning: the on-demand fallback's (`stacks.fallback`)."""
        return replace(self, provisioning="standard", flex_max_run_s=None)

    def on_machine(self, machine_type: str) -> VmSpec:
        """The same VM on another machine type (the pool's coordinator), with the GPUs and network
        interface that type takes; a type without GPUs (a coordinator that does not train, whose
        reader attaches none) keeps this VM's."""
        shape = R.MACHINE_TYPES.get(machine_type)
        if shape is None:
            return replace(self, machine_type=machine_type)
        return replace(self, machine_type=machine_type, attach_gpus=shape.gpu_type is None,
                       gvnic=shape.gvnic_required)


def vm_spec(name: str, exp: Experiment, *, service_account_email: str, subnetwork: str,
            subnetwork_project: str | None, network_tag: str, scripts: BootScripts,
            labels: dict[str, str]) -> VmSpec:
    """The experiment's VM; the arguments are what the stack makes for it first (the account,
    the network, the boot scripts)."""
    m = exp.machine
    return VmSpec(
        project=exp.gcp.project,
        region=exp.gcp.region,
        name=name,
        machine_type=m.machine_type,
        gpu_type=m.gpu_type,
        gpu_count=m.gpu_count,
        attach_gpus=m.shape.gpu_type is None,
        gvnic=m.shape.gvnic_required,
        provisioning=m.provisioning,
        termination_action=m.termination_action,
        flex_max_run_s=exp.capacity.flex_max_run_hours * 3600 if m.provisioning == "flex-start" else None,
        image_project=m.image_project,
        image_family=m.image_family,
        boot_disk_gb=m.boot_disk_gb,
        checkpoint_disk_gb=exp.disk.checkpoint_disk_gb,
        local_ssd_count=exp.disk.local_ssd_count,
        service_account_email=service_account_email,
        subnetwork=subnetwork,
        subnetwork_project=subnetwork_project,
        network_tag=network_tag,
        scripts=scripts,
        labels=dict(labels),
    )
