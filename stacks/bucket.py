"""The checkpoint bucket: the durable tier that survives everything but a deliberate destroy.

Private (uniform access, public access prevention enforced), with a soft-delete window that
keeps every deleted or overwritten object restorable. Not versioned unless the experiment asks:
the trainer's objects are create-only, so versions would duplicate what soft delete keeps (and
bill it twice as long); with versioning, lifecycle rules prune old noncurrent versions.
Kept by `destroy` unless the experiment opts in to `force_destroy`: by default the bucket carries
the provider's `deletion_policy = "ABANDON"`, so a destroy removes it from Terraform's state and
leaves it, with every checkpoint in it, in the project (and finishes, instead of failing on a
non-empty bucket). With `force_destroy` the destroy deletes it and everything in it.

One rule always applies to live objects: the parts of a composite upload that was cut off
(`PREFIX/.tmp-parts/`, trainer.checkpoint.gcs_streams) are deleted `PARTS_MAX_AGE_DAYS` after
their creation. The next restore deletes them too, but a run that never restarts (finished, or
destroyed) would keep them, billed, forever.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cdktn_provider_google.storage_bucket import (
    StorageBucket,
    StorageBucketLifecycleRule,
    StorageBucketLifecycleRuleAction,
    StorageBucketLifecycleRuleCondition,
    StorageBucketSoftDeletePolicy,
    StorageBucketVersioning,
)
from constructs import Construct


#: Where the trainer's GCS store puts a composite upload's parts, under its prefix (the trainer's
#: `trainer.checkpoint.gcs_streams.PARTS_DIR`; tests/stacks/test_stack.py holds them equal).
PARTS_DIR = ".tmp-parts"
#: A part older than this belongs to an upload that is over: every upload runs under a deadline
#: of minutes (durable_timeout_s, the preemption budget), and lifecycle actions run within a day
#: of an object qualifying, so a live upload's parts are never at risk.
PARTS_MAX_AGE_DAYS = 1


@dataclass(frozen=True)
class CheckpointBucketProps:
    project: str
    name: str
    location: str
    force_destroy: bool
    versioning: bool
    keep_noncurrent_versions: int
    noncurrent_days: int
    soft_delete_days: int
    run_prefix: str  # the run's objects (runs/NAME), where its uploads leave their parts
    labels: dict[str, str] = field(default_factory=dict)


class CheckpointBucket(Construct):
    def __init__(self, scope: Construct, id_: str, props: CheckpointBucketProps) -> None:
        super().__init__(scope, id_)
        delete = StorageBucketLifecycleRuleAction(type="Delete")
        # A checkpoint overwritten or deleted keeps a few older versions, briefly.
        noncurrent = [
            StorageBucketLifecycleRule(
                action=delete,
                condition=StorageBucketLifecycleRuleCondition(
                    with_state="ARCHIVED", num_newer_versions=props.keep_noncurrent_versions
                ),
            ),
            StorageBucketLifecycleRule(
                action=delete,
                condition=StorageBucketLifecycleRuleCondition(
                    with_state="ARCHIVED", days_since_noncurrent_time=props.noncurrent_days
                ),
            ),
        ]
        parts = StorageBucketLifecycleRule(
            action=delete,
            condition=StorageBucketLifecycleRuleCondition(
                age=PARTS_MAX_AGE_DAYS, matches_prefix=[f"{props.run_prefix}/{PARTS_DIR}/"]
            ),
        )
        self.bucket = StorageBucket(
            self,
            "bucket",
            project=props.project,
            name=props.name,
            location=props.location,
            storage_class="STANDARD",
            uniform_bucket_level_access=True,
            public_access_prevention="enforced",
            versioning=StorageBucketVersioning(enabled=props.versioning),
            force_destroy=props.force_destroy,
            # A destroy forgets the bucket instead of deleting it (or failing on its objects).
            deletion_policy=None if props.force_destroy else "ABANDON",
            labels=props.labels,
            lifecycle_rule=[parts, *noncurrent] if props.versioning else [parts],
            soft_delete_policy=StorageBucketSoftDeletePolicy(
                retention_duration_seconds=props.soft_delete_days * 86400
            ),
        )

    @property
    def name(self) -> str:
        return self.bucket.name
