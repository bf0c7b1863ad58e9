"""Helpers for the drill tests (a module of its own: `conftest` is a name every test dir shares)."""
from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from drill.metadata_server import MetadataServer
from drill.sandbox import Disk, Sandbox

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("losetup") is None,
    reason="drill VMs need root, unshare and losetup (mount/PID namespaces, loop devices)")


@pytest.fixture
def metadata() -> Iterator[MetadataServer]:
    with MetadataServer(attributes={"answer": "42"}) as server:
        yield server


@pytest.fixture
def make_vm(tmp_path: Path) -> Iterator[Callable[..., Sandbox]]:
    """`make_vm(**kwargs)` -> a Sandbox with a blank 64 MB checkpoint disk; closed at teardown."""
    made: list[Sandbox] = []

    def make(disk_mb: int = 64, **kwargs: object) -> Sandbox:
        n = len(made)
        disk = Disk(tmp_path / f"disk{n}.img", disk_mb)
        vm = Sandbox(tmp_path / f"vm{n}", disks={"spottrain-checkpoints": disk}, **kwargs)  # type: ignore[arg-type]
        made.append(vm)
        return vm

    yield make
    for vm in made:
        vm.close()


def script(tmp_path: Path, body: str, name: str = "script.sh") -> Path:
    """A bash script file with strict mode."""
    path = tmp_path / name
    path.write_text("#!/bin/bash\nset -euo pipefail\n" + body)
    return path


def zone_change_example(into: Path) -> Path:
    """experiments/example.toml as a regional group with `zone_change_on_repair` (no stateful
    disk: every VM boots on a blank one), written to `into` under the same name (same resources)."""
    from drill.sandbox import REPO

    text = (REPO / "experiments" / "example.toml").read_text()
    text = text.replace('zones = ["us-central1-a"]', 'zones = ["us-central1-a", "us-central1-b"]', 1)
    text = text.replace('\nplacement = "zonal"', '\nplacement = "regional"', 1)
    out = into / "example.toml"
    out.write_text(text + "\n[capacity]\nzone_change_on_repair = true\n")
    return out
