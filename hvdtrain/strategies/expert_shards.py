"""What a rank writes of the state in a sharded checkpoint under expert parallelism: every element once.

An expert parameter's share (its ``expert_shard``: slice ``index`` of E along dim 0) and its optimizer
state's per-element entries are written by the ranks of the first expert group, ranks 0..E-1, which
together hold every expert once (the other expert groups hold copies of the same shares). The
replicated rest (attention, routers, shared experts, embeddings, buffers) and its optimizer state is
written by rank 0 alone, as a data-parallel checkpoint would.

The part has the layout of a tensor x pipeline mesh's (``kind`` "mesh", read by
hvdtrain.checkpoint.sources.mesh): a split tensor's pieces carry their TensorShard spec, so the same
reader puts the experts together at any other E, at E=1 (ddp), under a flat sharded strategy, in
``hvdtrain checkpoint consolidate`` and in ``hvdtrain export``: an expert share is a dim-0 slice like a
tensor-parallel one. Local: no collective, nothing gathered. Torch only.
"""
from __future__ import annotations

from typing import Any, Dict, List

import torch

from hvdtrain.strategies.base import tensor_names
from hvdtrain.strategies.sharding.shard_state import compact


def writes(rank: int, experts: int, split: bool) -> bool:
    """Whether ``rank`` writes a tensor: an expert share (``split``) the first expert group's ranks
    (every expert once), a replicated tensor rank 0 alone."""
    return rank < experts if split else rank == 0


def shard_part(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, world_size: int,
               experts: int) -> Dict[str, Any]:
    """This rank's part of a sharded checkpoint (Strategy.shard_state_dict) under expert parallelism.

    Args:
        model: the model, its fused experts split (parameters carrying ``expert_shard``).
        optimizer: its optimizer, stepping the shares in the whole parameters' places.
        rank: this rank.
        world_size: ranks in the world (every one a data-parallel rank).
        experts: E, ranks per expert group.
    """
    distinct = tensor_names(model)
    first = {id(value): names[0] for names, value in distinct}
    model_part: Dict[str, torch.Tensor] = {}
    model_shards: Dict[str, List[int]] = {}
    for names, value in distinct:
        shard = getattr(value, "expert_shard", None)
        if not writes(rank, experts, shard is not None):
            continue
        tensor = compact(value)  # one tensor under every name of a tied one: torch.save writes it once
        for name in names:
            model_part[name] = tensor
            if shard is not None:
                model_shards[name] = shard.spec()
    state: Dict[int, Dict[str, Any]] = {}
    shards: Dict[int, Dict[str, List[int]]] = {}
    optimizer_names: List[List[str]] = []
    index = 0
    for group in optimizer.param_groups:
        group_names = []
        for param in group["params"]:
            if id(param) not in first:
                raise ValueError(f"the optimizer steps a tensor of shape {tuple(param.shape)} that is not in the "
                                 f"model: a sharded checkpoint names every optimized tensor by its state_dict name; "
                                 f"give the optimizer the model's parameters, or use checkpoint_format=full")
            group_names.append(first[id(param)])
            shard = getattr(param, "expert_shard", None)
            if writes(rank, experts, shard is not None):
                for key, value in sorted(optimizer.state.get(param, {}).items()):
                    tensor = isinstance(value, torch.Tensor)
                    state.setdefault(index, {})[key] = compact(value) if tensor else value
                    if shard is not None and tensor and value.dim() and value.shape == param.shape:
                        shards.setdefault(index, {})[key] = shard.spec()
            index += 1
        optimizer_names.append(group_names)
    groups = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    return {"rank": rank, "world_size": world_size,
            "layout": {"kind": "mesh", "mesh": [world_size, 1, 1], "experts": experts,
                       "model_keys": list(model.state_dict().keys()),
                       "tied": [names for names, _ in distinct if len(names) > 1],
                       "optimizer_names": optimizer_names},
            "model": model_part, "model_shards": model_shards,
            "optimizer": {"state": state, "shards": shards, "param_groups": groups}}

