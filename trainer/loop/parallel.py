"""How the model is spread over the ranks: DDP (every rank holds it whole) or FSDP2 (``shard``).

``wrap`` puts the task's model under the run's parallelism: ``ddp`` under
``DistributedDataParallel`` when there are several ranks, ``fsdp`` through ``shard``. What a
checkpoint of each looks like is the checkpoint layouts' (``trainer.checkpoint.whole_model``,
``trainer.checkpoint.sharded``).
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn

from trainer.distributed import World


def wrap(model: nn.Module, world: World, *, parallelism: str, device: torch.device,
         optimizer: torch.optim.Optimizer | None) -> nn.Module:
    """The model the loop trains: sharded (``fsdp``), under DDP (``ddp`` on several ranks), or as
    it is."""
    if parallelism == "fsdp":
        return shard(model, world, optimizer=optimizer)
    if world.distributed:
        return nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    return model


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
    then the full one, and the sharded layout saves and loads it the same way.

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
