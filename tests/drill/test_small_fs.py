"""The small real filesystem: it fills and turns read-only as a disk does."""
from __future__ import annotations

import errno
import os
import shutil
import subprocess

import pytest


@pytest.mark.parametrize("fstype", ["tmpfs", "ext4"])
def test_a_filled_fs_refuses_writes_with_enospc_and_frees_again(small_fs, fstype: str) -> None:
    fs = small_fs("d", 4 << 20 if fstype == "tmpfs" else 16 << 20, fstype=fstype)
    fs.fill()
    with pytest.raises(OSError) as e:
        (fs.path / "f").write_bytes(b"x" * (1 << 20))
    assert e.value.errno == errno.ENOSPC
    fs.free()
    (fs.path / "f").write_bytes(b"x" * (1 << 20))


def test_a_readonly_fs_refuses_writes_with_erofs(small_fs) -> None:
    fs = small_fs("d", 1 << 20)
    (fs.path / "kept").write_bytes(b"1")
    fs.readonly()
    with pytest.raises(OSError) as e:
        (fs.path / "g").write_bytes(b"1")
    assert e.value.errno == errno.EROFS
    assert (fs.path / "kept").read_bytes() == b"1"
    fs.writable()
    (fs.path / "g").write_bytes(b"1")


def test_an_ext4_disk_turns_read_only_while_a_file_is_open_for_writing_and_comes_back(small_fs) -> None:
    fs = small_fs("pd", 16 << 20, fstype="ext4")
    (fs.path / "kept").write_bytes(b"1")
    os.sync()  # what was not on the disk when it failed is gone after the reboot, as on a VM
    with open(fs.path / "open", "ab", buffering=0) as held:  # a trainer's lock file, its ledger
        fs.readonly()  # a tmpfs would refuse (EBUSY): an ext4 takes its error path
        with pytest.raises(OSError) as e:
            (fs.path / "g").write_bytes(b"1")
        assert e.value.errno == errno.EROFS
        with pytest.raises(OSError) as e:
            held.write(b"x")
        assert e.value.errno == errno.EROFS
    assert (fs.path / "kept").read_bytes() == b"1"
    fs.writable()  # the reboot: checked and mounted again
    (fs.path / "g").write_bytes(b"1")
    assert (fs.path / "kept").read_bytes() == b"1"



@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (a mount namespace)")
def test_an_aborted_ext4_comes_back_writable_while_another_mount_namespace_holds_it(small_fs) -> None:
    # A drill VM's sandbox unshares its mounts: its copy of this mount pins the aborted
    # filesystem, which a remount of the same loop device would get back, still read-only.
    fs = small_fs("pd", 16 << 20, fstype="ext4")
    (fs.path / "kept").write_bytes(b"1")
    os.sync()
    holder = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", "echo held; read x"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        fs.readonly()
        fs.writable()
        (fs.path / "g").write_bytes(b"1")
        assert (fs.path / "kept").read_bytes() == b"1"
    finally:
        holder.communicate("\n")
