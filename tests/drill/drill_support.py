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
