"""The experiment's control job: the only identity that may change the experiment's groups.

Built for every experiment whose VMs stop paying by themselves (`group.stop_when_done`), ask for
flex-start successors, or fall back to on demand (`trainer.cloud.control` runs in it):

- A service account `<experiment>-control`.
- A custom role `spottrain_<experiment>_control` with `compute.instanceGroupManagers.get` and
  `.update` (resize, resize requests, listManagedInstances), bound on the **project without a
  condition**. There is nothing narrower that Google honours: an instance group manager has no
  allow policy of its own (iam/docs/roles-permissions/compute lists none among the lowest-level
  resources of any Compute role), and IAM Conditions cannot name one
  (iam/docs/conditions-resource-attributes lists no such resource type, and a condition on an
  attribute a resource does not provide "is never interpreted as granting access",
  iam/docs/conditions-attribute-reference). The role is held by this job's account only, which
  runs nothing but the trainer package this stack delivers, pinned by its sha256.
- For a pool: a role `spottrain_<experiment>_control_vm` (`compute.instances.get`, `.stop`) bound
  on the coordinator instance itself (instances have allow policies of their own): that VM, no
  other.
- For the on-demand fallback: `roles/compute.viewer` on the project, for the capacity advice.
- On the bucket, under conditions on object names (objects support them): read the delivered code
  (`code/`), the stop markers (`runs/<exp>/stop/`) and the checkpoints' manifests a marker names
  (`runs/<exp>/step-`); read and write its own objects (`runs/<exp>/control/`: the outcome, the
  successor requests, the fallback's state). Listing is checked on the bucket (no name condition
  can match it): a custom role `spottrain_<experiment>_control_list` with `storage.objects.list`
  alone, bound on the bucket.
- On the checkpoint-key secret (`stacks.checkpoint_key`): `roles/secretmanager.secretAccessor`,
  bound on that one secret. The job acts on a stop marker only when the run signed it with that key
  and the bucket still holds what it names (`trainer.cloud.stop_marker`): a bucket writer can plant
  a marker's name, never the deletion of a disk ahead of the bucket.
- A Cloud Run job `<experiment>-control` (Google's Cloud SDK image: it fetches the trainer archive
  the stack delivers, checks its sha256 and runs one execution), `roles/run.invoker` on it for the
  **trainer's** account (a VM starts it when the job is done or wants a successor) and for its own
  (Cloud Scheduler starts it as the job's account: every `capacity.fallback_check_minutes` with the
  fallback, else every `BACKSTOP_MINUTES` as a backstop for a start that failed).

A VM's account gains exactly one thing here: running this one job. docs/security.md has the map of
who can do what to which resource.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from cdktn_provider_google.cloud_run_v2_job import (
    CloudRunV2Job,
    CloudRunV2JobTemplate,
    CloudRunV2JobTemplateTemplate,
    CloudRunV2JobTemplateTemplateContainers,
    CloudRunV2JobTemplateTemplateContainersEnv,
)
from cdktn_provider_google.cloud_run_v2_job_iam_member import CloudRunV2JobIamMember
from cdktn_provider_google.cloud_scheduler_job import (
    CloudSchedulerJob,
    CloudSchedulerJobHttpTarget,
    CloudSchedulerJobHttpTargetOauthToken,
)
from cdktn_provider_google.compute_instance_iam_member import ComputeInstanceIamMember
from cdktn_provider_google.project_iam_custom_role import ProjectIamCustomRole
from cdktn_provider_google.project_iam_member import ProjectIamMember
from cdktn_provider_google.secret_manager_secret_iam_member import SecretManagerSecretIamMember
from cdktn_provider_google.service_account import ServiceAccount
from cdktn_provider_google.storage_bucket_iam_member import (
    StorageBucketIamMember,
    StorageBucketIamMemberCondition,
)
from constructs import Construct

from stacks.boot import Release, control_job_name as job_name, needs_control  # noqa: F401 - re-exported

#: What the job may do to the experiment's groups (project-wide: see the module docstring).
GROUP_PERMISSIONS = ("compute.instanceGroupManagers.get", "compute.instanceGroupManagers.update")
#: On the bucket: list objects (names, sizes), so the job can tell the newest authentic checkpoint.
LIST_PERMISSIONS = ("storage.objects.list",)
#: On the checkpoint-key secret: read it (never add a version).
KEY_ROLE = "roles/secretmanager.secretAccessor"
#: What the job may do to a pool's coordinator (a binding on that instance).
COORDINATOR_PERMISSIONS = ("compute.instances.get", "compute.instances.stop")
#: How often Cloud Scheduler runs the job when no fallback sets the pace: the backstop for a VM
#: that could not start it (the stop marker is durable; the job acts on it at its next run).
BACKSTOP_MINUTES = 15
#: Google's Cloud SDK image: Python 3 on a Google-published image (no build step, no registry of
#: ours). Pin a digest here to freeze it.
CHECK_IMAGE = "gcr.io/google.com/cloudsdktool/google-cloud-cli:slim"
#: The container's program: fetch the delivered trainer archive, check its sha256, run the job.
BOOTSTRAP = """\
import hashlib, io, json, os, sys, tarfile, urllib.parse, urllib.request
host = os.environ.get("GCE_METADATA_HOST", "metadata.google.internal")
req = urllib.request.Request("http://" + host + "/computeMetadata/v1/instance/service-accounts/default/token",
                             headers={"Metadata-Flavor": "Google"})
token = json.load(urllib.request.urlopen(req, timeout=10))["access_token"]
name = os.environ["SPOTTRAIN_CODE_OBJECT"]
url = (os.environ.get("STORAGE_EMULATOR_HOST", "https://storage.googleapis.com") + "/storage/v1/b/"
       + os.environ["SPOTTRAIN_BUCKET"] + "/o/" + urllib.parse.quote(name, safe="") + "?alt=media")
data = urllib.request.urlopen(urllib.request.Request(url, headers={"Authorization": "Bearer " + token}),
                              timeout=120).read()
if hashlib.sha256(data).hexdigest() != os.environ["SPOTTRAIN_CODE_SHA256"]:
    sys.exit("refusing gs://" + os.environ["SPOTTRAIN_BUCKET"] + "/" + name + ": sha256 mismatch")
archive = tarfile.open(fileobj=io.BytesIO(data))
try:
    archive.extractall("/tmp/spottrain", filter="data")
except TypeError:  # Python before 3.11.4: no extraction filters
    archive.extractall("/tmp/spottrain")
sys.path.insert(0, "/tmp/spottrain")
from trainer.cloud.control import main
sys.exit(main())
"""


def control_settings(*, project: str, region: str, location: str, groups: tuple[str, ...], bucket: str,
                     prefix: str, stop_markers: tuple[str, ...], checkpoint_key_secret: str,
                     coordinator: str | None = None, flex_run_duration_s: int | None = None,
                     capacity: dict[str, Any] | None = None) -> dict[str, Any]:
    """`trainer.cloud.control.Settings` as the job receives it (the stack and the drill build it here).
    ``checkpoint_key_secret``: `projects/P/secrets/S`, the key that verifies a stop marker."""
    return {"project": project, "region": region, "location": location, "groups": list(groups),
            "bucket": bucket, "prefix": prefix, "stop_markers": list(stop_markers),
            "checkpoint_key_secret": checkpoint_key_secret,
            "coordinator": coordinator, "flex_run_duration_s": flex_run_duration_s, "capacity": capacity}


@dataclass(frozen=True)
class ControlProps:
    project: str
    region: str
    name: str  # the experiment
    bucket: str  # the bucket's name (a reference)
    settings: dict[str, Any]  # `control_settings(...)`
    code: Release  # the delivered trainer archive
    vm_member: str  # serviceAccount:... of the trainer VMs: they may start the job
    key_secret_id: str  # the checkpoint key's secret (a reference): the job reads it to verify stop markers
    schedule_minutes: int = BACKSTOP_MINUTES
    capacity_advice: bool = False  # the fallback asks the Compute API's capacity advice
    labels: dict[str, str] = field(default_factory=dict)
    depends_on: tuple[Any, ...] = field(default_factory=tuple)  # the code objects


class ControlJob(Construct):
    """Exposes `account`, `job`, `scheduler`, `grants` (the job's), `vm_grants` (the VMs' right to
    start it: a VM that needs it must not start before it), and `grant_coordinator()`."""

    def __init__(self, scope: Construct, id_: str, props: ControlProps) -> None:
        super().__init__(scope, id_)
        p = self._props = props
        name = job_name(p.name)
        self.account = ServiceAccount(
            self, "account", project=p.project, account_id=name,
            display_name=f"spottrain control job of {p.name}",
            description="Resizes the groups of one experiment and stops its coordinator; nothing else.")
        self.member = f"serviceAccount:{self.account.email}"
        ident = p.name.replace("-", "_")
        role = ProjectIamCustomRole(
            self, "role", project=p.project, role_id=f"spottrain_{ident}_control",
            title=f"spottrain {p.name}: resize its groups",
            description="Read and resize managed instance groups. Held by the experiment's control job "
                        "alone (group permissions cannot be narrowed below the project).",
            permissions=list(GROUP_PERMISSIONS))
        self.grants: list[Any] = [
            ProjectIamMember(self, "groups", project=p.project, role=role.name, member=self.member)]
        if p.capacity_advice:
            self.grants.append(ProjectIamMember(self, "advice", project=p.project, role="roles/compute.viewer",
                                                member=self.member))
        objects = f"projects/_/buckets/{p.bucket}/objects/"
        prefix = p.settings["prefix"]
        list_role = ProjectIamCustomRole(
            self, "list-role", project=p.project, role_id=f"spottrain_{ident}_control_list",
            title=f"spottrain {p.name}: list its bucket",
            description="List the objects of one bucket (names and sizes): bound on the experiment's bucket only.",
            permissions=list(LIST_PERMISSIONS))
        self.grants += [
            StorageBucketIamMember(
                self, "read-code-and-markers", bucket=p.bucket, role="roles/storage.objectViewer",
                member=self.member,
                condition=StorageBucketIamMemberCondition(
                    title="code-markers-manifests",
                    description="The delivered code, the stop markers and the checkpoints a marker names.",
                    expression=f'resource.name.startsWith("{objects}code/") || '
                               f'resource.name.startsWith("{objects}{prefix}/stop/") || '
                               f'resource.name.startsWith("{objects}{prefix}/step-")')),
            # Listing is checked on the bucket, never on an object name (a condition on a name
            # prefix never matches it): a role with nothing but `storage.objects.list` shows the
            # job the checkpoints' names and sizes, not their contents.
            StorageBucketIamMember(self, "list-objects", bucket=p.bucket, role=list_role.name, member=self.member),
            # The checkpoint key, to verify a marker (`trainer.cloud.stop_marker`): read version 1
            # of that one secret; never add one (a key of its own would verify nothing).
            SecretManagerSecretIamMember(self, "checkpoint-key-accessor", project=p.project,
                                         secret_id=p.key_secret_id, role=KEY_ROLE, member=self.member),
            StorageBucketIamMember(
                self, "own-objects", bucket=p.bucket, role="roles/storage.objectUser", member=self.member,
                condition=StorageBucketIamMemberCondition(
                    title="control-objects", description="The job's own objects: outcome, requests, state.",
                    expression=f'resource.name.startsWith("{objects}{prefix}/control/")')),
        ]
        env = {"SPOTTRAIN_CONTROL": json.dumps(p.settings, sort_keys=True), "SPOTTRAIN_BUCKET": p.bucket,
               "SPOTTRAIN_CODE_OBJECT": p.code.object_name, "SPOTTRAIN_CODE_SHA256": p.code.sha256}
        self.job = CloudRunV2Job(
            self, "job", project=p.project, location=p.region, name=name, labels=p.labels,
            deletion_protection=False,
            template=CloudRunV2JobTemplate(task_count=1, template=CloudRunV2JobTemplateTemplate(
                service_account=self.account.email, max_retries=0, timeout="900s",
                containers=[CloudRunV2JobTemplateTemplateContainers(
                    image=CHECK_IMAGE, command=["python3", "-c", BOOTSTRAP],
                    env=[CloudRunV2JobTemplateTemplateContainersEnv(name=k, value=v)
                         for k, v in sorted(env.items())])])),
            depends_on=[*p.depends_on, *self.grants] or None,
        )
        invoker = CloudRunV2JobIamMember(self, "invoker", project=p.project, location=p.region,
                                         name=self.job.name, role="roles/run.invoker", member=self.member)
        self.vm_grants: list[Any] = [CloudRunV2JobIamMember(
            self, "vm-invoker", project=p.project, location=p.region, name=self.job.name,
            role="roles/run.invoker", member=p.vm_member)]
        minutes = p.schedule_minutes
        self.scheduler = CloudSchedulerJob(
            self, "schedule", project=p.project, region=p.region, name=name,
            description=f"spottrain: the control job of {p.name}",
            schedule=f"*/{minutes} * * * *" if minutes < 60 else "0 * * * *",
            attempt_deadline="320s",
            http_target=CloudSchedulerJobHttpTarget(
                http_method="POST",
                uri=f"https://run.googleapis.com/v2/projects/{p.project}/locations/{p.region}/jobs/{name}:run",
                oauth_token=CloudSchedulerJobHttpTargetOauthToken(
                    service_account_email=self.account.email,
                    scope="https://www.googleapis.com/auth/cloud-platform")),
            depends_on=[invoker],
        )

    def grant_coordinator(self, zone: str, instance_name: str) -> None:
        """Let the job stop a pool's coordinator: a role bound on that instance alone."""
        p = self._props
        role = ProjectIamCustomRole(
            self, "coordinator-role", project=p.project,
            role_id=f"spottrain_{p.name.replace('-', '_')}_control_vm",
            title=f"spottrain {p.name}: stop its coordinator",
            description="Read and stop one VM (bound on the pool's coordinator instance only).",
            permissions=list(COORDINATOR_PERMISSIONS))
        self.grants.append(ComputeInstanceIamMember(
            self, "coordinator-binding", project=p.project, zone=zone, instance_name=instance_name,
            role=role.name, member=self.member))
