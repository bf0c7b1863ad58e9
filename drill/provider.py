"""What `terraform destroy` with the Google provider (hashicorp/google 8.x) does to each resource in
the state: deletes it, forgets it and leaves it in the project, or refuses.

No provider plugin can be downloaded here, so the stand-ins that destroy a stack share this one
model of it (`drill.fake_project`, the lifecycle drill's project, and tests/stacks/fake_terraform.py,
the `terraform` that `make destroy` runs in the tests):

- `google_storage_bucket`: `deletion_policy = "ABANDON"` removes it from the state and leaves it
  (and its objects); "PREVENT" refuses; otherwise a bucket that holds objects is refused unless
  `force_destroy` ("Error trying to delete bucket NAME containing objects without `force_destroy`
  set to true"), else deleted with its objects. Buckets go last, after the objects in them, as
  Terraform's dependency order destroys them.
- `google_secret_manager_secret`: "ABANDON" forgets it; `deletion_protection = true` refuses
  ("cannot destroy secret without setting deletion_protection=false and running `terraform
  apply`"); otherwise it is deleted.
- `google_project_service` with `disable_on_destroy = false`: forgotten, the API left enabled
  (the provider's documented behaviour of that flag).
- `google_storage_bucket_object`: deletes its object from the bucket; anything else: deleted.

Refusals come back as the provider prints them; the refused resources stay in the state, the
others are gone, as Terraform leaves a partial destroy.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Destroyed:
    """The outcome of one destroy: what it deleted, what it left in the project without knowing
    it any more, which objects it deleted from which bucket, and its errors."""

    deleted: list[str] = field(default_factory=list)
    forgotten: list[str] = field(default_factory=list)
    objects_deleted: dict[str, list[str]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


def kind(address: str) -> str:
    return address.split(".", 1)[0]


def destroy(state: dict[str, dict[str, Any]], objects: dict[str, list[str]]) -> Destroyed:
    """Destroy everything in `state` (Terraform address -> attributes, references resolved);
    `objects` is bucket name -> the object names it holds. Both are changed in place: what the
    destroy removed from the state and deleted from the buckets is gone from them."""
    out = Destroyed()
    for address in sorted(state, key=lambda a: kind(a) == "google_storage_bucket"):
        attrs = state[address]
        k = kind(address)
        policy = attrs.get("deletion_policy") or "DELETE"
        if policy == "ABANDON" or (k == "google_project_service" and attrs.get("disable_on_destroy") is False):
            del state[address]
            out.forgotten.append(address)
            continue
        if policy == "PREVENT":
            out.errors.append(f"cannot destroy {address} with deletion_policy = PREVENT")
            continue
        if k == "google_secret_manager_secret" and attrs.get("deletion_protection"):
            out.errors.append("cannot destroy secret without setting deletion_protection=false and "
                              "running `terraform apply`")
            continue
        if k == "google_storage_bucket":
            name = attrs["name"]
            if objects.get(name) and not attrs.get("force_destroy"):
                out.errors.append(f"Error trying to delete bucket {name} containing objects without "
                                  "`force_destroy` set to true")
                continue
            gone = objects.pop(name, [])
            if gone:
                out.objects_deleted.setdefault(name, []).extend(gone)
        if k == "google_storage_bucket_object":
            held = objects.get(attrs["bucket"], [])
            if attrs["name"] in held:
                held.remove(attrs["name"])
                out.objects_deleted.setdefault(attrs["bucket"], []).append(attrs["name"])
        del state[address]
        out.deleted.append(address)
    return out
