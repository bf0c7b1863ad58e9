"""The experiment's checkpoint key: a Secret Manager secret that its VMs fill and read.

Every checkpoint manifest carries an HMAC made with this key, and the trainer loads only
checkpoints whose HMAC verifies (`trainer.checkpoint_key`, docs/security.md): a principal who can
write the checkpoint bucket but cannot read this secret cannot make a VM, or an operator's
`trainer status`, load a checkpoint of their making.

- One `google_secret_manager_secret` per experiment, `<experiment>-checkpoint-key`, and **no
  version in Terraform**: the key never appears in the state, a plan or the synthesized JSON. The
  first VM that boots adds version 1 (32 random bytes) and every VM reads version 1; VMs racing on a
  first boot converge on version 1 (`trainer.checkpoint_key.fetch`).
- Replicated only in the experiment's region (user-managed replication): the key stays where the
  VMs run, and organisations that restrict resource locations accept it.
- Kept by `destroy` unless the bucket may be force-destroyed: without the key, the bucket's
  checkpoints can no longer be resumed, so the secret goes where the bucket goes. The provider's
  `deletion_policy = "ABANDON"` makes a destroy forget it (it stays in the project, with its
  version) rather than refuse: `deletion_protection = true`, used before, made every destroy fail
  and could only be lifted by an apply. A destroyed version stays recoverable (disabled) for
  `VERSION_DESTROY_TTL` before it is gone.
- Who can read it: the trainer's service account (`Identity.grant_checkpoint_key`: accessor and
  version adder on this one secret), and principals with Secret Manager access on the project
  (Owners, Secret Manager admins or accessors). Bucket roles (objectAdmin, objectUser) give none.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cdktn_provider_google.secret_manager_secret import (
    SecretManagerSecret,
    SecretManagerSecretReplication,
    SecretManagerSecretReplicationUserManaged,
    SecretManagerSecretReplicationUserManagedReplicas,
)
from constructs import Construct

from stacks.checkpoint_key_name import secret_id, secret_name

#: A destroyed key version is only disabled for this long (recoverable), then destroyed.
VERSION_DESTROY_TTL = f"{30 * 86400}s"


@dataclass(frozen=True)
class CheckpointKeyProps:
    project: str
    experiment: str
    region: str
    keep: bool  # a destroy leaves it in the project (not when the bucket may be force-destroyed)
    labels: dict[str, str] = field(default_factory=dict)


class CheckpointKeySecret(Construct):
    """The secret; `secret_id` (a reference) for IAM bindings, `name` for the boot."""

    def __init__(self, scope: Construct, id_: str, props: CheckpointKeyProps) -> None:
        super().__init__(scope, id_)
        self.secret = SecretManagerSecret(
            self,
            "secret",
            project=props.project,
            secret_id=secret_id(props.experiment),
            replication=SecretManagerSecretReplication(
                user_managed=SecretManagerSecretReplicationUserManaged(
                    replicas=[SecretManagerSecretReplicationUserManagedReplicas(location=props.region)])),
            labels=props.labels,
            # Destroy forgets it (kept with the bucket) or deletes it (with a force-destroyed
            # bucket); never a refusal that leaves the destroy unfinished.
            deletion_policy="ABANDON" if props.keep else None,
            deletion_protection=False,
            version_destroy_ttl=VERSION_DESTROY_TTL,
        )
        self.name = secret_name(props.project, props.experiment)

    @property
    def secret_id(self) -> str:
        return self.secret.secret_id
