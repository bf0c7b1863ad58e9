"""`TrainingStack`: one experiment's whole training environment as one Terraform stack.

Composes the constructs (APIs, identity, bucket, network, firewall, template, group), the provider,
the state backend and the outputs a user needs next (bucket, group, account, log commands). A
`[pool]` adds the on-demand coordinator, its private DNS name and the firewall rule between the
pool's nodes (`stacks.pool`), and sizes the group for the Spot workers.
"""

from __future__ import annotations

import os

from cdktn import Aspects, GcsBackend, LocalBackend, TerraformOutput, TerraformStack
from cdktn_provider_google.provider import GoogleProvider
from constructs import Construct

from stacks import apis as A
from stacks import gcp_rules as R
from stacks.boot import BootProps, BootScripts, boot_props, group_name, render
from stacks.bucket import CheckpointBucket, CheckpointBucketProps
from stacks.checkpoint_key import CheckpointKeyProps, CheckpointKeySecret
from stacks.delivery import Archive, CodeDelivery, DeliveryProps, trainer_archive, user_archive, wheels_archive
from stacks.experiment import Experiment, code_path
from stacks.control import BACKSTOP_MINUTES, ControlJob, ControlProps, control_settings, needs_control
from stacks.fallback import FallbackProps, check_settings
from stacks.flex_start import FlexStartGroup, FlexStartProps
from stacks.group import GroupProps, TrainerGroup
from stacks.health import SINGLE_VM, pool_timing
from stacks.identity import Identity, IdentityProps
from stacks.instance_template import TemplateProps, TrainerTemplate
from stacks.coordinator import Coordinator, CoordinatorProps
from stacks.network import (
    DnsQueryLogging,
    DnsQueryLoggingProps,
    FirewallProps,
    NetworkProps,
    PoolFirewall,
    PoolFirewallProps,
    SharedVpcNetworkUser,
    SharedVpcNetworkUserProps,
    TrainerFirewall,
    TrainerNetwork,
)
from stacks.pool import WORKER, PoolLayout, layout
from stacks.pool_dns import PoolDns, PoolDnsProps
from stacks.wheels import shipped_wheels
from stacks.scale_to_zero import ScaleToZero, ScaleToZeroProps
from stacks.vm_spec import vm_spec
from trainer.cloud import scale as vm_scale

#: Set by `make deploy|diff --adopt-kept` for the synthesis (stacks.deploy): import the kept bucket and
#: key into the state (Terraform `import` blocks, >= 1.5) instead of creating them.
ADOPT_ENV = "SPOTTRAIN_ADOPT_KEPT"


def boot_scripts(name: str, exp: Experiment) -> tuple[list[Archive], BootProps, BootScripts]:
    """(the archives the stack delivers, the boot's props, its rendered scripts): what the stack
    synthesizes, and what `make deploy` needs to know the stop markers' names before it runs."""
    # The trainer (and the user's code) as content-named objects in the bucket: a code
    # change renames them, which changes the startup script and so the template.
    archives = [trainer_archive()]
    code = code_path(exp.trainer.code_dir) if exp.trainer.code_dir is not None else None
    if code is not None:
        archives.append(user_archive(code))
    # The dependencies as wheels for the image's Python, exactly as the committed lock names
    # them (never resolved here): the VM installs them offline.
    archives.append(wheels_archive(shipped_wheels(exp, code, name)))
    props = boot_props(name, exp, releases=tuple(a.release for a in archives))
    return archives, props, render(props)


def stop_markers(name: str, props: BootProps, scripts: BootScripts) -> dict[str, str] | None:
    """reason -> the stop marker object whose existence the stack's data sources read
    (`stacks.scale_to_zero`); None when the stack has none (its VMs never scale their group)."""
    if props.scale is None:
        return None
    return vm_scale.markers(f"runs/{name}", props.steps, vm_scale.digest(scripts.startup))


def state_path(name: str) -> str:
    # Terraform runs in cdktf.out/stacks/<name>/; keep state in the repository root, where
    # `make clean` (which removes cdktf.out) cannot delete it.
    return f"../../../terraform.{name}.tfstate"


class TrainingStack(TerraformStack):
    def __init__(self, scope: Construct, name: str, exp: Experiment) -> None:
        super().__init__(scope, name)
        gcp, m = exp.gcp, exp.machine
        labels = {**exp.labels, "spottrain-experiment": name}
        tag = f"{name}-trainer"

        GoogleProvider(self, "google", project=gcp.project, region=gcp.region)
        if exp.backend.type == "gcs":
            assert exp.backend.bucket  # validated upstream
            GcsBackend(self, bucket=exp.backend.bucket,
                       prefix=exp.backend.prefix or f"spottrain/{name}")
        else:
            LocalBackend(self, path=state_path(name))
        identity = Identity(self, "identity", IdentityProps(
            project=gcp.project, account_id=f"{name}{R.SA_SUFFIX}", experiment=name))
        bucket = CheckpointBucket(self, "checkpoints", CheckpointBucketProps(
            project=gcp.project,
            name=exp.bucket_name(name),
            location=exp.bucket.bucket_location,
            force_destroy=exp.bucket.force_destroy,
            versioning=exp.bucket.versioning,
            keep_noncurrent_versions=exp.bucket.keep_noncurrent_versions,
            noncurrent_days=exp.bucket.noncurrent_days,
            soft_delete_days=exp.bucket.soft_delete_days,
            run_prefix=f"runs/{name}",
            labels=labels,
        ))
        identity.grant_bucket(bucket.name)
        if exp.data is not None:  # read on the dataset's bucket, which the stack does not own
            identity.grant_data_bucket(exp.data.bucket)
        # The key that authenticates its checkpoints (the boot fetches it; docs/security.md).
        key = CheckpointKeySecret(self, "checkpoint-key", CheckpointKeyProps(
            project=gcp.project, experiment=name, region=gcp.region,
            keep=not exp.bucket.force_destroy, labels=labels))
        identity.grant_checkpoint_key(gcp.project, key.secret_id)
        if os.environ.get(ADOPT_ENV) == "1" and not exp.bucket.force_destroy:
            # A destroy left both in the project: import them rather than fail creating them.
            bucket.bucket.import_from(f"{gcp.project}/{exp.bucket_name(name)}")
            key.secret.import_from(key.name)

        net = exp.network
        network = TrainerNetwork(self, "network", NetworkProps(
            project=gcp.project,
            region=gcp.region,
            name=name,
            dedicated=net.mode == "dedicated",
            subnet_cidr=net.subnet_cidr,
            existing_network=net.network,
            existing_subnetwork=net.subnetwork,
            subnetwork_project=net.subnetwork_project,
        ))
        pool = layout(name, exp)
        firewall_project = network.subnetwork_project or gcp.project
        # A shared VPC: the VMs' creator needs Network User on the host subnetwork.
        vm_creator_grants = []
        if net.shared_vpc_network_user == "grant":
            assert net.subnetwork and net.subnetwork_project  # validated upstream
            vm_creator_grants.append(SharedVpcNetworkUser(
                self, "shared-vpc", SharedVpcNetworkUserProps(
                    project=gcp.project, host_project=net.subnetwork_project,
                    region=gcp.region, subnetwork=net.subnetwork)).grant)
        if exp.dns_query_logging:
            DnsQueryLogging(self, "dns-logging", DnsQueryLoggingProps(
                project=firewall_project, name=name, network=network.network_ref))
        TrainerFirewall(self, "firewall", FirewallProps(
            # Shared VPC: firewall rules live in the host project.
            project=firewall_project,
            name=name,
            network=network.network_ref,
            target_tag=tag,
            health_port=exp.trainer.health_port,
            iap_ssh=net.iap_ssh,
        ))

        archives, props, scripts = boot_scripts(name, exp)
        delivery = CodeDelivery(self, "code", DeliveryProps(
            bucket=bucket.name, archives=tuple(archives)))

        c, flex = exp.capacity, m.provisioning == "flex-start"
        fallback = c.on_demand_fallback_minutes is not None
        regional = exp.group.placement == "regional"
        location = f"regions/{gcp.region}" if regional else f"zones/{gcp.zones[0]}"
        # Scale to zero when the job is done (and flex-start successors): `stacks.scale_to_zero`
        # keeps a stopped job at zero; the control job (`stacks.control`) does the resizing.
        stop: ScaleToZero | None = None
        if props.scale is not None:
            stop = ScaleToZero(self, "scale-to-zero", ScaleToZeroProps(
                bucket=bucket.name, prefix=f"runs/{name}", steps=props.steps,
                script_digest=vm_scale.digest(scripts.startup), depends_on=(bucket.bucket,)))
        control: ControlJob | None = None
        if needs_control(exp):
            markers = tuple(stop.marker_names.values()) if stop else tuple(
                vm_scale.markers(f"runs/{name}", exp.trainer.steps, "none").values())
            capacity = check_settings(FallbackProps(
                project=gcp.project, region=gcp.region, name=name, location=location,
                spot_group=group_name(name), od_group=group_name(name, "od"),
                machine_type=m.machine_type, zones=tuple(gcp.zones), bucket=bucket.name,
                stop_markers=markers, paused=exp.group.workers == 0,
                fallback_after_s=(c.on_demand_fallback_minutes or 0) * 60,
                min_on_demand_s=c.min_on_demand_minutes * 60,
                back_to_spot=c.back_to_spot_obtainability)) if fallback else None
            control = ControlJob(self, "control", ControlProps(
                project=gcp.project, region=gcp.region, name=name, bucket=bucket.name,
                settings=control_settings(
                    project=gcp.project, region=gcp.region, location=location,
                    groups=(group_name(name),) + ((group_name(name, "od"),) if fallback else ()),
                    bucket=bucket.name, prefix=f"runs/{name}", stop_markers=markers,
                    checkpoint_key_secret=key.name,
                    coordinator=f"zones/{gcp.zones[0]}/instances/{pool.coordinator_name}" if pool else None,
                    flex_run_duration_s=c.flex_max_run_hours * 3600 if flex else None, capacity=capacity),
                code=archives[0].release, vm_member=identity.member, key_secret_id=key.secret_id,
                schedule_minutes=c.fallback_check_minutes if fallback else BACKSTOP_MINUTES,
                capacity_advice=fallback, labels=labels, depends_on=tuple(delivery.objects)))
        # The VMs may start the control job: a VM that needs it must not boot before it may.
        may_stop = tuple(control.vm_grants) if control else ()
        vm = vm_spec(name, exp, service_account_email=identity.email, subnetwork=network.subnetwork,
                     subnetwork_project=network.subnetwork_project, network_tag=tag,
                     scripts=scripts, labels=labels)
        template_props = TemplateProps(
            vm=vm,
            depends_on=tuple(delivery.objects),
            role=WORKER if pool else None,
            # Only the Spot/standard group without a zone change keeps a stateful disk.
            checkpoint_disk_stateful=not flex and not c.zone_change_on_repair,
        )
        template = TrainerTemplate(self, "template", template_props)
        workers = pool.worker_target if pool else exp.group.workers
        group: TrainerGroup | FlexStartGroup
        if flex:
            group = FlexStartGroup(self, "group", FlexStartProps(
                project=gcp.project, region=gcp.region, zones=tuple(gcp.zones), name=name,
                regional=regional, workers=workers, template_self_link=template.self_link_unique,
                health_port=exp.trainer.health_port, run_duration_s=c.flex_max_run_hours * 3600,
                depends_on=(*identity.grants, *vm_creator_grants, *may_stop)))
        else:
            group_props = GroupProps(
                project=gcp.project,
                region=gcp.region,
                zones=tuple(gcp.zones),
                name=name,
                regional=regional,
                workers=stop.target_size(workers) if stop else workers,
                template_self_link=template.self_link_unique,
                health_port=exp.trainer.health_port,
                initial_delay_sec=exp.group.initial_delay_sec,
                health=pool_timing(exp.pool.rendezvous_last_call_s) if exp.pool else SINGLE_VM,
                # A short job may finish minutes after its VM starts: its role must exist by then.
                depends_on=(*identity.grants, *vm_creator_grants, *may_stop),
                stateful=template_props.checkpoint_disk_stateful,
                zone_change=c.zone_change_on_repair,
                machine_types=tuple(c.machine_types),
                primary_machine_type=m.machine_type,
                size_managed_elsewhere=fallback,
            )
            group = TrainerGroup(self, "group", group_props)
        if fallback:
            self._fallback(template_props, group_props)

        if pool is not None:
            coordinator = Coordinator(self, "coordinator", CoordinatorProps(
                vm=vm.on_machine(pool.coordinator_machine_type),
                zone=gcp.zones[0],
                name=pool.coordinator_name,
                trains=pool.coordinator_trains,
                running=pool.running,
                desired_status=stop.coordinator_status(pool.running) if stop else None,
                depends_on=(*identity.grants, *delivery.objects, *may_stop),
            ))
            PoolDns(self, "pool-dns", PoolDnsProps(
                project=gcp.project,
                zone_name=f"{name}-pool",
                domain=pool.dns_domain,
                host=pool.coordinator_host,
                network=network.network_ref,
                address=coordinator.address.address,
                labels=labels,
            ))
            PoolFirewall(self, "pool-firewall", PoolFirewallProps(
                project=firewall_project,
                name=name,
                network=network.network_ref,
                service_account_email=identity.email,
            ))
            self._pool_outputs(exp, pool, coordinator)
            if control is not None:
                control.grant_coordinator(gcp.zones[0], coordinator.instance.name)

        self._watch(name, exp, labels)
        self._outputs(name, exp, bucket.name, group, identity.email, regional)
        if stop is not None:
            TerraformOutput(self, "stop_markers", value=" ".join(
                f"gs://{exp.bucket_name(name)}/{n}" for n in stop.marker_names.values()),
                description="The job stopped itself (finished, or bad input) when one of these "
                "objects exists; the next deploy keeps the group at zero. Delete it to start again")
        if control is not None:
            TerraformOutput(self, "control_log_command", value=(
                f"gcloud logging read 'resource.type=\"cloud_run_job\" AND resource.labels.job_name=\""
                f"{control.job.name}\"' --project {gcp.project} --limit 20"),
                description="What the control job did (scale to zero, successors, the fallback's "
                "decisions), newest first")

        # Last, once every resource exists: the APIs they need; everything else waits for them.
        apis = A.ProjectApis(self, "apis", A.ApisProps(project=gcp.project,
                                                       services=tuple(A.required(self))))
        Aspects.of(self).add(A.WaitForApis(apis))

    def _fallback(self, template_props: TemplateProps, group_props: GroupProps) -> None:
        """The on-demand group (`stacks.fallback`); the control job runs its check."""
        import dataclasses

        od_template = TrainerTemplate(self, "od-template", dataclasses.replace(
            template_props, vm=template_props.vm.on_demand(), name_suffix="od"))
        TrainerGroup(self, "od-group", dataclasses.replace(
            group_props, kind="od", workers=0, template_self_link=od_template.self_link_unique))

    def _watch(self, name: str, exp: Experiment, labels: dict[str, str]) -> None:
        """Log-based metrics, alerts, the dashboard and the budget (docs/watch.md)."""
        from stacks.alerts import AlertsProps, RunAlerts
        from stacks.billing_budget import BudgetProps, RunBudget
        from stacks.dashboard import DashboardProps, RunDashboard

        alerts = RunAlerts(self, "alerts", AlertsProps(project=exp.gcp.project, name=name, exp=exp, labels=labels))
        RunDashboard(self, "dashboard", DashboardProps(project=exp.gcp.project, name=name, exp=exp))
        if exp.budget is not None:
            RunBudget(self, "budget", BudgetProps(project=exp.gcp.project, name=name, budget=exp.budget,
                                                  channels=[c.name for c in alerts.email_channels]))
        TerraformOutput(self, "logs_command", value=f"make logs EXPERIMENT={name}",
                        description="Every session of the run across recreated VMs, and how each ended "
                        "(python -m trainer logs; docs/watch.md)")

    def _pool_outputs(self, exp: Experiment, pool: PoolLayout, coordinator: Coordinator) -> None:
        where = f"--project {exp.gcp.project} --zone {exp.gcp.zones[0]}"
        outputs = {
            "coordinator_name": (coordinator.instance.name,
                                 "The pool's on-demand coordinator VM"),
            "coordinator_ip": (coordinator.address.address,
                               "The coordinator's static internal IP"),
            "rendezvous_endpoint": (pool.endpoint,
                                    "torchrun's --rdzv-endpoint (private DNS, inside the VPC)"),
            "coordinator_log_command": (
                f"gcloud compute ssh {pool.coordinator_name} {where} --tunnel-through-iap -- "
                "sudo journalctl -u spottrain.service -f",
                "Follow the coordinator's journal through IAP SSH",
            ),
            "stop_coordinator_command": (
                f"gcloud compute instances stop {pool.coordinator_name} {where}",
                "Stop paying for the coordinator's VM (disks and IP kept; set group.workers = 0 "
                "so the next deploy agrees)",
            ),
        }
        for key, (value, description) in outputs.items():
            TerraformOutput(self, key, value=value, description=description)

    def _outputs(self, name: str, exp: Experiment, bucket: str, group: TrainerGroup | FlexStartGroup,
                 email: str, regional: bool) -> None:
        p = f"--project {exp.gcp.project}"
        where = f"--region {exp.gcp.region}" if regional else f"--zone {exp.gcp.zones[0]}"
        zone = "--zone ZONE" if regional else f"--zone {exp.gcp.zones[0]}"
        group_name = f"{name}-group"
        outputs = {
            "bucket": (bucket, "Checkpoint bucket (durable tier: runs/<experiment>/)"),
            "checkpoint_uri": (f"gs://{exp.bucket_name(name)}/runs/{name}",
                               "Where the trainer's durable checkpoints go"),
            "group_name": (group.manager.name, "Managed instance group"),
            "group_self_link": (group.manager.self_link, "Managed instance group self link"),
            "service_account": (email, "The trainer VMs' service account"),
            "list_instances_command": (
                f"gcloud compute instance-groups managed list-instances {group_name} {p} {where}",
                "List the trainer VMs (name, zone, status, health)",
            ),
            "serial_log_command": (
                f"gcloud compute instances get-serial-port-output INSTANCE {p} {zone}",
                "Boot and startup-script log of one VM (INSTANCE from list-instances)",
            ),
            "trainer_log_command": (
                f"gcloud compute ssh INSTANCE {p} {zone} --tunnel-through-iap -- "
                "sudo journalctl -u spottrain.service -f",
                "Follow the trainer's journal through IAP SSH",
            ),
            "state_command": (
                f"gcloud compute instances get-guest-attributes INSTANCE {p} {zone} "
                "--query-path=spottrain/state",
                "The VM's boot path state: starting, staging (the [data] dataset), training, "
                "finished (scale to zero now), "
                "failed (see serial_log_command), stopped-<trainer exit status>",
            ),
            "list_errors_command": (
                f"gcloud compute instance-groups managed list-errors {group_name} {p} {where}",
                "Why the group created no VM, or lost one (quota, capacity, permissions such as "
                "a shared VPC's Network User): the group's own errors, newest first",
            ),
            "scale_to_zero_command": (
                f"gcloud compute instance-groups managed resize {group_name} --size 0 {p} "
                f"{where}",
                "Stop paying now: deletes the VM and its checkpoint disk, the bucket keeps the "
                "checkpoints (set group.workers = 0 so the next deploy agrees)",
            ),
        }
        for key, (value, description) in outputs.items():
            TerraformOutput(self, key, value=value, description=description)


def synthesized(name: str, exp: Experiment) -> dict:
    """The stack of experiment ``exp`` (named ``name``) as `cdktn synth` writes it, as JSON: what
    the deployer's permissions (`stacks.preflight`) and the drill's stand-in IAM (`drill.iam`) are
    read from."""
    import json
    import shutil

    from cdktn import Testing

    app = Testing.app()
    try:
        return json.loads(Testing.synth(TrainingStack(app, name, exp)))
    finally:  # Testing.app() leaves a cdktf.outdir.* folder behind otherwise
        if "cdktf.outdir." in str(app.outdir):
            shutil.rmtree(app.outdir, ignore_errors=True)
