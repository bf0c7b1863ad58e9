"""Sharded checkpoints: FSDP2 (``fully_shard``) state saved through torch.distributed.checkpoint.

This module owns ``shard()`` (FSDP2 wrapping of a model) and the ``ShardedCheckpointer``, the
collective counterpart of ``trainer.checkpoint.checkpointer.Checkpointer`` for sharded state: every rank
holds only its shard of the model and optimizer, so every rank writes its own file, and a
checkpoint written at one world size loads at any other (DCP reshards on load).

A sharded checkpoint folder (or GCS prefix)::

    step-00001200/
        __0_0.distcp   rank 0's shards of the model and optimizer (DCP, one file per rank)
        __1_0.distcp   rank 1's ...
        .metadata      DCP's index: which slice of which tensor lies where (written by rank 0)
        extras.json    the small replicated state rank 0 passed as ``extras`` (step, scheduler,
                       scaler, data position, every rank's RNG, fingerprint) as plain JSON
                       (``trainer.checkpoint.state_codec``, tensors inline): never pickled
        manifest.json  written LAST, the same format as single-process checkpoints
                       (``trainer.checkpoint.format.build_manifest``: size and chunked sha256 of every
                       file above, a self-checksum, the HMAC); its ``meta.sharded`` marks the layout

A sharded checkpointer needs a checkpoint key (``trainer.checkpoint.key``; ``KeyProblem``
otherwise): DCP reads its ``.metadata`` with pickle, and the non-tensor items of the shard files
with ``torch.load(weights_only=False)``. So nothing of a sharded checkpoint reaches DCP before its
manifest's HMAC verified under the run's key and every file matched its sha256 in that manifest:
only a holder of the key could have written those bytes.

The rules are those of ``trainer.checkpoint.format``: a checkpoint is valid only if its manifest parses,
its self-checksum and HMAC match and every file it lists is present with the listed size and sha256. On
a disk tier the files are written into a ``.tmp-`` folder, fsynced, the manifest is written last
and the folder appears by one atomic rename. On GCS every payload object is uploaded create-only
(each rank uploads its own shard file), and rank 0 uploads the manifest only after every rank
reported its upload done, so an interrupted upload never produces a valid checkpoint.

Asynchrony: ``save()`` copies the rank's shards to host memory (``trainer.checkpoint.host_copy``: reused
pinned buffers under CUDA) and returns; a background thread on every rank then runs ``dcp.save``
into the staging folder, hashes its own files, and the ranks agree on the manifest. That thread
talks to the other ranks only over a separate gloo process group made at construction: the
training loop keeps using the default group meanwhile, and collectives from two threads on one
group are unsafe. One save is in flight at a time; ``due()`` answers False meanwhile.

Tiers fail independently, as in ``Checkpointer``: the shards are staged on the first due disk tier
that takes them on every rank, else (GCS being due) in ``/dev/shm`` or the temporary folder; the
staging folder is renamed into its own tier and copied into the others. The upload is the
uploader's, never the save thread's: on one node rank 0 uploads the complete folder alone (the
committed copy, else the staging folder, which the upload then owns and removes); across nodes
every rank uploads its own files, in order, over the uploader's own process group. The emergency
save waits for no upload (see ``Checkpointer``).

Which copies are complete: a tier copy is valid only if every file of the manifest is there and
verifies. Ranks that share a run dir (same host, same directory) form a *node*; its lowest rank
(LOCAL_RANK 0 under torchrun) is the node leader, which commits, copies, verifies and deletes
folders on that node's disks. On one host all ranks share the run dir, so the disk tiers hold
complete checkpoints as usual. On several hosts each node's disk only ever receives its own ranks'
shard files, so no disk holds a complete copy: the staging folder is used for the upload and then
removed, and **the GCS copy is the only complete one** (the only durable tier there) (without ``gcs_uri`` a multi-node run has
no usable checkpoint; the constructor says so). On restore each node leader downloads the chosen
step from GCS into its node's persistent tier, verifies it, and then every rank loads from its
own node's folder. (A run dir shared between hosts, e.g. over NFS, is not supported: each host
would count as its own node writing into the same folders.)

Restoring picks the newest step that is valid on some tier (rank 0 lists, every rank gets the
choice), has every node leader find or download a copy that fully verifies, and falls back to the
next older step, logging why, when any node has none. A checkpoint that verified but does not fit
the model (another architecture) raises ``ResumeMismatch`` rather than silently starting afresh.

Every public method except ``due()`` and ``describe()`` (local looks) is a collective: every rank
calls it, in the same order, with the same step. ``due()`` is only meaningful on rank 0 (the loop
ORs it across ranks); rank 0 also decides which tiers a save writes and tells the others.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import threading
import time
import uuid
import warnings
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn

from trainer.checkpoint import state_codec as plain
from trainer.checkpoint.format import (MANIFEST, OTHER_LAYOUT, CheckpointInfo, CheckpointInvalid, CheckpointUnloadable, StepOccupied,
                                _hash_file, _verify_file, _write_hashed_plain, build_manifest, check_checkpoint,
                                check_manifest_entries, copy_dir, delete_checkpoint, download_dir, kept, kept_mismatch,
                                layout_mismatch, list_checkpoints, parse_manifest_header, publish_dir,
                                read_manifest, step_name)
from trainer.checkpoint.key import CheckpointKey, KeyProblem
from trainer.checkpoint.checkpointer import (TIERS, Checkpointer, Durability, EmergencyReport, Restored, TierPolicy, _check_meta,
                                  _Upload)
from trainer.distributed import World
from trainer.checkpoint.host_copy import HostCopy
from trainer.checkpoint.interval import DEFAULT_MTBF_S
from trainer.loop.state import ResumeMismatch
from trainer.checkpoint.stores import TMP_PREFIX, DirStore, GcsStore, Store, UploadAborted, fsync_dir, is_unreachable
from trainer.checkpoint.tier_wait import TierUnknown

EXTRAS = "extras.json"
DCP_METADATA = ".metadata"
#: ``meta.sharded.layout`` in the manifest: what wrote the payload.
LAYOUT = "torch.distributed.checkpoint"
_SHARD_RE = re.compile(r"^__(\d+)_\d+\.distcp$")


# --------------------------------------------------------------------------------------------
# FSDP2 wrapping
# --------------------------------------------------------------------------------------------


def shard(model: nn.Module, world: World, *, optimizer: torch.optim.Optimizer | None = None,
          blocks: Iterable[nn.Module] | None = None) -> nn.Module:
    """Shard ``model`` with FSDP2 across every rank: each block, then the root.

    ``blocks`` default: the parameterised elements of every ``nn.ModuleList``/``nn.Sequential``
    inside the model (transformer layers and the like), so parameters are gathered one block at a
    time during forward/backward. The model must already be on its device (CPU with gloo, CUDA
    with nccl). ``fully_shard`` replaces every parameter by a new sharded one; pass the
    ``optimizer`` built on the old parameters and its param groups are re-pointed in place (its
    state must still be empty; the scheduler keeps working since the optimizer object stays).

    Without a process group (a single process) the model is returned unchanged: its state dict is
    then the full one, and ``ShardedCheckpointer`` saves and loads it the same way.

    Tied weights (one parameter in two blocks, e.g. embedding and output head) must sit in one
    FSDP unit: pass ``blocks`` that do not split them.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if optimizer is not None and optimizer.state:
        raise ValueError("shard() re-points the optimizer's parameters; it must not have state yet "
                         "(call shard() before the first step)")
    names = {id(p): n for n, p in model.named_parameters()}
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    mesh = init_device_mesh(device.type, (world.size,))
    chosen = list(blocks) if blocks is not None else _default_blocks(model)
    for block in chosen:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if optimizer is not None:
        new = dict(model.named_parameters())
        for group in optimizer.param_groups:
            group["params"] = [new[names[id(p)]] for p in group["params"]]
    return model


def _default_blocks(model: nn.Module) -> list[nn.Module]:
    """The elements of the outermost ``nn.ModuleList``/``nn.Sequential`` containers (the
    transformer layers): one FSDP unit per layer. Containers inside a chosen layer (its MLP) are
    not split further: the layer's output then is its own tensor, and units stay large enough
    for one all-gather each."""
    out: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        for child in m.children():
            if isinstance(child, (nn.ModuleList, nn.Sequential)):
                out.extend(c for c in child.children() if any(True for _ in c.parameters()))
            else:
                visit(child)

    visit(model)
    return out


# --------------------------------------------------------------------------------------------
# The sharded manifest and listing (the single-process manifest requires exactly its two files)
# --------------------------------------------------------------------------------------------


def parse_sharded_manifest(data: bytes, step: int | None = None, *, key: CheckpointKey | None = None) -> dict:
    """``trainer.checkpoint.format.parse_manifest`` with the sharded file list: the DCP index, the extras
    and one or more rank files, nothing else; raises ``CheckpointInvalid``."""
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


def list_sharded(store: Store, *, key: CheckpointKey | None = None) -> list[CheckpointInfo]:
    """Every ``step-N`` on the store, newest first, quick-checked (manifest and HMAC, presence,
    sizes)."""
    return list_checkpoints(store, parse_sharded_manifest, key=key)


def check_sharded(store: Store, step: int, *, key: CheckpointKey | None = None) -> CheckpointInfo | None:
    """Quick check of one step (None when nothing of it exists on the store)."""
    return check_checkpoint(store, step, parse_sharded_manifest, key=key)


def verify_sharded_dir(folder: Path, *, key: CheckpointKey | None = None) -> dict:
    """Full verification of a sharded checkpoint folder (the manifest's HMAC under ``key``, every
    file's sha256); the manifest. Only after this may DCP read the folder."""
    folder = Path(folder)
    m = read_manifest(folder, parse_sharded_manifest, key=key)
    for name, info in sorted(m["files"].items()):
        _verify_file(folder / name, info)
    return m


def _commit(stage: Path, final: Path, *, replace: bool = False) -> None:
    """A staging folder holding its manifest (written last) becomes the checkpoint: fsync, atomic
    rename (or swap, with ``replace``), fsync the parent."""
    fsync_dir(stage)
    publish_dir(stage, final, replace=replace)


def copy_sharded_dir(src: Path, root: Path, *, key: CheckpointKey | None = None, replace: bool = False) -> Path:
    """Copy a folder holding a sharded manifest (committed or staged) into ``root`` atomically."""
    return copy_dir(src, root, parse_sharded_manifest, key=key, replace=replace)


def _spill_roots() -> list[Path]:
    """Where the shards are staged when no disk tier takes them and GCS must: host memory
    (``/dev/shm``, a tmpfs), else the temporary folder (the boot disk)."""
    roots = [Path("/dev/shm")] if os.path.isdir("/dev/shm") else []
    return roots + [Path(tempfile.gettempdir())]


def download_sharded(store: Store, step: int, root: Path, *, key: CheckpointKey | None = None) -> Path:
    """Copy ``step-N`` from ``store`` into ``root/step-N/``: the manifest authenticated, every file
    verified, then the manifest written, then the atomic rename."""
    return download_dir(store, step, root, parse_sharded_manifest, key=key)


def _file_entry(path: Path) -> dict:
    size, digest = _hash_file(path)
    return {"size": size, "sha256": digest}


def _load_extras(path: Path) -> Any:
    """The extras of a verified folder (plain JSON: nothing to unpickle)."""
    try:
        return plain.loads(path.read_bytes())
    except plain.DecodeError as e:
        raise CheckpointUnloadable(f"{EXTRAS} verified but cannot be decoded ({e})") from None


# --------------------------------------------------------------------------------------------
# The checkpointer
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Job:
    step: int
    staged: dict            # {"model": ..., "optim": ...}: this rank's shards, on the host
    extras: bytes | None    # rank 0: the extras as plain JSON (``trainer.checkpoint.state_codec.dumps``)
    meta: dict
    names: list[str]        # tiers to write, identical on every rank
    tag: str                # staging folder suffix, identical on every rank
    created_unix: float
    deadline: float | None  # time.monotonic(); emergency saves only


@dataclasses.dataclass
class _Outcome:
    disk: dict[str, bool]   # tier -> complete copy committed on every node
    gcs: bool | None        # None: not attempted
    detail: list[str]


#: ``_obtain``'s tier field when a tier did not answer (unknown, not invalid), then the tier's name.
_UNREACHABLE = "unreachable:"


class ShardedCheckpointer(Checkpointer):
    """Asynchronous multi-tier checkpoints of FSDP2 state; see the module docstring.

    Reuses ``Checkpointer``'s tiers, policies, intervals and ``due()``; replaces how a checkpoint
    is written, listed, restored and retained. Every method but ``describe()`` is collective.
    """

    #: Listings, retention and ``describe()`` read the sharded manifest.
    parse_manifest = staticmethod(parse_sharded_manifest)

    def __init__(self, *, run_dir: Path, local_dir: Path | None = None, gcs_uri: str | None = None,
                 policies: dict[str, TierPolicy] | None = None, mtbf_s: float = DEFAULT_MTBF_S,
                 log: logging.Logger | None = None, world: World, gcs_client: Any = None,
                 collective_timeout_s: float | None = None, key: CheckpointKey | None = None) -> None:
        if key is None:
            raise KeyProblem(
                'checkpoint_key_file: sharded checkpoints (parallelism = "fsdp") need a checkpoint key: '
                "torch.distributed.checkpoint reads its .metadata with pickle, so a sharded checkpoint is "
                "only loaded after its manifest's HMAC verified (--checkpoint-key-file; on a VM the stack "
                "provides one; see docs/security.md)")
        super().__init__(run_dir=run_dir, local_dir=local_dir, gcs_uri=gcs_uri, policies=policies,
                         mtbf_s=mtbf_s, log=log, gcs_client=gcs_client, key=key)
        self.world = world
        distributed = world.distributed and dist.is_available() and dist.is_initialized()
        # The checkpoint threads' own group (a collective: every rank constructs at once).
        # ``collective_timeout_s`` bounds how long a checkpoint collective waits for a rank that
        # died (default: the process group's default timeout).
        timeout = None if collective_timeout_s is None else datetime.timedelta(seconds=collective_timeout_s)
        self._pg = dist.new_group(backend="gloo", timeout=timeout) if distributed else None
        # The uploader's own group, for uploads across nodes (every rank sends its shards): an
        # upload in flight then never holds the save thread's or the emergency save's group.
        self._pg_up = dist.new_group(backend="gloo", timeout=timeout) if distributed else None
        self._rank = dist.get_rank(self._pg) if self._pg is not None else 0
        self._size = dist.get_world_size(self._pg) if self._pg is not None else 1
        self._host = HostCopy(cuda=torch.cuda.is_available())  # reused host buffers, pinned on CUDA
        # Ranks that see the same run dir form a node; its lowest rank is the leader.
        self.run_dir.mkdir(parents=True, exist_ok=True)
        st = self.run_dir.stat()
        keys = self._all((socket.gethostname(), st.st_dev, st.st_ino))
        self._leader_of = [min(r for r, k in enumerate(keys) if k == key) for key in keys]
        self.is_leader = self._leader_of[self._rank] == self._rank
        self.nodes = len(set(keys))
        if self.nodes > 1 and self._rank == 0:
            self.log.info("sharded checkpoints: %d ranks on %d nodes; each node's disk holds only its own "
                          "ranks' shards, so the complete copy is the GCS one", self._size, self.nodes)
            if self.gcs is None:
                self.log.warning("sharded checkpoints across %d nodes without gcs_uri: no tier will hold a "
                                 "complete checkpoint, so no restore is possible", self.nodes)

    # ------------------------------------------------------------------------------ collectives
    def _all(self, obj: Any, group: Any = None) -> list[Any]:
        group = self._pg if group is None else group
        if group is None:
            return [obj]
        out: list[Any] = [None] * self._size
        dist.all_gather_object(out, obj, group=group)
        return out

    def _bcast(self, obj: Any, group: Any = None) -> Any:
        group = self._pg if group is None else group
        if group is None:
            return obj
        box = [obj if self._rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=group)
        return box[0]

    # ------------------------------------------------------------------------------ durability
    def _durable_tiers(self) -> list[str]:
        """On several nodes no disk holds a complete copy: only GCS can (see the module doc)."""
        return ["gcs"] if self.nodes > 1 else super()._durable_tiers()

    def durable(self, step: int, *, deadline: float) -> Durability:
        """``Checkpointer.durable``: every rank waits for its own saves in flight; rank 0 reads
        the tiers back (the others get an empty verdict: the caller takes rank 0's). Not a
        collective, so a caller may stop waiting for it at any time."""
        if self._rank == 0:
            return super().durable(step, deadline=deadline)
        if not self.wait(timeout=max(0.0, deadline - time.monotonic())):
            self._stop_uploads(f"step {step} was due durable by the deadline")
        return Durability(step, {})

    def _buffer_free(self) -> bool:
        return True  # the host copy (trainer.checkpoint.host_copy) is reused by one save at a time


    # ------------------------------------------------------------------------------ saving
    def _stage(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(model, optimizer)
        return self._host.copy({"model": msd, "optim": osd})

    def _plan(self, step: int, extras: Any, meta: dict | None, *, names: list[str] | None,
              every_tier: bool = False) -> tuple[list[str], str, bytes | None, dict]:
        meta = _check_meta(meta)
        plan = None
        blob = None
        if self._rank == 0:
            if names is None:
                names = list(self._tiers) if every_tier else (self._due_tiers(step) or list(self._tiers))
                if "gcs" in names and self.nodes > 1 and self.uploading() and not every_tier:
                    names.remove("gcs")  # uploads across nodes queue in order: GCS stays due
                if "gcs" in names and not any(self._tiers[n].is_disk for n in names):
                    names.append("persistent")  # the shards are staged on a disk tier
                names = [n for n in TIERS if n in names]
            try:
                blob = plain.dumps(extras)  # encoded now: the loop may change these objects right after
                plan = (names, uuid.uuid4().hex[:8], None)
            except plain.NotPlainData as e:
                plan = (names, "", str(e))
        names, tag, error = self._bcast(plan)
        if error is not None:  # every rank raises, so no rank is left waiting in a collective
            raise plain.NotPlainData(f"extras: {error}")
        meta = {**meta, "world_size": self._size,
                "sharded": {"layout": LAYOUT, "world_size": self._size, "nodes": self.nodes}}
        return names, tag, blob, meta

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, *,  # type: ignore[override]
             extras: Any = None, meta: dict | None = None, every_tier: bool = False) -> float:
        """Stage this rank's shards on the host and write every due tier in the background (every
        tier when none is due, or when ``every_tier``: the final checkpoint, a pause); returns the
        seconds the caller was blocked. ``extras`` is rank 0's (other ranks may pass None); rank
        0's view of which tiers are due decides for every rank."""
        t0 = time.perf_counter()
        if self._busy():
            self.stats["waited"] += 1
            self._thread.join()  # type: ignore[union-attr]
        names, tag, blob, meta = self._plan(step, extras, meta, names=None, every_tier=every_tier)
        t_snap = time.perf_counter()
        staged = self._stage(model, optimizer)
        snap_s = time.perf_counter() - t_snap
        now = time.monotonic()
        for n in names:
            self._tiers[n].last_step, self._tiers[n].last_time = step, now
            if self._tiers[n].auto is not None:
                self._tiers[n].auto.observe(blocked_s=snap_s)
        self.stats["saves"] += 1
        job = _Job(step, staged, blob, meta, names, tag, time.time(), None)
        self._thread = threading.Thread(target=self._background, args=(job,),
                                        name=f"sharded-checkpoint-{step}", daemon=True)
        self._thread.start()
        blocked = time.perf_counter() - t0
        self.stats["blocked_s_total"] += blocked
        self.stats["last_blocked_s"] = blocked
        return blocked

    def _background(self, job: _Job) -> None:
        try:
            self._write(job)
        except BaseException as e:  # noqa: BLE001 - a background thread must not die silently
            self._failed("?", job.step, e)

    def _write(self, job: _Job) -> _Outcome:
        """Write ``job`` to its tiers. Collective over ``self._pg``: every rank runs the same
        sequence of collectives whatever fails locally (failures travel as values), so one
        rank's error never leaves the others waiting. The disk tiers fail independently of each
        other and of GCS: the shards are staged on the first disk tier that takes them, else
        (GCS being due) in host memory or a temporary folder, which the upload then reads.
        The upload goes to the uploader; an emergency save (``job.deadline``) uploads at once."""
        step, out = job.step, _Outcome({}, None, [])
        disk = [n for n in job.names if self._tiers[n].is_disk]
        final_name = step_name(step)
        t0 = time.monotonic()

        # 1. Every rank writes its shards (DCP's own collectives run on our group), and hashes the
        #    files it wrote (rank 0 also the index and the extras), on the first root that takes
        #    them on every rank.
        roots = [self._tiers[n].store.root for n in disk]  # type: ignore[attr-defined]
        if "gcs" in job.names:
            roots += _spill_roots()
        stage: Path | None = None
        files: dict[str, dict] = {}
        reasons = []
        for root in roots:
            cand = root / f"{TMP_PREFIX}{final_name}-{job.tag}"
            files = {}
            err = _try(lambda: root.mkdir(parents=True, exist_ok=True))
            if any(self._all(err)):
                err = err or "skipped: another rank could not create its checkpoint folder"
            else:
                err = _try(lambda: self._dcp_save(job.staged, cand))
                if err is None:
                    err = _try(lambda: files.update(self._own_files(cand, job.extras)))
            errors = [f"rank {r}: {e}" for r, e in enumerate(self._all(err)) if e]
            if not errors:
                stage = cand
                break
            reasons.append(f"{root}: {'; '.join(errors)}")
            if self.is_leader:
                shutil.rmtree(cand, ignore_errors=True)
        results = self._all(files)
        manifest: bytes | None = None
        if stage is not None and self._rank == 0:
            merged: dict[str, dict] = {}
            for f in results:
                merged.update(f)
            manifest = build_manifest(step, merged, job.meta, job.created_unix, key=self.key,
                                      writer=self.session)
        manifest = self._bcast(manifest)
        job.staged = {}  # the host copy is no longer needed
        if stage is None or manifest is None:
            reason = " | ".join(reasons) or "nowhere to write them"
            for n in job.names:
                if self._rank == 0:  # rank 0 speaks for the job (it has every rank's reason)
                    self._failed(n, step, RuntimeError(f"writing the shards failed: {reason}"))
                out.disk.setdefault(n, False)
            out.gcs = False if "gcs" in job.names else None
            out.detail.append(f"shards not written ({reason})")
            return out
        if reasons and self._rank == 0:
            self.log.warning("checkpoint step %d: shards staged in %s (%s)", step, stage.parent, " | ".join(reasons))
        write_s = time.monotonic() - t0

        # 2. Node leaders commit complete copies on their disks (multi-node: none is complete).
        status: dict[str, str] = {}
        committed: Path | None = None
        if self.is_leader:
            status, committed = self._commit_disk(job, disk, stage, manifest)
        statuses = self._all(status)
        for n in disk:
            ok = all(s.get(n) == "ok" for r, s in enumerate(statuses) if self._leader_of[r] == r)
            out.disk[n] = ok
            if ok:
                if self._rank == 0:
                    self._succeeded(self._tiers[n], step, write_s if n == disk[0] else time.monotonic() - t0)
            elif self._rank == 0:
                why = "; ".join(f"node of rank {r}: {s.get(n)}" for r, s in enumerate(statuses)
                                if self._leader_of[r] == r and s.get(n) != "ok")
                if self.nodes > 1:
                    self.log.info("checkpoint step %d: no complete copy on %s (%d nodes, each disk holds "
                                  "its own shards)", step, n, self.nodes)
                else:
                    self._failed(n, step, RuntimeError(why))
            out.detail.append(f"{n} {'saved' if ok else 'not complete'}")

        # 3. GCS, from this node's committed copy or from the staging folder.
        handed = False
        if "gcs" in job.names:
            handed = self._hand_over(job, stage, committed, manifest, out)
        if self.is_leader and not handed and stage.exists():
            shutil.rmtree(stage, ignore_errors=True)  # not committed here (multi-node or failed)
        return out

    def _hand_over(self, job: _Job, stage: Path, committed: Path | None, manifest: bytes, out: _Outcome) -> bool:
        """Upload ``job`` (an emergency save at once, a periodic one through the uploader).
        True when the staging folder now belongs to the upload (which removes it)."""
        step = job.step
        # This node's copy: persistent, else local, else the staging folder (never committed).
        folders = {n: self._tiers[n].store.root / step_name(step)  # type: ignore[attr-defined]
                   for n in ("persistent", "local") if committed is not None and out.disk.get(n)}
        tier = next(iter(folders), None)
        src = folders[tier] if tier is not None else stage

        def cleanup() -> None:
            if self.is_leader:
                shutil.rmtree(stage, ignore_errors=True)

        if self.nodes > 1:  # every rank uploads its own files, in order, on every rank
            if job.deadline is not None:
                t1 = time.monotonic()
                out.gcs, why = self._upload_sharded(step, stage, manifest, job.deadline)
                self._record_upload(step, out, why, t1)
                return False
            self._enqueue(_Upload(step, folder=stage, manifest=manifest, collective=True, cleanup=cleanup))
            out.detail.append("GCS upload queued")
            return True
        if job.deadline is not None:  # one node: rank 0 uploads the complete folder alone
            parts: list[str] = []
            if self._rank == 0:
                out.gcs = self._emergency_upload(self._tiers["gcs"], step, src, job.deadline, parts)
            out.gcs, parts = self._bcast((out.gcs, parts))
            out.detail += parts
            return False
        if self._rank != 0:
            return False
        if tier is not None:
            self._pin(tier, step)
        self._enqueue(_Upload(step, folder=src, tier=tier, cleanup=None if tier is not None else cleanup))
        out.detail.append("GCS upload queued")
        return tier is None

    def _record_upload(self, step: int, out: _Outcome, why: str, t1: float) -> None:
        if out.gcs:
            if self._rank == 0:
                self._succeeded(self._tiers["gcs"], step, time.monotonic() - t1)
            out.detail.append(f"GCS uploaded ({self._tiers['gcs'].store.location(step_name(step))})")  # type: ignore[attr-defined]
        else:
            if self._rank == 0:
                self._failed("gcs", step, RuntimeError(why))
            out.detail.append(f"GCS not done ({why})")

    def _run_upload(self, job: _Upload) -> None:
        if not job.collective:
            return super()._run_upload(job)
        t1 = time.monotonic()
        out = _Outcome({}, None, [])
        assert job.folder is not None and job.manifest is not None
        out.gcs, why = self._upload_sharded(job.step, job.folder, job.manifest, job.deadline,
                                            abort=job.abort, group=self._pg_up)
        self._record_upload(job.step, out, why, t1)
        return None

    def _dcp_save(self, staged: dict, stage: Path) -> None:
        import torch.distributed.checkpoint as dcp

        writer = dcp.FileSystemWriter(str(stage), single_file_per_rank=True, sync_files=True)
        with _single_process_quiet():
            dcp.save(staged, storage_writer=writer, process_group=self._pg, no_dist=self._pg is None)

    def _own_files(self, stage: Path, extras: bytes | None) -> dict[str, dict]:
        """size and sha256 of the files this rank is responsible for."""
        out: dict[str, dict] = {}
        if self._rank == 0:
            _write_hashed_plain(stage / EXTRAS, extras or b"")
        for p in sorted(stage.iterdir()):
            m = _SHARD_RE.match(p.name)
            mine = int(m.group(1)) == self._rank if m else (self._rank == 0 and not p.name.startswith(TMP_PREFIX))
            if mine and p.is_file():
                out[p.name] = _file_entry(p)
        return out

    def _commit_disk(self, job: _Job, disk: list[str], stage: Path,
                     manifest: bytes) -> tuple[dict[str, str], Path | None]:
        """Leader: make every due disk tier hold the checkpoint, each on its own (the staging
        folder is renamed into the tier it was staged on, copied into the others). Returns tier ->
        "ok" or the reason, and a committed folder (None when no tier holds one)."""
        status: dict[str, str] = {}
        m = json.loads(manifest)
        missing = [n for n, i in m["files"].items()
                   if not (stage / n).is_file() or (stage / n).stat().st_size != i["size"]]
        if missing:
            why = f"this node holds {len(m['files']) - len(missing)} of {len(m['files'])} files"
            return {n: why for n in disk}, None
        try:
            _write_hashed_plain(stage / MANIFEST, manifest)  # last: the staged folder is complete
        except Exception as e:  # noqa: BLE001 - the staging disk just filled up: nothing to commit
            return {n: f"{type(e).__name__}: {e}" for n in disk}, None
        src: Path | None = None
        for n in disk:
            t = self._tiers[n]
            root: Path = t.store.root  # type: ignore[attr-defined]
            target = root / step_name(job.step)
            try:
                # Same step saved again (an emergency save of a step just saved, the final save of
                # a re-run): keep a copy of this state, replace other state or an invalid copy
                # atomically, never touch a kept one (StepOccupied).
                replace = target.exists()
                if replace and ((n, job.step) in self._verified
                                or self._keep_same_step(n, target, job.step, writer=m.get("writer"))):
                    status[n] = "ok"
                    src = src or target
                    continue
                if stage.parent == root and stage.exists():
                    _commit(stage, target, replace=replace)
                else:
                    copy_sharded_dir(src or stage, root, key=self.key, replace=replace)
                self._verified.add((n, job.step))
                src = src or target
                status[n] = "ok"
            except Exception as e:  # noqa: BLE001 - reported through the status
                status[n] = f"{type(e).__name__}: {e}"
        return status, src

    def _upload_sharded(self, step: int, src: Path, manifest: bytes, deadline: float | None, *,
                        abort: threading.Event | None = None, group: Any = None) -> tuple[bool, str]:
        """Collective upload of ``src`` (this node's copy) to GCS over ``group`` (default: the
        save's); (ok, reason). Each rank uploads its own shard files, rank 0 the rest, then
        rank 0 the manifest once every rank reported its part done."""
        store = self._tiers["gcs"].store
        assert isinstance(store, GcsStore)
        prefix = step_name(step)
        decision = None
        if self._rank == 0:
            try:
                with store.deadline(deadline), store.aborting(abort):
                    info = check_sharded(store, step, key=self.key)
                    ours = json.loads(manifest).get("writer")
                    theirs = (info.manifest or {}).get("writer") if info is not None else None
                    if info is not None and info.valid and theirs in self._same_state(step, ours):
                        decision = "skip"  # this very state is there already
                    elif info is not None and kept(info.reason):
                        decision = (f"gcs holds a checkpoint at step {step} that is never overwritten "
                                    f"({info.reason}); this tier skips step {step}")
                    else:
                        if info is not None and info.valid:
                            self.log.warning("gcs step %d verifies but holds other state (written by session "
                                             "%s); replacing it with this run's", step,
                                             (info.manifest or {}).get("writer", "unknown"))
                        elif info is not None:
                            self.log.info("removing partial upload of step %d on gcs (%s)", step, info.reason)
                        if info is not None:
                            delete_checkpoint(store, step)
                        decision = "upload"
            except Exception as e:  # noqa: BLE001
                decision = f"{type(e).__name__}: {e}"
        decision = self._bcast(decision, group)
        if decision == "skip":
            return True, ""
        if decision != "upload":
            return False, decision
        names = [n for n in json.loads(manifest)["files"]
                 if (m := _SHARD_RE.match(n)) and int(m.group(1)) == self._rank
                 or (not _SHARD_RE.match(n) and self._rank == 0)]

        def upload_mine() -> None:
            with store.deadline(deadline), store.aborting(abort):
                for n in names:
                    store.put_file(src / n, f"{prefix}/{n}")

        errs = self._all(_try(upload_mine), group)
        result: tuple[bool, str] | None = None
        if self._rank == 0:
            bad = [f"rank {r}: {e}" for r, e in enumerate(errs) if e]
            if bad:
                result = (False, "; ".join(bad) + " (no manifest uploaded: nothing partial is visible)")
            else:
                def commit() -> None:
                    with store.deadline(deadline), store.aborting(abort):
                        if deadline is not None and time.monotonic() > deadline:
                            raise UploadAborted("deadline passed before the manifest upload")
                        store.put_bytes(f"{prefix}/{MANIFEST}", manifest)

                e = _try(commit)
                result = (e is None, e or "")
        return self._bcast(result, group)

    # ------------------------------------------------------------------------------ retention
    def _retain(self, t: Any, newest_step: int) -> None:
        """``Checkpointer._retain`` (with the sharded listing, through ``parse_manifest``).
        ``_succeeded`` calls it on rank 0 only, which leads its node: on one host that is the
        node holding complete disk copies, on several hosts the disks hold no committed
        checkpoints to prune."""
        if t.is_disk and not self.is_leader:
            return
        super()._retain(t, newest_step)

    # ------------------------------------------------------------------------------ restoring
    def restore(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Restored | None:  # type: ignore[override]
        """Load the newest checkpoint that verifies into ``model`` and ``optimizer`` (in place,
        resharded to this world size); returns rank 0's extras as ``Restored.state`` on every
        rank, or None when there is nothing to restore (see the module docstring).

        A copy that fails verification is skipped with the reason and the next older one tried.
        A verified checkpoint that does not fit the model raises ``ResumeMismatch`` on every rank.
        """
        t_start = time.monotonic()
        self.wait()
        with self._restore_lock:
            if self.is_leader:
                for t in self._tiers.values():
                    if isinstance(t.store, DirStore):
                        removed = t.store.clean_temporaries()
                        if removed:
                            self.log.info("removed leftovers of interrupted writes on %s: %s",
                                          t.name, ", ".join(removed))
            steps: list[int] | None = None
            other: list[str] = []
            unknown: dict[str, str] = {}
            if self._rank == 0:
                try:
                    candidates, other = self._survey()
                except TierUnknown as e:  # every rank raises it together, below
                    unknown = e.tiers
                else:
                    steps = sorted({c[0] for c in candidates}, reverse=True)
            steps, other, unknown, self._survey_kept = self._bcast((steps, other, unknown, self._survey_kept))
            if unknown:
                raise TierUnknown(unknown)
            if other:
                raise ResumeMismatch(layout_mismatch("fsdp", other))
            if self._survey_kept["format"]:
                raise ResumeMismatch(kept_mismatch(self._survey_kept["format"], None))
            for step in steps:
                got = self._obtain(step) if self.is_leader else None
                copies = self._all(got)
                unreachable = {f"{c[2][len(_UNREACHABLE):]} (node of rank {r})": c[1] for r, c in enumerate(copies)
                               if c is not None and not c[0] and c[2].startswith(_UNREACHABLE)}
                if unreachable:
                    raise TierUnknown(unreachable)
                bad = [f"node of rank {r}: {c[1]}" for r, c in enumerate(copies)
                       if self._leader_of[r] == r and not c[0]]
                if bad:
                    if self._rank == 0:
                        self.log.warning("checkpoint step %d is unusable: %s; falling back to the next "
                                         "older one", step, "; ".join(bad))
                    continue
                _, path, tier = copies[self._leader_of[self._rank]]
                loaded: list[Any] = []
                err = _try(lambda: loaded.append(self._load(Path(path), model, optimizer)))
                errs = self._all(err)
                if any(errs):
                    # Every file matched its sha256 under an authentic manifest, so this is no
                    # corruption: the checkpoint does not fit this model/optimizer (another
                    # architecture or settings). Older ones would not fit either, and starting
                    # afresh would throw the run away.
                    raise ResumeMismatch(
                        f"cannot resume from step {step} on {tier} at {path}: the checkpoint verified but "
                        "does not fit this model and optimizer (use the original code and settings, or a "
                        "new --run-dir/--gcs-uri for a new run; nothing was deleted): "
                        + "; ".join(f"rank {r}: {e}" for r, e in enumerate(errs) if e)[:2000])
                seconds = time.monotonic() - t_start
                if self._rank == 0:
                    self.log.info("restored step %d from %s (%s) in %.2fs", step, tier, path, seconds)
                now = time.monotonic()
                for x in self._tiers.values():
                    x.last_step, x.last_time = step, now
                with contextlib.suppress(Exception):  # its copies hold this process's state
                    writer = read_manifest(Path(path), parse_sharded_manifest, key=self.key).get("writer")
                    if writer:
                        self._restored[step] = writer
                return Restored(step=step, state=loaded[0], tier=tier, path=path, seconds=seconds)
            if self._survey_kept["unauthenticated"]:
                raise ResumeMismatch(kept_mismatch(self._survey_kept["unauthenticated"], self.key))
            if self._rank == 0:
                self.log.info("no valid checkpoint on any tier; starting from scratch")
            return None

    def _verify_folder(self, folder: Path) -> dict:
        return verify_sharded_dir(folder, key=self.key)

    def _obtain(self, step: int) -> tuple[bool, str, str]:
        """Leader: a verified complete copy of ``step`` on this node: (True, folder, tier) or
        (False, reason, ""). Disk tiers first (fastest first), else a download from GCS into
        the persistent tier."""
        reasons = []
        for t in self._tiers.values():
            if not isinstance(t.store, DirStore):
                continue
            folder = t.store.root / step_name(step)
            if not folder.exists():
                continue
            try:
                verify_sharded_dir(folder, key=self.key)
                return True, str(folder), t.name
            except CheckpointInvalid as e:
                reasons.append(f"{t.name} copy at {folder}: {e}")
                self.log.warning("checkpoint step %d on %s at %s is unusable: %s", step, t.name, folder, e)
        gcs = self._tiers.get("gcs")
        if gcs is not None:
            try:
                with gcs.store.deadline(time.monotonic() + self.LIST_TIMEOUT_S):  # type: ignore[attr-defined]
                    info = check_sharded(gcs.store, step, key=self.key)
                if info is not None and info.valid:
                    persistent = self._tiers["persistent"].store
                    assert isinstance(persistent, DirStore)
                    if (persistent.root / step_name(step)).exists():
                        stale = check_sharded(persistent, step, key=self.key)
                        if stale is not None and kept(stale.reason):
                            raise StepOccupied(f"the persistent tier's step {step} is never overwritten "
                                               f"({stale.reason}), so the GCS copy cannot be placed there")
                        self.log.warning("replacing invalid persistent copy of step %d with the GCS one", step)
                        delete_checkpoint(persistent, step)
                    folder = download_sharded(gcs.store, step, persistent.root, key=self.key)
                    self.log.info("downloaded step %d from %s into %s", step, info.location, folder)
                    return True, str(folder), "gcs"
                reasons.append(f"gcs: {info.reason if info else 'not there'}")
            except Exception as e:  # noqa: BLE001
                if is_unreachable(e):  # unknown, not invalid: never fall back to an older step
                    return False, f"{type(e).__name__}: {e}", _UNREACHABLE + "gcs"
                reasons.append(f"gcs: {type(e).__name__}: {e}")
        return False, "; ".join(reasons) or "no copy on this node", ""

    def _load(self, folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> Any:
        self.load_into(folder, model, optimizer)
        return _load_extras(folder / EXTRAS)

    def load_into(self, folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        """Load a verified checkpoint folder's shards into ``model`` (and ``optimizer``; None:
        the weights only), resharded to this world size. A collective (``--init-from``)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict,
                                                             set_model_state_dict, set_state_dict)

        if optimizer is None:
            sd = {"model": get_model_state_dict(model)}
        else:
            msd, osd = get_state_dict(model, optimizer)
            sd = {"model": msd, "optim": osd}
        with _single_process_quiet():
            dcp.load(sd, storage_reader=dcp.FileSystemReader(str(folder)), process_group=self._pg,
                     no_dist=self._pg is None)
        if optimizer is None:
            set_model_state_dict(model, sd["model"])
        else:
            set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    # ------------------------------------------------------------------------------ emergency
    def emergency_save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, *,  # type: ignore[override]
                       extras: Any = None, deadline: float, meta: dict | None = None) -> EmergencyReport:
        """Save now, on a preemption notice: every disk tier synchronously, fastest first, then GCS
        until ``deadline`` (time.monotonic), as ``Checkpointer.emergency_save``. On several nodes
        the disk copy is never complete (``persistent_ok`` False), so GCS is what counts."""
        t0 = time.monotonic()
        report = self._uninterrupted(
            step, t0, lambda: self._emergency_sharded(step, model, optimizer, extras, deadline, meta, t0))
        if self._rank == 0:
            (self.log.info if report.saved else self.log.error)(
                "emergency save: %s", report.detail)
        return report

    def _emergency_sharded(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                           extras: Any, deadline: float, meta: dict | None, t0: float) -> EmergencyReport:
        # As ``Checkpointer._emergency``: no upload is waited for (every rank drops its queue and
        # leaves the upload in flight behind; across nodes that one runs on the uploader's own
        # group), only the save thread's disk writes. Then every tier, fastest first.
        self._stop_uploads(f"emergency save of step {step}")
        if self._busy():
            self._thread.join()  # type: ignore[union-attr]
        names = [n for n in TIERS if n in self._tiers]
        names, tag, blob, meta = self._plan(step, extras, meta, names=names)
        staged = self._stage(model, optimizer)
        out = self._write(_Job(step, staged, blob, meta, names, tag, time.time(), deadline))
        now = time.monotonic()
        for n in names:
            if (out.gcs if n == "gcs" else out.disk.get(n)):
                self._tiers[n].last_step, self._tiers[n].last_time = step, now
        ok = {**out.disk, "gcs": bool(out.gcs)}
        return EmergencyReport(step=step, persistent_ok=bool(out.disk.get("persistent")),
                               gcs_ok=out.gcs if "gcs" in self._tiers else None, seconds=time.monotonic() - t0,
                               detail=f"step {step}: " + "; ".join(out.detail),
                               local_ok=out.disk.get("local") if "local" in self._tiers else None,
                               complete=all(ok.get(n) for n in self._durable_tiers()))

    # ------------------------------------------------------------------------------ lifecycle
    def close(self, timeout: float | None = None) -> bool:  # type: ignore[override]
        """Finish background work and release the host copies (collective when a save is in
        flight, since its thread talks to the other ranks)."""
        done = super().close(timeout)
        self._host.close()
        for name in ("_pg", "_pg_up"):
            group = getattr(self, name)
            # An abandoned upload may still sit in a collective of the uploader's group: leave
            # that group to the process's exit.
            if group is not None and not (name == "_pg_up" and self.abandoned):
                with contextlib.suppress(Exception):  # the default group may be gone already
                    dist.destroy_process_group(group)
            setattr(self, name, None)
        return done

    def describe(self, *, deep: bool = False) -> dict:
        """As ``Checkpointer.describe`` (this node's view; not a collective)."""
        out = super().describe(deep=False)
        if deep:
            for name, entry in out["tiers"].items():
                t = self._tiers[name]
                if not isinstance(t.store, DirStore):
                    continue
                for c in entry["checkpoints"]:
                    if c["valid"]:
                        try:
                            verify_sharded_dir(t.store.root / step_name(c["step"]), key=self.key)
                        except CheckpointInvalid as e:
                            c["valid"], c["reason"] = False, str(e)
                entry["newest_valid"] = next((c["step"] for c in entry["checkpoints"] if c["valid"]), None)
        return out


@contextlib.contextmanager
def _single_process_quiet() -> Any:
    """DCP warns on every call without a process group; one process is a supported case here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _try(fn: Any) -> str | None:
    """Run ``fn``; the error as text (None when it worked). Collectives carry these."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    try:
        fn()
        return None
    except CheckpointException as e:
        # It carries each failing rank's whole traceback; the last line is the actual error.
        lines = [x.strip() for x in str(e).splitlines() if x.strip()]
        return lines[-1] if lines else type(e).__name__
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


__all__ = ["ShardedCheckpointer", "shard", "parse_sharded_manifest", "list_sharded", "check_sharded",
           "verify_sharded_dir", "download_sharded", "EmergencyReport", "Restored", "TierPolicy"]


def inspect(tiers: dict[str, Store], step: int | None = None, *,
            key: CheckpointKey | None = None) -> tuple[int, str, str, dict, dict] | None:
    """Read-only look for ``status`` and ``export``: the newest sharded checkpoint (or the one of
    ``step``) that fully verifies (HMAC under ``key``, every sha256) on any tier (fastest first
    for equal steps) as (step, tier, location, full model state dict, extras), without a process
    group. A GCS-only checkpoint is downloaded into a temporary folder, which is removed
    afterwards; nothing on a tier is changed. Nothing reaches DCP (which unpickles)
    unauthenticated: without a ``key``, KeyProblem."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    import torch.distributed.checkpoint as dcp

    if key is None:
        raise KeyProblem("checkpoint_key_file: sharded checkpoints are inspected only with the run's "
                         "checkpoint key (DCP unpickles its index): pass --checkpoint-key-file")
    candidates = []
    for rank, (name, store) in enumerate(tiers.items()):
        try:
            infos = list_sharded(store, key=key)
        except Exception:  # noqa: BLE001 - a tier being down: look at the others
            continue
        candidates += [(i.step, rank, name, store, i) for i in infos if i.valid and step in (None, i.step)]
    for found, _, name, store, info in sorted(candidates, key=lambda c: (-c[0], c[1])):
        with tempfile.TemporaryDirectory(prefix="spottrain-status-") as tmp:
            try:
                if isinstance(store, DirStore):
                    folder = store.root / step_name(found)
                    verify_sharded_dir(folder, key=key)
                else:
                    folder = download_sharded(store, found, Path(tmp), key=key)
                full: dict = {}
                with _single_process_quiet():  # every file verified above: only now may DCP read them
                    _load_state_dict(full, storage_reader=dcp.FileSystemReader(str(folder)),
                                     planner=_EmptyStateDictLoadPlanner(), no_dist=True)
                return found, name, info.location, full["model"], _load_extras(folder / EXTRAS)
            except Exception:  # noqa: BLE001 - try the next older one, as a restore would
                continue
    return None
