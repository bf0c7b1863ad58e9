"""The on-demand fallback: a second group on demand, and a scheduled check that moves the job.

`capacity.on_demand_fallback_minutes` adds, beside the Spot group:
- `<experiment>-od-group`: the same VM with standard provisioning (its own template), created at
  target size 0. From then on the check owns both groups' sizes: Terraform ignores `target_size`
  on both (`group.workers = 0` reaches the check as `paused`, and it takes both to zero).
- A Cloud Run job `<experiment>-capacity` that runs one check (`trainer.capacity`) and exits,
  started by a Cloud Scheduler job every `capacity.fallback_check_minutes`. The job's container
  is Google's Cloud SDK image (a Python 3 with the standard library, which is all the check
  needs); it fetches the trainer archive this stack already delivers to the bucket, checks its
  sha256 and runs it: the same code the tests and the capacity simulation run.
- Its own service account `<experiment>-capacity` with: a custom role (group get/update, which
  covers resize and listManagedInstances) under a condition naming the two groups;
  `roles/compute.viewer` on the project for the Compute API's capacity advice (the narrowest
  documented role that includes it); read access to the bucket's `code/` and `runs/<exp>/stop/`
  and read-write to `runs/<exp>/capacity/` (conditions on object names); and run.invoker on its
  own job, so that Cloud Scheduler can start it as this account.
Nothing runs between checks: a check costs a few seconds of Cloud Run CPU.
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
from cdktn_provider_google.project_iam_custom_role import ProjectIamCustomRole
from cdktn_provider_google.project_iam_member import ProjectIamMember, ProjectIamMemberCondition
from cdktn_provider_google.service_account import ServiceAccount
from cdktn_provider_google.storage_bucket_iam_member import (
    StorageBucketIamMember,
    StorageBucketIamMemberCondition,
)
from constructs import Construct

from stacks.boot import Release
from stacks.scale_to_zero import group_resource

#: Google's Cloud SDK image: Python 3 on a Google-published image (no build step, no registry of
#: ours). Pin a digest here to freeze it.
CHECK_IMAGE = "gcr.io/google.com/cloudsdktool/google-cloud-cli:slim"
#: The container's program: fetch the delivered trainer archive, check its sha256, run one check.
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
from trainer.capacity import main
sys.exit(main())
"""


@dataclass(frozen=True)
class FallbackProps:
    project: str
    region: str
    name: str  # the experiment
    location: str  # zones/<zone> or regions/<region>
    spot_group: str
    od_group: str
    machine_type: str
    zones: tuple[str, ...]
    bucket: str
    stop_markers: tuple[str, ...]
    paused: bool
    fallback_after_s: int
    min_on_demand_s: int
    back_to_spot: float
    check_minutes: int
    code: Release  # the delivered trainer archive
    labels: dict[str, str] = field(default_factory=dict)
    depends_on: tuple[Any, ...] = field(default_factory=tuple)  # the code object


def check_settings(p: FallbackProps) -> dict[str, Any]:
    """`trainer.capacity.Settings` as the job receives it."""
    return {"project": p.project, "region": p.region, "location": p.location, "spot_group": p.spot_group,
            "od_group": p.od_group, "machine_type": p.machine_type, "zones": list(p.zones),
            "bucket": p.bucket, "state_object": f"runs/{p.name}/capacity/state.json",
            "stop_markers": list(p.stop_markers), "paused": p.paused,
            "fallback_after_s": p.fallback_after_s, "min_on_demand_s": p.min_on_demand_s,
            "back_to_spot": p.back_to_spot}


class OnDemandFallback(Construct):
    """Exposes `account`, `job` and `scheduler`."""

    def __init__(self, scope: Construct, id_: str, props: FallbackProps) -> None:
        super().__init__(scope, id_)
        p = props
        name = f"{p.name}-capacity"
        self.account = ServiceAccount(
            self, "account", project=p.project, account_id=name,
            display_name=f"spottrain capacity check for {p.name}",
            description="Moves one experiment between its Spot and on-demand groups; nothing else.")
        member = f"serviceAccount:{self.account.email}"
        role = ProjectIamCustomRole(
            self, "role", project=p.project, role_id=f"spottrain_{p.name.replace('-', '_')}_capacity",
            title=f"spottrain {p.name}: move between Spot and on demand",
            description="Read and resize the two groups of one experiment (bound under a condition).",
            permissions=["compute.instanceGroupManagers.get", "compute.instanceGroupManagers.update"])
        groups = " || ".join(f'resource.name == "{group_resource(p.project, p.location, g)}"'
                             for g in (p.spot_group, p.od_group))
        self.grants: list[Any] = [
            ProjectIamMember(self, "groups", project=p.project, role=role.name, member=member,
                             condition=ProjectIamMemberCondition(
                                 title=f"only-{p.name}-groups", expression=groups,
                                 description="The capacity check may resize these two groups only.")),
            ProjectIamMember(self, "advice", project=p.project, role="roles/compute.viewer", member=member),
        ]
        objects = f"projects/_/buckets/{p.bucket}/objects/"
        self.grants += [
            StorageBucketIamMember(
                self, "read-code-and-markers", bucket=p.bucket, role="roles/storage.objectViewer", member=member,
                condition=StorageBucketIamMemberCondition(
                    title="code-and-stop-markers", description="The delivered code and the stop markers.",
                    expression=f'resource.name.startsWith("{objects}code/") || '
                               f'resource.name.startsWith("{objects}runs/{p.name}/stop/")')),
            StorageBucketIamMember(
                self, "own-state", bucket=p.bucket, role="roles/storage.objectUser", member=member,
                condition=StorageBucketIamMemberCondition(
                    title="capacity-state", description="The check's own state object.",
                    expression=f'resource.name.startsWith("{objects}runs/{p.name}/capacity/")')),
        ]
        env = {"SPOTTRAIN_CAPACITY": json.dumps(check_settings(p), sort_keys=True),
               "SPOTTRAIN_BUCKET": p.bucket, "SPOTTRAIN_CODE_OBJECT": p.code.object_name,
               "SPOTTRAIN_CODE_SHA256": p.code.sha256}
        self.job = CloudRunV2Job(
            self, "job", project=p.project, location=p.region, name=name, labels=p.labels,
            deletion_protection=False,
            template=CloudRunV2JobTemplate(task_count=1, template=CloudRunV2JobTemplateTemplate(
                service_account=self.account.email, max_retries=0, timeout="300s",
                containers=[CloudRunV2JobTemplateTemplateContainers(
                    image=CHECK_IMAGE, command=["python3", "-c", BOOTSTRAP],
                    env=[CloudRunV2JobTemplateTemplateContainersEnv(name=k, value=v)
                         for k, v in sorted(env.items())])])),
            depends_on=[*p.depends_on, *self.grants] or None,
        )
        invoker = CloudRunV2JobIamMember(self, "invoker", project=p.project, location=p.region,
                                         name=self.job.name, role="roles/run.invoker", member=member)
        self.scheduler = CloudSchedulerJob(
            self, "schedule", project=p.project, region=p.region, name=name,
            description=f"spottrain: the capacity check of {p.name}",
            schedule=f"*/{p.check_minutes} * * * *" if p.check_minutes < 60 else "0 * * * *",
            attempt_deadline="320s",
            http_target=CloudSchedulerJobHttpTarget(
                http_method="POST",
                uri=f"https://run.googleapis.com/v2/projects/{p.project}/locations/{p.region}/jobs/{name}:run",
                oauth_token=CloudSchedulerJobHttpTargetOauthToken(
                    service_account_email=self.account.email,
                    scope="https://www.googleapis.com/auth/cloud-platform")),
            depends_on=[invoker],
        )
