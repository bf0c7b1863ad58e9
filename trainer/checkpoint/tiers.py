"""The tiers a checkpoint can be on, as records, and the roles some of them play.

A ``Tier`` is one place a checkpoint can be written to and restored from: its ``store`` (a
directory or a bucket prefix, ``trainer.checkpoint.stores``), whether it outlives the VM
(``durable``), whether it is off the VM (``remote``: written by the uploader, read through a
download), its ``cadence`` and how many checkpoints it keeps (``keep``). The checkpointer asks
these fields, never a tier's name: what a tier does follows from its record.

``tier_table`` is the table of every tier a run can have, fastest first (the order a restore
prefers for equal steps)::

    local       a local-SSD dir (optional)   lost with the VM: a cache, not durable
    persistent  the run dir on the stateful PD  durable, on the VM's disk
    gcs         gs://BUCKET/PREFIX (optional)   durable and remote: survives everything

and ``Roles`` names what some of them are for besides holding checkpoints:

* ``home``: the run dir. A remote copy is downloaded into it for a restore, a save that only a
  remote tier is due for is staged on it, and the goodput ledger and TensorBoard files live there.
* ``lease``: the remote tier whose prefix the job's writer lease guards (``trainer.checkpoint.lease``);
  the lease object lives there, and every remote tier's writes ask it first.
* ``mirror``: the remote tier the ledger, the TensorBoard files and the task's artifacts are
  mirrored to.

Across nodes (sharded state on several VMs) no disk holds every rank's shards: there the remote
durable tiers are the ones that hold a complete copy (``Tiers.complete``).

Adding a tier (a second bucket in another region, a Hyperdisk mount) is a row in ``tier_table``
and a setting in ``trainer.config`` (and a store, if it is a new kind of place). A tier's name is
said here only: whoever needs one imports it (``BUCKET_TIERS`` for the tiers in a bucket).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Iterator

from trainer.checkpoint.stores import DirStore, GcsStore, Store

#: The tier in the run's bucket (``gcs_uri``): durable and remote; the writer lease and the
#: ledger's mirror are on it.
GCS = "gcs"
#: Every tier name the table can produce, fastest first (``[tiers.NAME]`` in the config file).
TIER_NAMES = ("local", "persistent", GCS)
#: The tiers in a bucket: those whoever can write the bucket can delete checkpoints from
#: (``trainer.loop.rollback``).
BUCKET_TIERS = (GCS,)


@dataclasses.dataclass(frozen=True)
class Cadence:
    """When to save to one tier: every K steps and/or every T seconds; neither: automatic
    (Young/Daly from the measured save cost, ``trainer.checkpoint.interval``)."""

    every_steps: int | None = None
    every_seconds: float | None = None

    def __post_init__(self) -> None:
        if self.every_steps is not None and (not isinstance(self.every_steps, int) or self.every_steps < 1):
            raise ValueError(f"every_steps must be a positive integer, got {self.every_steps!r}")
        if self.every_seconds is not None and not self.every_seconds > 0:
            raise ValueError(f"every_seconds must be > 0, got {self.every_seconds!r}")

    @property
    def automatic(self) -> bool:
        return self.every_steps is None and self.every_seconds is None


@dataclasses.dataclass(frozen=True)
class Tier:
    """One place a checkpoint can be on (see the module docstring)."""

    name: str
    store: Store
    durable: bool        # outlives the VM: a checkpoint here is saved
    remote: bool         # off the VM: written by the uploader, restored through a download
    cadence: Cadence = Cadence()
    keep: int = 3        # retention: the newest valid checkpoints kept here

    def __post_init__(self) -> None:
        if not isinstance(self.keep, int) or self.keep < 1:
            raise ValueError(f"keep must be an integer >= 1, got {self.keep!r}")


@dataclasses.dataclass(frozen=True)
class Roles:
    """What some tiers are for besides holding checkpoints (see the module docstring)."""

    home: str
    lease: str | None = None
    mirror: str | None = None


class Tiers:
    """A run's tiers, fastest first, and their roles."""

    def __init__(self, tiers: list[Tier], roles: Roles) -> None:
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique: {names}")
        self._by_name = {t.name: t for t in tiers}
        home = self._by_name.get(roles.home)
        if home is None or home.remote or home.store.folder("") is None:
            raise ValueError(f"the home tier {roles.home!r} must be a directory on this VM")
        for role in ("lease", "mirror"):
            name = getattr(roles, role)
            if name is not None and not (name in self._by_name and self._by_name[name].remote):
                raise ValueError(f"the {role} role needs a remote tier, not {name!r}")
        self.roles = roles

    def __iter__(self) -> Iterator[Tier]:
        return iter(self._by_name.values())

    def __len__(self) -> int:
        return len(self._by_name)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __getitem__(self, name: str) -> Tier:
        return self._by_name[name]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._by_name)

    @property
    def home(self) -> Tier:
        return self._by_name[self.roles.home]

    def role(self, role: str) -> Tier | None:
        """The tier playing ``role`` (``home``, ``lease``, ``mirror``), or None."""
        name = getattr(self.roles, role)
        return self._by_name.get(name) if name is not None else None

    @property
    def remotes(self) -> list[Tier]:
        return [t for t in self if t.remote]

    @property
    def disks(self) -> list[Tier]:
        return [t for t in self if not t.remote]

    def complete(self, nodes: int) -> list[Tier]:
        """The tiers a checkpoint must be on to count as durable: every durable tier, and across
        nodes only the remote ones (no disk holds every node's shards)."""
        return [t for t in self if t.durable and (nodes == 1 or t.remote)]


def tier_table(run_dir: Path, *, local_dir: Path | None = None, gcs_uri: str | None = None,
               cadence: dict[str, Cadence] | None = None, keep: dict[str, int] | int = 3,
               gcs_client: Any = None, gcs_streams: int = GcsStore.STREAMS) -> Tiers:
    """The run's tiers and roles (see the module docstring). ``cadence`` and ``keep`` per tier
    name (``keep`` an int: every tier's); ``gcs_streams``: the GCS tier's streams per large file."""
    cadence = dict(cadence or {})
    keeps = keep if isinstance(keep, dict) else {}
    unknown = (set(cadence) | set(keeps)) - set(TIER_NAMES)
    if unknown:
        raise ValueError(f"unknown checkpoint tier(s) {sorted(unknown)}; expected {list(TIER_NAMES)}")

    def row(name: str, store: Store, *, durable: bool, remote: bool) -> Tier:
        return Tier(name, store, durable=durable, remote=remote, cadence=cadence.get(name, Cadence()),
                    keep=keeps.get(name, keep if isinstance(keep, int) else 3))

    rows = []
    if local_dir is not None:
        rows.append(row("local", DirStore(Path(local_dir), "local"), durable=False, remote=False))
    rows.append(row("persistent", DirStore(Path(run_dir), "persistent"), durable=True, remote=False))
    if gcs_uri:
        rows.append(row(GCS, GcsStore(gcs_uri, client=gcs_client, name=GCS, streams=gcs_streams), durable=True,
                        remote=True))
    remote = GCS if gcs_uri else None
    return Tiers(rows, Roles(home="persistent", lease=remote, mirror=remote))
