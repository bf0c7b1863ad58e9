"""A stand-in for `terraform` with the Google provider, for what `destroy` does to the resources a
stack keeps: run as `terraform ARGS...` (through a wrapper on PATH) by the real cdktn CLI.

No provider plugin can be downloaded here: the destroy is `drill.provider`'s model of the
provider's (the one the lifecycle drill's fake project uses too): ABANDON forgets, PREVENT and a
protected secret refuse, a bucket holding objects without `force_destroy` refuses, APIs with
`disable_on_destroy = false` are forgotten and stay enabled, everything else is deleted.

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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repository's drill/

from drill.provider import destroy  # noqa: E402


def _load() -> tuple[Path, dict]:
    path = Path(os.environ["FAKE_TERRAFORM_CLOUD"])
    return path, json.loads(path.read_text())


def _destroy(world: dict) -> list[str]:
    out = destroy(world["state"], world["objects"])
    for address in out.deleted:
        world["cloud"].pop(address, None)
    return out.errors


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
