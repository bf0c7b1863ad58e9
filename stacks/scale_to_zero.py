"""Scale to zero when the job needs no VM: what lets a training VM shrink its own group, and what
keeps the next deploy from growing it again.

- A custom role `spottrain_<experiment>_scale` with only `compute.instanceGroupManagers.get` and
  `.update` (resize) and, for a pool, `compute.instances.get` and `.stop`.
- A project binding of that role to the trainer's service account under an IAM condition naming
  the one group: `resource.name == "projects/P/zones/Z/instanceGroupManagers/G"` (or
  `regions/R/...`). For a pool, a binding on the coordinator instance itself (instances have their
  own allow policies), so the VM can stop that VM and no other.
- Two data sources listing the stop markers the VM writes (`trainer.cloud.scale`): the finished marker of
  this step count and the bad-input marker of this startup script. When either exists, the
  group's target size is 0 (and a pool's coordinator is TERMINATED) whatever `group.workers` says,
  so the next `deploy` does not start a VM by surprise. More steps (a new finished marker name) or
  a fixed experiment (a new startup script, so a new bad-input marker name) start it again;
  deleting the marker object starts it again by hand.

On the first deploy the bucket does not exist yet: the data sources depend on it, so Terraform
reads them during apply and the target size is known only then.

Terraform sees only that an object exists (the data sources list by prefix: any object whose name
starts with a marker's counts), never whether the run signed it, and a resize to zero deletes the
VMs' checkpoint disks. So this construct alone would let a bucket writer without the key take the
group to zero at the next deploy. `make deploy` / `make diff` (`stacks.deploy.check_stop_markers`)
close that: before cdktn runs, every object these data sources would count is verified as the
control job verifies a marker (`trainer.cloud.control.judge`), and the deploy refuses (exit 2) unless
each one does. A `cdktn deploy` run by hand skips that check (docs/security.md, stop markers at
deploy time).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

from cdktn import Fn, Op, Token
from cdktn_provider_google.data_google_storage_bucket_objects import DataGoogleStorageBucketObjects
from constructs import Construct

from trainer.cloud.scale import markers


@dataclass(frozen=True)
class ScaleToZeroProps:
    bucket: str  # the bucket's name (a reference, so the data sources wait for it)
    prefix: str  # "runs/<experiment>"
    steps: int
    script_digest: str  # trainer.cloud.scale.digest of the startup script
    depends_on: tuple[Any, ...] = field(default_factory=tuple)  # the bucket resource


class ScaleToZero(Construct):
    """Exposes `target_size(workers)` and `coordinator_status(running)` for the group and the
    coordinator, and `marker_names`."""

    def __init__(self, scope: Construct, id_: str, props: ScaleToZeroProps) -> None:
        super().__init__(scope, id_)
        p = props
        names = markers(p.prefix, p.steps, p.script_digest)
        self.markers = [
            DataGoogleStorageBucketObjects(self, f"{reason}-marker", bucket=p.bucket, prefix=name,
                                           depends_on=list(p.depends_on) or None)
            for reason, name in names.items()
        ]
        self.marker_names = names

    @property
    def _stopped(self) -> Any:
        count = Op.add(Fn.length_of(self.markers[0].bucket_objects), Fn.length_of(self.markers[1].bucket_objects))
        return Op.gt(count, 0)

    def target_size(self, workers: int) -> int:
        """The group's target size: `workers`, or 0 once a stop marker exists."""
        if workers == 0:
            return 0
        # A number token (a float that Terraform resolves to the count) where a count goes.
        return cast(int, Token.as_number(Fn.conditional(self._stopped, 0, workers)))

    def coordinator_status(self, running: bool) -> str:
        """A pool coordinator's desired status: TERMINATED once a stop marker exists."""
        if not running:
            return "TERMINATED"
        return Token.as_string(Fn.conditional(self._stopped, "TERMINATED", "RUNNING"))
