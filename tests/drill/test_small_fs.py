"""The small real filesystem: it fills and turns read-only as a disk does."""
from __future__ import annotations

import errno

import pytest


def test_a_filled_fs_refuses_writes_with_enospc_and_frees_again(small_fs) -> None:
    fs = small_fs("d", 4 << 20)
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
