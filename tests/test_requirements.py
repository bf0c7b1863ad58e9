"""The development environment's two locks: requirements.lock (`make setup`: what `make demo`, the
drill, synthesis and the trainer need) and requirements-dev.lock (`make test`: what the tests and
tools add). Each pin exact, no package in both, the first closed under its own packages'
dependencies (a demo never lacks one that only the tests' lock brought), both together closed too,
and every requirement pyproject.toml names pinned in the lock its group belongs to. The
dependencies are read from the installed packages' metadata (the suite's venv has both locks)."""
from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
BASE, DEV = ROOT / "requirements.lock", ROOT / "requirements-dev.lock"


def pins(path: Path) -> dict[str, str]:
    """{canonical name: version} of a lock's `name==version` lines (comments and `-r` aside)."""
    found: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#") or line.startswith("-r "):
            continue
        name, sep, version = line.partition("==")
        assert sep and version and " " not in line, f"{path.name}: not an exact pin: {line!r}"
        assert canonicalize_name(name) not in found, f"{path.name}: {name} pinned twice"
        found[canonicalize_name(name)] = version
    return found


def needs(names: set[str]) -> set[str]:
    """What the installed packages `names` require (no extras; markers for this Python)."""
    out: set[str] = set()
    for name in names:
        for r in metadata.distribution(name).requires or []:
            req = Requirement(r)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                out.add(canonicalize_name(req.name))
    return out


def test_the_dev_lock_adds_to_the_base_lock_and_repeats_none_of_it() -> None:
    assert "-r requirements.lock" in DEV.read_text().splitlines()
    both = set(pins(BASE)) & set(pins(DEV))
    assert not both, f"pinned in both locks: {sorted(both)}"


def test_every_pin_is_the_installed_version() -> None:
    # torch's local CPU wheel is 2.13.0+cpu for the pin 2.13.0: the public version is what is pinned.
    wrong = {n: (v, metadata.version(n)) for n, v in {**pins(BASE), **pins(DEV)}.items()
             if Version(metadata.version(n)).public != Version(v).public}
    assert not wrong, f"pinned, installed: {wrong}"


@pytest.mark.parametrize("locks", [(BASE,), (BASE, DEV)], ids=["base", "base+dev"])
def test_each_lock_is_closed_under_its_packages_dependencies(locks: tuple[Path, ...]) -> None:
    pinned: set[str] = set()
    for lock in locks:
        pinned |= set(pins(lock))
    missing = needs(pinned) - pinned - {"setuptools", "pip"}
    assert not missing, f"required by a package of {'+'.join(p.name for p in locks)} but not pinned there: " \
                        f"{sorted(missing)}"


def test_pyproject_names_each_requirement_in_the_lock_of_its_group() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    groups = {BASE: [*project["dependencies"], *project["optional-dependencies"]["demo"]],
              DEV: project["optional-dependencies"]["dev"]}
    for lock, reqs in groups.items():
        pinned = pins(lock)
        for r in map(Requirement, reqs):
            if r.marker is not None and not r.marker.evaluate():
                continue
            name = canonicalize_name(r.name)
            assert name in pinned, f"{r} (pyproject.toml) is not pinned in {lock.name}"
