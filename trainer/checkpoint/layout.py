"""What a checkpoint layout is to the checkpointer: a strategy, and the ranks that save together.

The checkpointer (``trainer.checkpoint.checkpointer``) decides when to save, to which tiers, how
uploads queue and are cut short, what counts as durable, what retention deletes, which copy a
restore takes and how an emergency save spends its deadline. A ``Layout`` decides what a
checkpoint *is*:

* ``parse_manifest``: the manifest's file list this layout writes (the other layout's manifests
  are refused as ``OTHER_LAYOUT``: kept, never loaded);
* ``stage``: copy the state into host memory (the only part that holds the loop: the whole-model
  layout copies the weights and the optimizer state beside the next step, see ``Staged``);
* ``write``: make the staged state a committed folder on each due disk tier, or an uncommitted
  staging folder (or host memory) an upload reads from;
* ``uploads``: which of a checkpoint's files this rank uploads;
* ``verify``/``load``/``look``: verify a folder, load it into the run, or read it whole without
  a process group (``status``, ``export``).

Two layouts exist: ``trainer.checkpoint.whole_model.WholeModel`` (one process holds the whole
state; rank 0 saves it) and ``trainer.checkpoint.sharded.Sharded`` (FSDP2: every rank saves its
shards through ``torch.distributed.checkpoint``). Every method a layout runs with its ``group``
is a collective of that group: for the whole model a group of one process, where each collective
returns its input, so the checkpointer's one code path serves both.
"""
from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any, Callable, Protocol, TypeVar

from trainer.checkpoint.tiers import Tier


class Group(Protocol):
    """The ranks that save one checkpoint together. ``lane``: ``"save"`` (the save thread, the
    restore and the emergency save) or ``"upload"`` (the uploader's thread: collectives from two
    threads on one process group are unsafe, so each lane is a group of its own)."""

    rank: int
    size: int
    nodes: int             # ranks that share a run dir form a node
    leader_of: list[int]   # each rank's node leader (the lowest rank of its node)

    @property
    def is_leader(self) -> bool: ...
    def all(self, obj: Any, *, lane: str = "save") -> list[Any]: ...
    def bcast(self, obj: Any, *, lane: str = "save") -> Any: ...
    def close(self, *, abandoned: bool = False) -> None: ...


class OneProcess:
    """A group of one: every collective returns its input."""

    rank, size, nodes, leader_of = 0, 1, 1, [0]
    is_leader = True

    def all(self, obj: Any, *, lane: str = "save") -> list[Any]:
        return [obj]

    def bcast(self, obj: Any, *, lane: str = "save") -> Any:
        return obj

    def close(self, *, abandoned: bool = False) -> None:
        pass


class Staged(Protocol):
    """A state copied into host memory for one save: ``step``, ``meta``, ``alloc_s`` (seconds the
    copy spent allocating its buffer, a one-off cost that is not the save's), and ``release()``,
    called once nothing reads it any more (``hold()`` for each extra reader: an upload from it).

    Part of the copy may still run after ``stage`` returned, beside the loop's next forward and
    backward (what only the optimizer step writes): ``before_update`` is called before the loop
    writes the weights or the optimizer state (True once it may; False when ``timeout`` passed),
    and ``copied`` blocks until the host copy is complete (the disk writer calls it first)."""

    @property
    def step(self) -> int: ...
    @property
    def meta(self) -> dict: ...
    @property
    def alloc_s(self) -> float: ...

    def hold(self) -> None: ...
    def release(self) -> None: ...
    def before_update(self, timeout: float | None = None) -> bool: ...
    def copied(self) -> None: ...


@dataclasses.dataclass
class Written:
    """What ``Layout.write`` made of a staged state.

    ``errors``: disk tier -> None when it holds a complete, committed copy on every node, else the
    error (rank 0's view). ``folders``: this node's committed copies. ``staging``: a folder holding
    every file of the checkpoint that no tier committed (the upload reads it, then removes it on
    the node leader). ``memory``: the staged state itself, when nothing on disk holds it (an
    upload then reads it from host memory). ``manifest``: the manifest's bytes (None: nothing was
    written). ``collective``: every rank holds files of this checkpoint that only it can upload."""

    errors: dict[str, BaseException | None] = dataclasses.field(default_factory=dict)
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    folders: dict[str, Path] = dataclasses.field(default_factory=dict)
    staging: Path | None = None
    memory: Staged | None = None
    manifest: bytes | None = None
    collective: bool = False
    detail: list[str] = dataclasses.field(default_factory=list)
    failure: str | None = None  # why nothing was written (then every tier failed)


#: ``Layout.write``'s plan per disk tier: write it, replace what is there, keep what is there (this
#: very state), or skip it (``"occupied: why"``: a quarantined checkpoint holds the step).
Plan = dict[str, str]
#: Told about each disk tier as it is done (rank 0): tier, error or None, seconds, folder or None.
OnTier = Callable[[Tier, BaseException | None, float, Path | None], None]


#: The staged state of one layout (its own class: ``whole_model._Staged``, ``sharded._Staged``).
S = TypeVar("S", bound=Staged)


class LayoutOf(Protocol[S]):
    """A checkpoint layout whose ``stage`` makes an ``S`` and whose ``write`` and uploads from host
    memory take it back (see the module docstring); ``Layout`` is any of them."""

    @property
    def name(self) -> str: ...              # "whole-model" or "sharded", for messages
    @property
    def parallelism(self) -> str: ...       # the setting that writes it ("ddp", "fsdp"), for messages
    @property
    def needs_key(self) -> str | None: ...  # why this layout is never read without a checkpoint key (None: it may be)
    @property
    def group(self) -> Group: ...
    @property
    def in_place(self) -> bool: ...         # a restore loads the weights into the bound model itself
    @property
    def verify_on_obtain(self) -> bool: ...  # a copy is verified whole before it is loaded (else load verifies it)

    def parse_manifest(self, data: bytes, step: int | None = None, *, key: Any = None) -> dict: ...
    def bind(self, model: Any, optimizer: Any, *, named: dict[str, Any] | None = None) -> None: ...
    def can_stage(self, droppable: bool) -> bool: ...
    def stage(self, step: int, state: Any, meta: dict, *, make_room: Callable[[], bool]) -> S: ...
    def reserve(self, state: Any) -> None: ...
    def write(self, staged: S, disks: list[Tier], plan: Plan, *, for_upload: bool, parallel: bool,
              on_tier: OnTier, key: Any, writer: str) -> Written: ...
    def memory_manifest(self, staged: S, *, key: Any, writer: str) -> bytes: ...
    def memory_file(self, staged: S, name: str) -> memoryview: ...
    def uploads(self, files: list[str], *, collective: bool) -> list[str]: ...
    def verify(self, folder: Path, *, key: Any) -> dict: ...
    def load(self, folder: Path, *, key: Any) -> Any: ...
    def look(self, folder: Path, *, key: Any) -> tuple[dict, Any]: ...
    def close(self) -> None: ...


#: Any checkpoint layout: the checkpointer hands a layout back only the staged states it made.
Layout = LayoutOf[Any]


def disk_folder(t: Tier, key: str = "") -> Path:
    """The folder of ``key`` on the disk tier ``t`` (``Layout.write`` gets disk tiers only; a
    remote tier's store has no folder)."""
    folder = t.store.folder(key)
    assert folder is not None, f"{t.name} is not a disk tier"
    return folder


class Refs:
    """Runs ``cleanup`` once the last of its holders released it (an upload source shared by the
    uploads to several remote tiers)."""

    def __init__(self, cleanup: Callable[[], None] | None) -> None:
        self._cleanup, self._n, self._lock = cleanup, 1, threading.Lock()

    def hold(self) -> None:
        with self._lock:
            self._n += 1

    def release(self) -> None:
        with self._lock:
            self._n -= 1
            run = self._n == 0 and self._cleanup is not None
            cleanup, self._cleanup = (self._cleanup, None) if run else (None, self._cleanup)
        if cleanup is not None:
            cleanup()
