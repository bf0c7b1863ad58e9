"""Code delivery: the trainer, the user's own code directory and the dependencies' wheels
(`stacks.wheels`) as content-addressed archives.

`build_archive` packs a source tree into a byte-for-byte deterministic `.tar.gz` (sorted entries,
fixed mtime/owner/mode, gzip header without time or name; no `__pycache__`, `*.pyc`, `tests` or
hidden entries: `stacks.shipped`), named by its sha256. The tar format is POSIX.1-2001 (pax): a
member name over ustar's 100 characters (wheel file names reach 101 and more) gets a pax `path`
record, and nothing else does (no times, no owners: those are fixed ustar fields), so short names
pack exactly as ustar would and long ones as deterministically. `CodeDelivery` uploads each
archive to the checkpoint bucket as `code/<kind>-<sha256[:16]>.tar.gz` through a `TerraformAsset`,
and the boot script receives the object name and the full sha256 (`Release`). So a one-byte change
in the tree renames the object and changes the instance template (the group rolls), while an
unchanged tree synthesizes identical JSON (`diff` shows nothing).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from cdktn import AssetType, TerraformAsset, TerraformResourceLifecycle
from constructs import Construct

from stacks.boot import Release
from stacks.errors import InputError
from stacks.shipped import ships_dir, ships_file

REPO = Path(__file__).resolve().parent.parent
TRAINER_SOURCE = REPO / "trainer"
#: Where archives are written before synthesis copies them into cdktf.out (git-ignored).
BUILD_DIR = REPO / "build" / "code"
OBJECT_PREFIX = "code/"


class DeliveryError(InputError):
    """A tree that cannot be packed (missing, unreadable, a name tar cannot hold); one line each."""


@dataclass(frozen=True)
class Archive:
    release: Release
    path: Path  # the local file the asset uploads


def _entries(src: Path, skip_top: Callable[[Path], bool] | None = None) -> list[tuple[str, Path]]:
    """(relative posix path, file) of every shipped entry, directories included, sorted;
    `skip_top` leaves out files at the top of `src`."""
    out: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(src):
        dirnames[:] = sorted(d for d in dirnames if ships_dir(d))
        here = Path(dirpath)
        for d in dirnames:
            out.append(((here / d).relative_to(src).as_posix(), here / d))
        for f in sorted(filenames):
            if not ships_file(f):
                continue
            if skip_top is not None and here == src and skip_top(here / f):
                continue
            if not (here / f).is_file():
                continue  # a dangling link or a socket: nothing to ship
            out.append(((here / f).relative_to(src).as_posix(), here / f))
    return sorted(out)


#: Packed archives by tree fingerprint: every stack of one synthesis ships the same trainer tree.
_PACKED: dict[tuple, bytes] = {}


def archive_bytes(src: Path, prefix: str = "", skip_top: Callable[[Path], bool] | None = None) -> bytes:
    """The deterministic tar.gz of `src`; entries are `prefix/<relative path>` (or bare)."""
    if not src.is_dir():
        raise DeliveryError([f"{src}: not a directory, so nothing can be shipped from it"])
    try:
        entries = _entries(src, skip_top)
        # Any edit changes a file's size or mtime, so a changed tree is packed again.
        key = (str(src.resolve()), prefix, tuple(
            (rel, st.st_size, st.st_mtime_ns, st.st_mode) for rel, path in entries for st in [path.stat()]))
        if key not in _PACKED:
            _PACKED[key] = _pack(src, prefix, entries)
    except (OSError, ValueError, tarfile.TarError) as err:
        raise DeliveryError([f"{src}: cannot pack it for the VM: {err}"]) from None
    return _PACKED[key]


def _pack(src: Path, prefix: str, entries: list[tuple[str, Path]]) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT, encoding="utf-8") as tar:
        if prefix:
            entries = [(prefix, src)] + [(f"{prefix}/{rel}", p) for rel, p in entries]
        for name, path in entries:
            info = tarfile.TarInfo(name)
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            if path.is_dir():
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            else:
                data = path.read_bytes()
                info.size = len(data)
                info.mode = 0o755 if os.access(path, os.X_OK) else 0o644
                tar.addfile(info, io.BytesIO(data))
    out = io.BytesIO()
    # mtime=0 and no file name: the gzip header would otherwise carry the build time.
    with gzip.GzipFile(filename="", mode="wb", fileobj=out, mtime=0, compresslevel=9) as gz:
        gz.write(raw.getvalue())
    return out.getvalue()


def build_archive(src: Path, kind: str, *, prefix: str, out_dir: Path,
                  skip_top: Callable[[Path], bool] | None = None) -> Archive:
    """Pack `src` and write it to `out_dir` under its content name (atomically: parallel
    syntheses of the same tree write the same bytes to the same name)."""
    data = archive_bytes(src, prefix, skip_top)
    sha = hashlib.sha256(data).hexdigest()
    name = f"{kind}-{sha[:16]}.tar.gz"
    path = out_dir / name
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_bytes() != data:
            tmp = out_dir / f".{name}.{os.getpid()}.tmp"
            tmp.write_bytes(data)
            tmp.replace(path)
    except OSError as err:
        raise DeliveryError([f"{path}: cannot write the {kind} archive: {err}"]) from None
    return Archive(Release(kind, OBJECT_PREFIX + name, sha), path)


def trainer_archive(source: Path | None = None, out_dir: Path | None = None) -> Archive:
    """The trainer package (default: this repository's `trainer/`); it unpacks to
    `<release>/trainer/`."""
    return build_archive(source or TRAINER_SOURCE, "trainer", prefix="trainer",
                         out_dir=out_dir or BUILD_DIR)


def wheels_archive(wheels_dir: Path, out_dir: Path | None = None) -> Archive:
    """The locked wheels (`stacks.wheels.locked_wheels`); they unpack to `<release>/*.whl`."""
    return build_archive(wheels_dir, "wheels", prefix="", out_dir=out_dir or BUILD_DIR)


def user_archive(code_dir: Path, out_dir: Path | None = None) -> Archive:
    """The user's code directory; its contents unpack to `<release>/` (put on PYTHONPATH). Its
    dependency locks stay behind: what they name ships as the wheels archive, and a lock for
    another Python (the drill's) changes nothing a VM runs."""
    from stacks.wheels import is_lock_file

    return build_archive(code_dir, "user", prefix="", out_dir=out_dir or BUILD_DIR, skip_top=is_lock_file)


@dataclass(frozen=True)
class DeliveryProps:
    bucket: str
    archives: tuple[Archive, ...]


class CodeDelivery(Construct):
    """Uploads each archive to the checkpoint bucket; `objects` for depends_on."""

    def __init__(self, scope: Construct, id_: str, props: DeliveryProps) -> None:
        from cdktn_provider_google.storage_bucket_object import StorageBucketObject

        super().__init__(scope, id_)
        self.objects: list = []  # StorageBucketObject (imported lazily: heavy)
        for archive in props.archives:
            rel = archive.release
            asset = TerraformAsset(self, f"{rel.kind}-archive", path=str(archive.path),
                                   type=AssetType.FILE, asset_hash=rel.sha256)
            self.objects.append(StorageBucketObject(
                self, f"{rel.kind}-object",
                bucket=props.bucket,
                name=rel.object_name,
                source=asset.path,
                content_type="application/gzip",
                # A new release exists before the template that names it; the old one goes
                # only after the group has moved off the old template.
                lifecycle=TerraformResourceLifecycle(create_before_destroy=True),
            ))
