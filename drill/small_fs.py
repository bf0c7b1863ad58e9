"""Real filesystems that fill up or turn read-only, for the reliability tests and `make chaos`.

`SmallFs` mounts a filesystem of a chosen size at a folder (root only: `SmallFs.possible()` says
whether this process may): a tmpfs by default, or with `fstype="ext4"` an ext4 on a loop device
(an image file beside the folder), mounted `errors=remount-ro` as a persistent disk is. A disk
that fills is one that `fill()` leaves only a few bytes free in; a disk that goes read-only is one
`readonly()` turns so: ext4's `errors=remount-ro` after an I/O error. A tmpfs is remounted
read-only, which the kernel refuses while a process holds a file of it open for writing (EBUSY);
an ext4 is aborted (`mount -o remount,abort`, ext4's own error path), which works whatever is open,
and writes then fail with EROFS as they do on a VM whose disk failed. `writable()` and `free()`
undo them (an aborted ext4 comes back as after a reboot: unmounted, checked, mounted again);
leaving the context unmounts it (and detaches the loop device).

A process that unshared its mounts while the ext4 was mounted (a drill VM's sandbox) holds a copy
of that mount, and with it the kernel's aborted filesystem: unmounted here and mounted again from
the same loop device it would still be that one, read-only. So an ext4 still held elsewhere comes
back on a fresh loop device over the same image, as a reboot gets a fresh kernel (the held one is
aborted and read-only: it never writes the image again).
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

__all__ = ["SmallFs"]

_FILLER = ".filler"


class SmallFs:
    def __init__(self, path: Path, size_bytes: int = 64 << 20, *, fstype: str = "tmpfs") -> None:
        if fstype not in ("tmpfs", "ext4"):
            raise ValueError(f"fstype must be tmpfs or ext4, got {fstype!r}")
        self.path = Path(path)
        self.size_bytes = size_bytes
        self.fstype = fstype
        self.image = self.path.with_name(f".{self.path.name}.img")
        self.device: str | None = None
        self._held: list[str] = []  # loop devices another namespace's copy of the mount kept
        self.mounted = False

    @staticmethod
    def possible(fstype: str = "tmpfs") -> bool:
        tools = ["mount"] + (["losetup", "mkfs.ext4", "e2fsck"] if fstype == "ext4" else [])
        return os.geteuid() == 0 and all(shutil.which(t) is not None for t in tools)

    def __enter__(self) -> "SmallFs":
        self.path.mkdir(parents=True, exist_ok=True)
        if self.fstype == "tmpfs":
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size_bytes},mode=0755", "tmpfs",
                            str(self.path)], check=True)
        else:
            with open(self.image, "wb") as f:
                f.truncate(self.size_bytes)
            # No blocks reserved for root (the trainer runs as root: a reserve would hide the fill).
            subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(self.image)], check=True,
                           stdout=subprocess.DEVNULL)
            self.device = self._attach()
            self._mount_ext4()
        self.mounted = True
        return self

    def _attach(self) -> str:
        return subprocess.run(["losetup", "--find", "--show", str(self.image)], check=True,
                              capture_output=True, text=True).stdout.strip()

    def _held_elsewhere(self) -> bool:
        """The ext4 of our loop device is still mounted, in another mount namespace (unmounted
        here): ext4 lists every mounted filesystem under /sys/fs/ext4 by device."""
        assert self.device is not None
        return Path("/sys/fs/ext4", Path(self.device).name).exists()

    def _mount_ext4(self) -> None:
        assert self.device is not None
        subprocess.run(["mount", "-t", "ext4", "-o", "errors=remount-ro", self.device, str(self.path)], check=True)

    def __exit__(self, *exc: object) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], check=False)
            self.mounted = False
        if self.device is not None:
            for device in [self.device, *self._held]:  # a held one detaches once its holder ends
                subprocess.run(["losetup", "--detach", device], check=False, stderr=subprocess.DEVNULL)
            self.device, self._held = None, []
            self.image.unlink(missing_ok=True)

    def fill(self, leave_bytes: int = 0) -> None:
        """Fill the filesystem so that at most `leave_bytes` stay free (ENOSPC after that): big
        writes first, then ever smaller ones, since the filler's own metadata takes blocks too."""
        st = os.statvfs(self.path)
        want = max(0, st.f_bavail * st.f_frsize - leave_bytes)
        zeros = b"\0" * (1 << 20)
        size = len(zeros)
        fd = os.open(self.path / _FILLER, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            while want > 0 and size >= 1:
                try:
                    want -= os.write(fd, zeros[: min(size, want)])
                except OSError:
                    size //= 4
        finally:
            os.close(fd)

    def free(self) -> None:
        """Remove what `fill()` wrote."""
        (self.path / _FILLER).unlink(missing_ok=True)

    def readonly(self) -> None:
        if self.fstype == "ext4":  # the error path: read-only whatever is open for writing
            subprocess.run(["mount", "-o", "remount,abort", str(self.path)], check=True)
        else:
            subprocess.run(["mount", "-o", "remount,ro", str(self.path)], check=True)

    def writable(self) -> None:
        if self.fstype == "ext4":  # a reboot: unmount, check, mount again
            subprocess.run(["umount", str(self.path)], check=True)
            if self._held_elsewhere():
                self._held.append(self.device)  # detached at exit, once the holder has let go
                self.device = self._attach()
            subprocess.run(["e2fsck", "-f", "-y", str(self.device)], check=False, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)  # exit 1: errors corrected, as expected after an abort
            self._mount_ext4()
        else:
            subprocess.run(["mount", "-o", "remount,rw", str(self.path)], check=True)
