"""The sharded layout: FSDP2 state saved through torch.distributed.checkpoint (DCP).

Every rank holds only its shard of the model and optimizer, so every rank writes its own file,
and a checkpoint written at one world size loads at any other (DCP reshards on load). The
checkpointer (``trainer.checkpoint.checkpointer``) drives this layout like the whole-model one;
this module says what a sharded checkpoint is and how the ranks write, verify and load it.

A sharded checkpoint folder (or remote prefix)::

    step-00001200/
        __0_0.distcp   rank 0's shards of the model and optimizer, and of the job's other models
                       (a GAN's discriminator and its optimizer, an EMA: ``bind``'s ``named``,
                       under ``states.NAME``) (DCP, one file per rank)
        __1_0.distcp   rank 1's ...
        .metadata      DCP's index: which slice of which tensor lies where (written by rank 0)
        extras.json    the small replicated state rank 0 saves beside the shards (step, scheduler,
                       scaler, data position, every rank's RNG, fingerprint) as plain JSON
                       (``trainer.checkpoint.state_codec``, tensors inline): never pickled
        manifest.json  written LAST, the commit record every layout shares
                       (``trainer.checkpoint.manifest``); its ``meta.sharded`` marks the layout

A sharded checkpoint needs a checkpoint key (``trainer.checkpoint.key``; ``KeyProblem``
otherwise): DCP reads its ``.metadata`` with pickle, and the non-tensor items of the shard files
with ``torch.load(weights_only=False)``. So nothing of a sharded checkpoint reaches DCP before its
manifest's HMAC verified under the run's key and every file matched its digest in that manifest:
only a holder of the key could have written those bytes (``verify_on_obtain``).

Staging (``stage``): the model's and optimizer's shards are copied to host memory
(``trainer.checkpoint.host_copy``: reused pinned buffers under CUDA); rank 0 encodes the extras at
once (the loop may change those objects right after). Writing (``write``, on the save thread of
every rank): DCP writes the shards into a staging folder on the first due disk tier that takes
them on every rank, else (a remote tier being due) in ``/dev/shm`` or the temporary folder; each
rank hashes its own files and rank 0 builds the manifest. The save thread talks to the other ranks
only over process groups of its own (``Ranks``): the loop keeps using the default group meanwhile,
and collectives from two threads on one group are unsafe; the uploader has a group of its own.

Which copies are complete: ranks that share a run dir (same host, same directory) form a *node*;
its lowest rank is the node leader, which commits, copies, verifies and deletes folders on that
node's disks. On one host all ranks share the run dir, so the disk tiers hold complete
checkpoints: the staging folder is renamed into its tier and copied into the others. On several
hosts each node's disk only ever receives its own ranks' shard files, so no disk holds a complete
copy: the staging folder is uploaded (every rank its own files) and then removed, and the remote
tiers hold the only complete copies. A restore has each node leader download the chosen step into
its node's run dir; then every rank loads from its own node's folder. (A run dir shared between
hosts, e.g. over NFS, is not supported: each host would count as its own node writing into the
same folders.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import re
import shutil
import socket
import tempfile
import time
import uuid
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from trainer.checkpoint import file_hash, state_codec
from trainer.checkpoint.format import (CheckpointInfo, _verify_file, _write_hashed_plain,
                                       copy_dir, download_dir, list_checkpoints, publish_dir,
                                       read_manifest)
from trainer.checkpoint.host_copy import HostCopy
from trainer.checkpoint.layout import OneProcess, OnTier, Plan, Written, disk_folder
from trainer.checkpoint.manifest import (MANIFEST, OTHER_LAYOUT, CheckpointInvalid, CheckpointUnloadable,
                                         CheckpointUnreadable, StepOccupied, build_manifest,
                                         check_manifest_entries, parse_manifest_header, step_name, unreadable)
from trainer.checkpoint.stores import TMP_PREFIX, Store, fsync_dir
from trainer.checkpoint.tiers import Tier

EXTRAS = "extras.json"
DCP_METADATA = ".metadata"
#: ``meta.sharded.layout`` in the manifest: what wrote the payload.
LAYOUT = "torch.distributed.checkpoint"
_SHARD_RE = re.compile(r"^__(\d+)_\d+\.distcp$")
#: Why a sharded checkpointer refuses to work without a key (``KeyProblem``).
NEEDS_KEY = ('checkpoint_key_file: sharded checkpoints (parallelism = "fsdp") need a checkpoint key: '
             "torch.distributed.checkpoint reads its .metadata with pickle, so a sharded checkpoint is "
             "only loaded after its manifest's HMAC verified (--checkpoint-key-file; on a VM the stack "
             "provides one; see docs/security.md)")


# --------------------------------------------------------------------------------------------
# The manifest and the folder
# --------------------------------------------------------------------------------------------


def parse_sharded_manifest(data: bytes, step: int | None = None, *, key: Any = None) -> dict:
    """The shared manifest checks with the sharded file list: the DCP index, the extras and one or
    more rank files, nothing else; raises ``CheckpointInvalid``."""
    m = parse_manifest_header(data, key)
    sharded = (m.get("meta") or {}).get("sharded") if isinstance(m.get("meta"), dict) else None
    if not isinstance(sharded, dict) or sharded.get("layout") != LAYOUT:
        raise CheckpointInvalid(OTHER_LAYOUT + 'a whole-model checkpoint (written with parallelism = "ddp")')
    files = m.get("files")
    if (not isinstance(files, dict) or DCP_METADATA not in files or EXTRAS not in files
            or not any(_SHARD_RE.match(n) for n in files)):
        raise CheckpointInvalid("manifest file list is incomplete")
    for name in files:
        if not (isinstance(name, str) and name not in ("", ".", "..", MANIFEST) and "/" not in name
                and not name.startswith(TMP_PREFIX)):
            raise CheckpointInvalid(f"manifest lists an invalid file name {name!r}")
    return check_manifest_entries(m, step)


def list_sharded(store: Store, *, key: Any = None) -> list[CheckpointInfo]:
    """Every ``step-N`` on the store, newest first, quick-checked (manifest and HMAC, presence,
    sizes)."""
    return list_checkpoints(store, parse_sharded_manifest, key=key)


def verify_sharded_dir(folder: Path, *, key: Any = None) -> dict:
    """Full verification of a sharded checkpoint folder (the manifest's HMAC under ``key``, every
    file's digest); the manifest. Only after this may DCP read the folder."""
    folder = Path(folder)
    m = read_manifest(folder, parse_sharded_manifest, key=key)
    fh = file_hash.of_manifest(m)
    for name, info in sorted(m["files"].items()):
        _verify_file(folder / name, info, fh)
    return m


def download_sharded(store: Store, step: int, root: Path, *, key: Any = None) -> Path:
    """Copy ``step-N`` from ``store`` into ``root/step-N/``: the manifest authenticated, every file
    verified, then the manifest written, then the atomic rename."""
    return download_dir(store, step, root, parse_sharded_manifest, key=key)


def _load_extras(path: Path) -> Any:
    """The extras of a verified folder (plain JSON: nothing to unpickle)."""
    try:
        return state_codec.loads(path.read_bytes())
    except state_codec.DecodeError as e:
        raise CheckpointUnloadable(f"{EXTRAS} verified but cannot be decoded ({e})") from None


def _spill_roots() -> list[Path]:
    """Where the shards are staged when no disk tier takes them and a remote tier must: host
    memory (``/dev/shm``, a tmpfs), else the temporary folder (the boot disk)."""
    roots = [Path("/dev/shm")] if os.path.isdir("/dev/shm") else []
    return roots + [Path(tempfile.gettempdir())]


@contextlib.contextmanager
def _single_process_quiet() -> Any:
    """DCP warns on every call without a process group; one process is a supported case here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _try(fn: Callable[[], Any]) -> str | None:
    """Run ``fn``; the error as text (None when it worked). Collectives carry these."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    try:
        fn()
        return None
    except (CheckpointException, Exception) as e:  # noqa: BLE001
        return _error_text(e)


def _error_text(e: BaseException) -> str:
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(e, CheckpointException):
        # It carries each failing rank's whole traceback; the last line is the actual error.
        lines = [x.strip() for x in str(e).splitlines() if x.strip()]
        return lines[-1] if lines else type(e).__name__
    return f"{type(e).__name__}: {e}"


def _named_state_dicts(named: dict[str, Any]) -> dict[str, Any]:
    """The other models' (and their optimizers') sharded state dicts under ``states``, as DCP
    saves and loads them (``Sharded.bind``); nothing when there are none (a checkpoint of one
    model keeps the layout it always had)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    out: dict[str, Any] = {}
    for name, (module, oname, opt) in named.items():
        if opt is None:
            out[name] = get_model_state_dict(module)
        else:
            out[name], out[oname] = get_state_dict(module, opt)
    return {"states": out} if out else {}


# --------------------------------------------------------------------------------------------
# The ranks that save together
# --------------------------------------------------------------------------------------------


class Ranks:
    """Every rank of the job, over gloo groups of the checkpoint's own (one per lane: the save
    thread's, the uploader's); ranks that see the same run dir form a node. Constructing it is a
    collective (every rank at once). ``timeout_s`` bounds how long a checkpoint collective waits for
    a rank that died (default: the process group's)."""

    def __init__(self, run_dir: Path, *, timeout_s: float | None = None) -> None:
        timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        self._lanes = {"save": dist.new_group(backend="gloo", timeout=timeout),
                       "upload": dist.new_group(backend="gloo", timeout=timeout)}
        self.rank = dist.get_rank(self._lanes["save"])
        self.size = dist.get_world_size(self._lanes["save"])
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        st = Path(run_dir).stat()
        keys = self.all((socket.gethostname(), st.st_dev, st.st_ino))
        self.leader_of = [min(r for r, k in enumerate(keys) if k == key) for key in keys]
        self.is_leader = self.leader_of[self.rank] == self.rank
        self.nodes = len(set(keys))

    def all(self, obj: Any, *, lane: str = "save") -> list[Any]:
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self._lanes[lane])
        return out

    def bcast(self, obj: Any, *, lane: str = "save") -> Any:
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self._lanes[lane])
        return box[0]

    @property
    def pg(self) -> Any:
        """The save lane's process group, which DCP's own collectives run on (``Sharded._pg``)."""
        return self._lanes["save"]

    def close(self, *, abandoned: bool = False) -> None:
        for lane, group in self._lanes.items():
            # An abandoned upload may still sit in a collective of the uploader's group: leave
            # that group to the process's exit.
            if not (lane == "upload" and abandoned):
                with contextlib.suppress(Exception):  # the default group may be gone already
                    dist.destroy_process_group(group)
        self._lanes = {}


# --------------------------------------------------------------------------------------------
# The layout
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Staged:
    step: int
    meta: dict
    shards: dict             # {"model": ..., "optim": ..., "states": {...}}: this rank's shards, on the host
    extras: bytes | None     # rank 0: the extras as plain JSON
    tag: str                 # staging folder suffix, identical on every rank
    created_unix: float
    alloc_s: float = 0.0

    def hold(self) -> None:
        pass

    def release(self) -> None:
        pass

    def before_update(self, timeout: float | None = None) -> bool:
        return True  # copied whole at the save call (see ``Sharded.stage``)

    def copied(self) -> None:
        pass


class Sharded:
    """The sharded layout (see the module docstring). ``world``: the job's ranks (None, or a
    world of one: this process alone, e.g. a read-only look by ``status``); ``run_dir``: the home
    tier's directory, which tells the nodes apart."""

    name = "sharded"
    parallelism = "fsdp"
    in_place = True
    verify_on_obtain = True
    needs_key = NEEDS_KEY

    def __init__(self, world: Any = None, *, run_dir: Path | None = None,
                 collective_timeout_s: float | None = None) -> None:
        distributed = (world is not None and world.distributed and dist.is_available() and dist.is_initialized())
        self.group: Any = Ranks(run_dir or Path("."), timeout_s=collective_timeout_s) if distributed else OneProcess()
        self._host: HostCopy | None = None
        self._model: Any = None
        self._optimizer: Any = None
        self._named: dict[str, Any] = {}
        self._file_hash: file_hash.FileHash | None = None

    parse_manifest = staticmethod(parse_sharded_manifest)

    @property
    def _pg(self) -> Any:
        return getattr(self.group, "pg", None)

    def bind(self, model: Any, optimizer: Any, *, named: dict[str, Any] | None = None) -> None:
        """The sharded model and its optimizer; ``named``: the job's other sharded models by state
        name, each ``(module, optimizer name or None, optimizer or None)`` (a discriminator and its
        Adam; an EMA alone), whose shards are saved and loaded beside the main model's under
        ``states.NAME`` (and ``states.OPTIMIZER_NAME``)."""
        self._model, self._optimizer, self._named = model, optimizer, dict(named or {})

    # ------------------------------------------------------------------------------ saving
    def can_stage(self, droppable: bool) -> bool:
        return True  # the host copy is reused by one save at a time

    def reserve(self, state: Any) -> None:
        pass

    def stage(self, step: int, state: Any, meta: dict, *, make_room: Callable[[], bool]) -> _Staged:
        """Encode rank 0's extras (``state``) and copy this rank's shards to the host; a
        collective: an extras that cannot be encoded raises ``NotPlainData`` on every rank.

        The whole copy happens here, before the loop goes on; unlike the whole-model layout's,
        none of it runs beside the next step. DCP's stager copies the state dict in one call,
        parameters, buffers and optimizer state together, into buffers it owns (and on CUDA
        synchronizes the device at its end): running it beside the next forward would copy
        buffers that forward changes (BatchNorm's running statistics) after it changed them,
        and splitting the state dict would mean a second copier of DTensors beside DCP's, with
        its own pinned buffers. Kept synchronous, and exact, for now."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        g = self.group
        plan: Any = None
        blob = None
        if g.rank == 0:
            try:
                blob = state_codec.dumps(state)  # now: the loop may change these objects right after
                plan = (uuid.uuid4().hex[:8], None)
            except state_codec.NotPlainData as e:
                plan = ("", str(e))
        tag, error = g.bcast(plan)
        if error is not None:  # every rank raises, so no rank is left waiting in a collective
            raise state_codec.NotPlainData(f"extras: {error}")
        meta = {**meta, "world_size": g.size, "sharded": {"layout": LAYOUT, "world_size": g.size, "nodes": g.nodes}}
        if self._host is None:
            self._host = HostCopy(cuda=torch.cuda.is_available())  # reused host buffers, pinned on CUDA
        msd, osd = get_state_dict(self._model, self._optimizer)
        shards = self._host.copy({"model": msd, "optim": osd, **_named_state_dicts(self._named)})
        return _Staged(step, meta, shards, blob, tag, time.time())

    def write(self, staged: _Staged, disks: list[Tier], plan: Plan, *, for_upload: bool, parallel: bool,
              on_tier: OnTier, key: Any, writer: str) -> Written:
        """Write ``staged`` to its disk tiers; a collective over the save lane: every rank runs
        the same sequence of collectives whatever fails locally (failures travel as values), so
        one rank's error never leaves the others waiting. The disk tiers fail independently of
        each other and of the remote ones: the shards are staged on the first disk tier that
        takes them on every rank, else (``for_upload``) in host memory or a temporary folder."""
        g, step, out = self.group, staged.step, Written(collective=self.group.nodes > 1)
        final_name = step_name(step)
        t0 = time.monotonic()
        if self._file_hash is None:  # one hash for every rank's files: BLAKE3 where every rank has it
            names = set(g.all(file_hash.for_writing().name))
            self._file_hash = file_hash.for_writing() if len(names) == 1 else file_hash.SHA256
        fh = self._file_hash

        # 1. Every rank writes its shards (DCP's own collectives run on our group), and hashes the
        #    files it wrote (rank 0 also the index and the extras), on the first root that takes
        #    them on every rank.
        roots = [disk_folder(t) for t in disks] + (_spill_roots() if for_upload else [])
        stage: Path | None = None
        files: dict[str, dict] = {}
        reasons = []
        for root in roots:
            cand = root / f"{TMP_PREFIX}{final_name}-{staged.tag}"
            files = {}
            err = _try(lambda: root.mkdir(parents=True, exist_ok=True))
            if any(g.all(err)):
                err = err or "skipped: another rank could not create its checkpoint folder"
            else:
                err = _try(lambda: self._dcp_save(staged.shards, cand))
                if err is None:
                    err = _try(lambda: files.update(self._own_files(cand, staged.extras, fh)))
            errors = [f"rank {r}: {e}" for r, e in enumerate(g.all(err)) if e]
            if not errors:
                stage = cand
                break
            reasons.append(f"{root}: {'; '.join(errors)}")
            if g.is_leader:
                shutil.rmtree(cand, ignore_errors=True)
        results = g.all(files)
        manifest: bytes | None = None
        if stage is not None and g.rank == 0:
            merged: dict[str, dict] = {}
            for f in results:
                merged.update(f)
            manifest = build_manifest(step, merged, staged.meta, staged.created_unix, key=key, writer=writer)
        manifest = g.bcast(manifest)
        staged.shards = {}  # the host copy is no longer needed
        if stage is None or manifest is None:
            reason = " | ".join(reasons) or "nowhere to write them"
            error: RuntimeError | None = RuntimeError(f"writing the shards failed: {reason}")
            for t in disks:
                out.errors[t.name] = error
                if g.rank == 0:  # rank 0 speaks for the job (it has every rank's reason)
                    on_tier(t, error, 0.0, None)
            out.detail.append(f"shards not written ({reason})")
            out.failure = str(error)
            return out
        if reasons and g.rank == 0:
            out.detail.append(f"shards staged in {stage.parent} ({' | '.join(reasons)})")
        write_s = time.monotonic() - t0
        out.manifest = manifest

        # 2. Node leaders commit complete copies on their disks (several nodes: none is complete).
        status: dict[str, str] = {}
        if g.is_leader:
            status = self._commit(step, disks, plan, stage, manifest, key)
        statuses = g.all(status)
        for i, t in enumerate(disks):
            whys = [f"node of rank {r}: {s.get(t.name)}" for r, s in enumerate(statuses)
                    if g.leader_of[r] == r and s.get(t.name) != "ok"]
            error = None if not whys else RuntimeError("; ".join(whys) if g.nodes > 1 else whys[0].split(": ", 1)[1])
            out.errors[t.name] = error
            out.seconds[t.name] = write_s if i == 0 else time.monotonic() - t0
            folder = disk_folder(t, final_name)
            if error is None and g.is_leader:
                out.folders[t.name] = folder
            if g.rank == 0:
                on_tier(t, error, out.seconds[t.name], folder if error is None else None)
        if stage.exists():
            if not out.folders and for_upload:
                out.staging = stage  # the upload's now (it removes it on the node leader)
            elif g.is_leader:
                shutil.rmtree(stage, ignore_errors=True)  # not committed here (several nodes, or failed)
        return out

    def _dcp_save(self, shards: dict, stage: Path) -> None:
        import torch.distributed.checkpoint as dcp

        writer = dcp.FileSystemWriter(str(stage), single_file_per_rank=True, sync_files=True)
        with _single_process_quiet():
            dcp.save(shards, storage_writer=writer, process_group=self._pg, no_dist=self._pg is None)

    def _own_files(self, stage: Path, extras: bytes | None, fh: file_hash.FileHash) -> dict[str, dict]:
        """The manifest entries (size and digest under ``fh``) of the files this rank is responsible for."""
        rank = self.group.rank
        out: dict[str, dict] = {}
        if rank == 0:
            _write_hashed_plain(stage / EXTRAS, extras or b"")
        for p in sorted(stage.iterdir()):
            m = _SHARD_RE.match(p.name)
            mine = int(m.group(1)) == rank if m else (rank == 0 and not p.name.startswith(TMP_PREFIX))
            if mine and p.is_file():
                size, digest = file_hash.hash_file(p, fh)
                out[p.name] = fh.entry(size, digest)
        return out

    def _commit(self, step: int, disks: list[Tier], plan: Plan, stage: Path, manifest: bytes,
                key: Any) -> dict[str, str]:
        """Leader: make every due disk tier hold the checkpoint, each on its own (the staging
        folder is renamed into the tier it was staged on, copied into the others, a copy of this
        state already there kept). Returns tier -> "ok" or the reason."""
        status: dict[str, str] = {}
        m = json.loads(manifest)
        missing = [n for n, i in m["files"].items()
                   if not (stage / n).is_file() or (stage / n).stat().st_size != i["size"]]
        if missing:
            why = f"this node holds {len(m['files']) - len(missing)} of {len(m['files'])} files"
            return {t.name: why for t in disks}
        try:
            _write_hashed_plain(stage / MANIFEST, manifest)  # last: the staged folder is complete
        except Exception as e:  # noqa: BLE001 - the staging disk just filled up: nothing to commit
            return {t.name: f"{type(e).__name__}: {e}" for t in disks}
        src: Path | None = None
        for t in disks:
            root = disk_folder(t)
            target = root / step_name(step)
            try:
                how = plan.get(t.name, "write")
                if how.startswith("occupied: "):
                    raise StepOccupied(how[len("occupied: "):])
                if how == "keep":
                    status[t.name] = "ok"
                    src = src or target
                    continue
                if stage.parent == root and stage.exists():
                    fsync_dir(stage)
                    publish_dir(stage, target, replace=how == "replace")
                else:
                    copy_dir(src or stage, root, parse_sharded_manifest, key=key, replace=how == "replace")
                src = src or target
                status[t.name] = "ok"
            except Exception as e:  # noqa: BLE001 - reported through the status
                status[t.name] = f"{type(e).__name__}: {e}"
        return status

    # ------------------------------------------------------------------------------ uploading
    def uploads(self, files: list[str], *, collective: bool) -> list[str]:
        """The files this rank uploads: across nodes its own shard files (rank 0 also the rest),
        else rank 0 every file."""
        rank = self.group.rank
        if not collective:
            return files if rank == 0 else []
        return [n for n in files if (m := _SHARD_RE.match(n)) and int(m.group(1)) == rank
                or (not _SHARD_RE.match(n) and rank == 0)]

    def memory_manifest(self, staged: Any, *, key: Any, writer: str) -> bytes:
        raise NotImplementedError("sharded saves are always uploaded from a folder")

    def memory_file(self, staged: Any, name: str) -> memoryview:
        raise NotImplementedError("sharded saves are always uploaded from a folder")

    # ------------------------------------------------------------------------------ restoring
    def verify(self, folder: Path, *, key: Any) -> dict:
        return verify_sharded_dir(folder, key=key)

    def load(self, folder: Path, *, key: Any) -> Any:
        """Load a verified folder's shards into the bound model and optimizer (resharded to this
        world size; a collective) and return rank 0's extras. A checkpoint that does not fit them
        (every file matched its digest under an authentic manifest, so this is no corruption:
        another architecture or settings) is ``CheckpointUnloadable``; a load that failed for a
        reason outside the checkpoint (I/O, memory, a peer: ``manifest.unreadable``) is
        ``CheckpointUnreadable``, tried again."""
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

        try:
            extras = _load_extras(folder / EXTRAS)
            self.load_into(folder, self._model, self._optimizer, self._in_shards(folder, extras))
            return extras
        except CheckpointUnloadable:
            raise
        except (CheckpointException, Exception) as e:  # noqa: BLE001
            err = _error_text(e)
            if unreadable(e):
                raise CheckpointUnreadable(f"the checkpoint verified but could not be loaded just now: {err}") from None
            raise CheckpointUnloadable(
                "the checkpoint verified but does not fit this model and optimizer (use the original code and "
                f"settings, or a new --run-dir/--gcs-uri for a new run; nothing was deleted): {err}") from None

    def _in_shards(self, folder: Path, extras: Any) -> dict[str, Any]:
        """The bound other models the checkpoint holds in its shards. One written before they
        were sharded holds a model that did not train (a frozen copy) in the extras' ``states``:
        it is loaded from there (``NamedStates.load``); one in neither is ``CheckpointUnloadable``."""
        if not self._named:
            return {}
        import torch.distributed.checkpoint as dcp

        keys = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
        held = {n for n in self._named if any(k.startswith(f"states.{n}.") for k in keys)}
        replicated = extras.get("states") if isinstance(extras, dict) else None
        for name, (_, oname, _) in self._named.items():
            if name not in held and not (oname is None and isinstance(replicated, dict) and name in replicated):
                raise CheckpointUnloadable(f"the checkpoint holds no state {name!r} (use the original code and "
                                           "settings, or a new --run-dir/--gcs-uri for a new run; nothing was deleted)")
        return {n: part for n, part in self._named.items() if n in held}

    def load_into(self, folder: Path, model: Any, optimizer: Any | None, named: dict[str, Any] | None = None) -> None:
        """Load a verified checkpoint folder's shards into ``model`` (and ``optimizer``; None:
        the weights only), and the other models of ``named`` (``bind``), resharded to this world
        size. A collective (``--init-from``: the weights only)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict,
                                                             set_model_state_dict, set_state_dict)

        sd: dict[str, Any]  # the model's state dict, and the optimizer's
        if optimizer is None:
            sd = {"model": get_model_state_dict(model)}
        else:
            msd, osd = get_state_dict(model, optimizer)
            sd = {"model": msd, "optim": osd}
        sd.update(_named_state_dicts(named or {}))
        with _single_process_quiet():
            dcp.load(sd, storage_reader=dcp.FileSystemReader(str(folder)), process_group=self._pg,
                     no_dist=self._pg is None)
        if optimizer is None:
            set_model_state_dict(model, sd["model"])
        else:
            set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        for name, (module, oname, opt) in (named or {}).items():
            if opt is None:
                set_model_state_dict(module, sd["states"][name])
            else:
                set_state_dict(module, opt, model_state_dict=sd["states"][name], optim_state_dict=sd["states"][oname])

    def look(self, folder: Path, *, key: Any) -> tuple[dict, Any]:
        """The full (unsharded) model state dict and the extras of a folder, in this process
        alone (``status``, ``export``); verified first: only then may DCP read it. The other
        models' and their optimizers' full states (``bind``'s ``named``) join the extras'
        ``states``, where the replicated ones are: a reader finds every state by name there."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

        verify_sharded_dir(folder, key=key)
        full: dict = {}
        try:
            with _single_process_quiet():
                _load_state_dict(full, storage_reader=dcp.FileSystemReader(str(folder)),
                                 planner=_EmptyStateDictLoadPlanner(), no_dist=True)
        except Exception as e:  # noqa: BLE001 - verified, yet DCP cannot read it: not this version's
            if unreadable(e):  # or not just now
                raise CheckpointUnreadable(f"DCP could not read the verified checkpoint just now ({_error_text(e)})") \
                    from None
            raise CheckpointUnloadable(f"DCP cannot read the verified checkpoint ({type(e).__name__}: {e})") from None
        extras = _load_extras(folder / EXTRAS)
        if isinstance(full.get("states"), dict) and isinstance(extras, dict):
            extras["states"] = {**(extras.get("states") or {}), **full["states"]}
        return full["model"], extras

    def close(self) -> None:
        if self._host is not None:
            self._host.close()
            self._host = None
