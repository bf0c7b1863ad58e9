"""Real filesystems that fill up or turn read-only, for the reliability tests and `make chaos`.

`SmallFs` mounts a tmpfs of a chosen size at a folder (root only: `SmallFs.possible()` says
whether this process may). A disk that fills is a tmpfs that `fill()` leaves only a few bytes free
in; a disk that goes read-only is one `readonly()` remounts so (ext4's `errors=remount-ro` after an
I/O error). `writable()` and `free()` undo them; leaving the context unmounts it.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

__all__ = ["SmallFs"]

_FILLER = ".filler"


class SmallFs:
    def __init__(self, path: Path, size_bytes: int = 64 << 20) -> None:
        self.path = Path(path)
        self.size_bytes = size_bytes
        self.mounted = False

    @staticmethod
    def possible() -> bool:
        return os.geteuid() == 0 and shutil.which("mount") is not None

    def __enter__(self) -> "SmallFs":
        self.path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size_bytes},mode=0755", "tmpfs",
                        str(self.path)], check=True)
        self.mounted = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], check=False)
            self.mounted = False

    def fill(self, leave_bytes: int = 0) -> None:
        """Fill the filesystem so that at most `leave_bytes` stay free (ENOSPC after that)."""
        st = os.statvfs(self.path)
        free = st.f_bavail * st.f_frsize
        want = max(0, free - leave_bytes)
        with open(self.path / _FILLER, "ab") as f:
            chunk = b"\0" * (1 << 20)
            while want > 0:
                n = min(want, len(chunk))
                try:
                    f.write(chunk[:n])
                    f.flush()
                except OSError:
                    break
                want -= n

    def free(self) -> None:
        """Remove what `fill()` wrote."""
        (self.path / _FILLER).unlink(missing_ok=True)

    def readonly(self) -> None:
        subprocess.run(["mount", "-o", "remount,ro", str(self.path)], check=True)

    def writable(self) -> None:
        subprocess.run(["mount", "-o", "remount,rw", str(self.path)], check=True)

    def free_bytes(self) -> int:
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize
