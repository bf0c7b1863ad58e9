"""Where a session continues from: the newest checkpoint any node holds, on every rank.

``newest(ckpt, world)``: one process, or a sharded layout (every rank loads its own shards), asks
its checkpointer. Several nodes with the whole-model layout negotiate: each node leader offers the
newest step its own tiers hold (a node's disk may hold a checkpoint newer than the remote tier has:
the previous rank 0 wrote it there before the world was re-formed), the leader with the newest
restores and sends the state to every rank as tensors (``trainer.checkpoint.broadcast``: never
pickled), rank 0 on a tie; when that step fails full verification on that
node, the leaders negotiate again without it, so another node's older checkpoint (or the remote
tier's) is the fallback, never a fresh start; and a tier any leader cannot read makes every
rank wait (``TierUnknown``: unknown is not empty). A ``ResumeMismatch`` on the restoring rank
reaches every rank, so none is left waiting. When no node offers a step, a node whose disk holds
unauthenticated or other-run checkpoints (its own or root's: no bucket writer can write a disk)
stops every rank (exit 2), as one process would; rank 0 alone may set aside such checkpoints in
the bucket and start from scratch (``Checkpointer.restore``), since every node sees the same bucket.
"""
from __future__ import annotations

from typing import Any

from trainer.checkpoint import broadcast, tier_wait
from trainer.checkpoint.manifest import ResumeMismatch
from trainer.distributed import World, node_name


def newest(ckpt: Any, world: World) -> tuple[dict | None, tuple[str, str]]:
    """The newest valid checkpoint of the job on every rank, and (tier, path) it came from."""
    if ckpt is not None and (ckpt.layout.in_place or not world.distributed):
        restored = ckpt.restore()
        return (restored.state, (restored.tier, restored.path)) if restored else (None, ("", ""))
    # Each leader offers its newest step (or the tiers it cannot read: then every rank waits); the
    # leader with the newest restores it. A step that fails full verification there is struck off
    # that node's offers and the negotiation runs again, so the fallback spans every node's
    # checkpoints, not only the chosen node's own tiers.
    failed: set[int] = set()
    while True:
        offer: tuple[Any, ...] | None = None
        if ckpt is not None:
            try:
                offer = ("step", ckpt.newest_valid_step(excluding=failed), ckpt.held_on_disks())
            except tier_wait.TierUnknown as e:
                offer = ("unknown", e.tiers)
        offers = world.all_gather(offer)
        unknown = {f"{t} (rank {r})": why for r, o in enumerate(offers) if o and o[0] == "unknown"
                   for t, why in o[1].items()}
        if unknown:
            raise tier_wait.TierUnknown(unknown)
        steps = [o[1] if o else None for o in offers]
        best = max((s for s in steps if s is not None), default=None)
        held = next((o[2] for o in offers if o and o[2] is not None), None)
        if best is None and held is not None:  # every rank has the offers: every rank raises
            raise ResumeMismatch(held)
        src = 0 if best is None or steps[0] == best else steps.index(best)
        payload: tuple[str, Any] | None = None
        restored = None
        if world.rank == src:
            try:
                restored = ckpt.restore(step=best)  # best None: the newest, or a fresh start
            except tier_wait.TierUnknown as e:
                payload = ("unknown", e.tiers)
            except ResumeMismatch as e:  # every rank must hear it, or the others wait below
                payload = ("mismatch", str(e))
            else:
                if restored is None and best is not None:
                    payload = ("unusable", best)
                    failed.add(best)
                else:  # the decision only: the state itself follows as tensors
                    payload = ("state", (restored.tier, f"{node_name()}:{restored.path}") if restored else None)
        payload = world.broadcast(payload, src=src)
        assert payload is not None
        if payload[0] == "unknown":
            raise tier_wait.TierUnknown(payload[1])
        if payload[0] == "mismatch":
            raise ResumeMismatch(payload[1])
        if payload[0] == "state":
            break
    if payload[1] is None:
        return None, ("", "")
    before = world.object_bytes
    saved, sent = broadcast.broadcast_state(world, restored.state if restored is not None else None, src=src)
    if world.is_main:
        ckpt.log.info("restore: step %s sent from rank %d as %d tensors (%d bytes) and %d bytes of structure; "
                      "%d bytes pickled", saved["step"], src, sent.tensors, sent.tensor_bytes, sent.structure_bytes,
                      world.object_bytes - before)
    where = payload[1]
    if saved is not None and world.is_main and src != 0:
        ckpt.mark_restored(int(saved["step"]))
    return saved, where
