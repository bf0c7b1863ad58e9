"""The trainer's identity: a dedicated service account and its least-privilege IAM.

Object admin on the checkpoint bucket only (a bucket-level binding, not a project role), object
viewer on the `[data]` bucket only (read, never write), accessor and version adder on the
experiment's checkpoint-key secret only (a secret-level binding), log writer and metric writer on
the project. The VMs never run as the default compute account.
"""

from __future__ import annotations

from dataclasses import dataclass

from cdktn_provider_google.project_iam_member import ProjectIamMember
from cdktn_provider_google.secret_manager_secret_iam_member import SecretManagerSecretIamMember
from cdktn_provider_google.service_account import ServiceAccount
from cdktn_provider_google.storage_bucket_iam_member import StorageBucketIamMember
from constructs import Construct

PROJECT_ROLES = ("roles/logging.logWriter", "roles/monitoring.metricWriter")
BUCKET_ROLE = "roles/storage.objectAdmin"
#: On the `[data]` bucket: list and read objects, nothing else.
DATA_BUCKET_ROLE = "roles/storage.objectViewer"
#: On the checkpoint-key secret: read version 1, and add it on the first boot.
KEY_ROLES = ("roles/secretmanager.secretAccessor", "roles/secretmanager.secretVersionAdder")


@dataclass(frozen=True)
class IdentityProps:
    project: str
    account_id: str
    experiment: str


class Identity(Construct):
    """Service account `<experiment>-trainer` with project log/metric roles."""

    def __init__(self, scope: Construct, id_: str, props: IdentityProps) -> None:
        super().__init__(scope, id_)
        self.account = ServiceAccount(
            self,
            "account",
            project=props.project,
            account_id=props.account_id,
            display_name=f"spottrain trainer for {props.experiment}",
            description="Runs the spottrain trainer VMs; no roles beyond logs, metrics, "
            "its checkpoint bucket and its checkpoint key.",
        )
        self.member = f"serviceAccount:{self.account.email}"
        #: Every grant, so VMs can wait for them: a trainer that starts before its bucket role
        #: exists cannot upload its first checkpoint.
        self.grants: list[ProjectIamMember | StorageBucketIamMember | SecretManagerSecretIamMember] = []
        for role in PROJECT_ROLES:
            member = ProjectIamMember(
                self,
                role.split("/")[1],
                project=props.project,
                role=role,
                member=self.member,
            )
            self.grants.append(member)

    @property
    def email(self) -> str:
        return self.account.email

    def grant_bucket(self, bucket_name: str) -> StorageBucketIamMember:
        """Object admin on that one bucket: read, write and delete checkpoints."""
        grant = StorageBucketIamMember(
            self, "bucket-object-admin", bucket=bucket_name, role=BUCKET_ROLE, member=self.member
        )
        self.grants.append(grant)
        return grant

    def grant_data_bucket(self, bucket_name: str) -> StorageBucketIamMember:
        """Object viewer on the `[data]` bucket: list and read the dataset, nothing else."""
        grant = StorageBucketIamMember(
            self, "data-object-viewer", bucket=bucket_name, role=DATA_BUCKET_ROLE, member=self.member
        )
        self.grants.append(grant)
        return grant

    def grant_checkpoint_key(self, project: str, secret_id: str) -> list[SecretManagerSecretIamMember]:
        """Accessor and version adder on that one secret (`stacks.checkpoint_key`): read the key,
        and create it on the first boot. Nothing on any other secret."""
        grants = [SecretManagerSecretIamMember(self, f"checkpoint-key-{role.split('.')[-1]}", project=project,
                                               secret_id=secret_id, role=role, member=self.member)
                  for role in KEY_ROLES]
        self.grants.extend(grants)
        return grants
