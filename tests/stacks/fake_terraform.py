"""A stand-in for `terraform` with the Google provider, for what `destroy` does to the resources a
stack keeps: run as `terraform ARGS...` (through a wrapper on PATH) by the real cdktn CLI.

No provider plugin can be downloaded here, so this models the provider's destroy of the two
resources that hold checkpoints, as hashicorp/google 8.x does it:

- `google_storage_bucket`: `deletion_policy = "ABANDON"` removes it from the state and leaves it
  (and its objects); "PREVENT" refuses; otherwise a bucket that holds objects is refused unless
  `force_destroy` ("Error trying to delete bucket NAME containing objects without `force_destroy`
  set to true"), else deleted with its objects.
- `google_secret_manager_secret`: "ABANDON" forgets it; `deletion_protection = true` refuses
  ("cannot destroy secret without setting deletion_protection=false and running `terraform
  apply`"); otherwise it is deleted.
- `google_storage_bucket_object`: deletes its object from the bucket; anything else: deleted.

Refusals are printed as the provider prints them and make the run exit 1, with the refused
resources still in the state, the others gone, as Terraform leaves a partial destroy.

`FAKE_TERRAFORM_CLOUD` names a JSON file: {"state": {address: attributes}, "cloud": {address:
attributes}, "objects": {bucket name: [object names]}, "calls": [argv, ...]}. `version`, `init`
and `providers lock` succeed; any other command is refused (exit 1), so a change in what cdktn
runs shows up.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def _load() -> tuple[Path, dict]:
    path = Path(os.environ["FAKE_TERRAFORM_CLOUD"])
    return path, json.loads(path.read_text())


def _destroy(world: dict) -> list[str]:
    errors: list[str] = []
    objects: dict[str, list[str]] = world["objects"]
    for address in sorted(world["state"], key=lambda a: a.startswith("google_storage_bucket.")):
        attrs = world["state"][address]
        kind = address.split(".", 1)[0]
        policy = attrs.get("deletion_policy") or "DELETE"
        if policy == "ABANDON":
            del world["state"][address]
            continue
        if policy == "PREVENT":
            errors.append(f"cannot destroy {address} with deletion_policy = PREVENT")
            continue
        if kind == "google_secret_manager_secret" and attrs.get("deletion_protection"):
            errors.append("cannot destroy secret without setting deletion_protection=false and "
                          "running `terraform apply`")
            continue
        if kind == "google_storage_bucket":
            name = attrs["name"]
            if objects.get(name) and not attrs.get("force_destroy"):
                errors.append(f"Error trying to delete bucket {name} containing objects without "
                              "`force_destroy` set to true")
                continue
            objects.pop(name, None)
        if kind == "google_storage_bucket_object":
            held = objects.get(attrs["bucket"], [])
            if attrs["name"] in held:
                held.remove(attrs["name"])
        world["cloud"].pop(address, None)
        del world["state"][address]
    return errors


def main(argv: list[str]) -> int:
    path, world = _load()
    world["calls"].append(argv)
    code = 0
    if argv[:1] in (["version"], ["-v"]):
        print(json.dumps({"terraform_version": "1.9.8", "platform": "linux_amd64",
                          "provider_selections": {}, "terraform_outdated": False})
              if "-json" in argv else "Terraform v1.9.8\non linux_amd64")
    elif argv[:1] == ["init"] or argv[:2] == ["providers", "lock"]:
        print("Terraform has been successfully initialized!")
    elif argv[:1] == ["destroy"]:
        errors = _destroy(world)
        for e in errors:
            print(f"Error: {e}", file=sys.stderr)
        print("Destroy complete!" if not errors else "Destroy failed.")
        code = 1 if errors else 0
    else:
        print(f"fake terraform: {' '.join(argv)} is not modelled", file=sys.stderr)
        code = 1
    path.write_text(json.dumps(world, indent=1))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
