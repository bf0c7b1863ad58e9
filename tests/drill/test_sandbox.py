"""The drill VM: a script sees the disk, the stubs and its own mounts; nothing reaches the host."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Callable

from drill_support import needs_root, script

from drill.sandbox import Disk, Sandbox, disk_status

pytestmark = needs_root


def test_a_script_sees_the_disk_and_the_stubs_and_nothing_leaks(tmp_path: Path, make_vm: Callable[..., Sandbox]) -> None:
    vm = make_vm()
    marker = f"drill-leak-check-{tmp_path.name}"
    rc = vm.run_script(script(tmp_path, f"""
DISK=/dev/disk/by-id/google-spottrain-checkpoints
echo "disk -> $(readlink -f $DISK)"
rc=0; blkid "$DISK" || rc=$?
echo "blank disk blkid=$rc"
mkfs.ext4 -q "$DISK"
mkdir -p /mnt/spottrain && mount "$DISK" /mnt/spottrain
echo data > /mnt/spottrain/{marker}
findmnt -n -o SOURCE /mnt/spottrain
echo "unit" > /etc/systemd/system/{marker}.service
echo "gpu: $(nvidia-smi --query-gpu=name --format=csv,noheader)"
echo "systemctl: $(head -c 2 "$(command -v systemctl)")"
echo "python: $(python3 -c 'import sys; print(sys.executable)')"
echo "hostname: $(hostname)"
logger -t leakcheck "to the journal"
echo "serial line" > /dev/ttyS0
exit 7
"""))
    journal = vm.journal()
    assert rc == 7
    assert "blank disk blkid=2" in journal
    assert f"disk -> {vm.disks['spottrain-checkpoints'].device}" in journal
    assert "gpu: NVIDIA L4" in journal
    assert "systemctl: #!" in journal                      # the stub, not the host's binary
    assert f"python: {sys.executable}" in journal          # the image's Python is the venv's
    assert "hostname: spottrain-drill-vm" in journal
    assert " leakcheck: to the journal" in journal
    assert "serial line" in vm.console.read_text()
    # Every journal line carries a timestamp.
    assert all(line[:4].isdigit() and "T" in line.split()[0] for line in journal.splitlines())
    # Nothing reached the host: no /mnt/spottrain, no unit file, no mount.
    assert not Path("/mnt/spottrain").exists()
    assert not Path(f"/etc/systemd/system/{marker}.service").exists()
    assert marker not in Path("/proc/self/mountinfo").read_text()
    device = vm.disks["spottrain-checkpoints"].device
    assert device is not None and device not in Path("/proc/self/mountinfo").read_text()
    # The data is on the disk image itself.
    out = disk_status(vm.disks["spottrain-checkpoints"], ["cat", f"/mnt/spottrain/{marker}"])
    assert out.stdout == "data\n"


def test_close_detaches_the_loop_device(tmp_path: Path) -> None:
    disk = Disk(tmp_path / "d.img", 16)
    with Sandbox(tmp_path / "vm", disks={"spottrain-checkpoints": disk}) as vm:
        assert vm.run_script(script(tmp_path, "true\n")) == 0
        device = disk.device
        assert device is not None
    out = subprocess.run(["losetup", "--list", "--noheadings", "-O", "NAME,BACK-FILE"], capture_output=True, text=True)
    assert str(tmp_path / "d.img") not in out.stdout


def test_power_off_kills_what_outlives_the_window(tmp_path: Path, make_vm: Callable[..., Sandbox]) -> None:
    """A unit that ignores SIGTERM with a stop timeout longer than the window dies with the VM."""
    vm = make_vm()
    marker = f"drill-stubborn-{tmp_path.name}"
    (tmp_path / "startup.sh").write_text(f"""#!/bin/bash
cat > /etc/systemd/system/stubborn.service <<'UNIT'
[Service]
ExecStart=/bin/bash -c 'trap "" TERM; exec -a {marker} sleep infinity'
TimeoutStopSec=3600
UNIT
systemctl start stubborn
echo stubborn started
""")
    (tmp_path / "shutdown.sh").write_text("#!/bin/bash\necho shutdown script ran\n")
    vm.boot(startup_script_file=tmp_path / "startup.sh", shutdown_script_file=tmp_path / "shutdown.sh")
    vm.wait_event(lambda e: e["event"] == "startup-script-exited", 60)
    assert _host_pids(marker), "the unit's process should be running"
    off = vm.power_off(window=2)
    assert off["killed"] is True
    assert not vm.running
    assert _host_pids(marker) == []
    assert "shutdown script ran" in vm.journal()


def test_exec_runs_inside_the_running_vm(tmp_path: Path, make_vm: Callable[..., Sandbox]) -> None:
    vm = make_vm()
    (tmp_path / "s.sh").write_text("#!/bin/bash\nmkdir -p /mnt/spottrain && echo inside > /mnt/spottrain/x\n")
    vm.boot(startup_script_file=tmp_path / "s.sh")
    vm.wait_event(lambda e: e["event"] == "startup-script-exited", 60)
    out = vm.exec(["cat", "/mnt/spottrain/x"])
    assert out.stdout == "inside\n"
    assert vm.path("/mnt/spottrain/x").read_text() == "inside\n"
    vm.power_off(window=30)


def _host_pids(marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids
