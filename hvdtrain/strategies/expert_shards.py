"""What a rank writes of the state in a sharded checkpoint under expert parallelism: every element once.

An expert parameter's share (its ``expert_shard``: slice ``index`` of E along dim 0) and its optimizer
state's per-element entries are written by the ranks of the first expert group, ranks 0..E-1, which
together hold every expert once (the other expert groups hold copies of the same shares). The rest
(attention, routers, shared experts, embeddings, buffers) and its optimizer state: under ddp
(``shard_part``) rank 0 writes it alone, as a data-parallel checkpoint would; under fsdp
(``fsdp_shard_part``) each rank writes its own slices of the units' flat buckets, as the elements
[start, stop) of each parameter a slice cuts (a FlatRange), and rank 0 the tensors outside them.
hsdp (no experts) writes the same part: the ranks of its first shard group (0..K-1) their slices,
the other groups' ranks, whose slices are copies of those, no model or optimizer data.

The part has the layout of a tensor x pipeline mesh's (``kind`` "mesh", read by
hvdtrain.checkpoint.sources.mesh): a split tensor's pieces carry their spec, so the same reader puts
the experts and the flat ranges together at any other E, at E=1 (ddp, fsdp), under a flat sharded
strategy, in ``hvdtrain checkpoint consolidate`` and in ``hvdtrain export``: an expert share is a
dim-0 slice like a tensor-parallel one. Local: no collective, nothing gathered. Torch only.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch

from hvdtrain.parallel.tensor.shard import FlatRange
from hvdtrain.strategies.base import tensor_names
from hvdtrain.strategies.sharding import flat_buckets as fb
from hvdtrain.strategies.sharding.shard_state import compact


def writes(rank: int, experts: int, split: bool) -> bool:
    """Whether ``rank`` writes a tensor: an expert share (``split``) the first expert group's ranks
    (every expert once), a replicated tensor rank 0 alone."""
    return rank < experts if split else rank == 0


class _Part:
    """One rank's pieces of the model and of the optimizer's state, in the mesh layout."""

    def __init__(self) -> None:
        self.model: Dict[str, torch.Tensor] = {}
        self.model_shards: Dict[str, Any] = {}
        self.state: Dict[int, Dict[str, Any]] = {}
        self.shards: Dict[int, Dict[str, Any]] = {}

    def add_tensor(self, names: Sequence[str], tensor: torch.Tensor, spec: Optional[Any] = None) -> None:
        tensor = compact(tensor)  # one tensor under every name of a tied one: torch.save writes it once
        for name in names:
            self.model[name] = tensor
            if spec is not None:
                self.model_shards[name] = spec

    def add_state(self, index: int, state: Dict[str, Any], shape: Sequence[int], spec: Any) -> None:
        """The optimizer's state of its parameter ``index``: per-element entries of the piece's
        ``shape`` as that piece (``spec``; None: whole), the rest (Adam's step) as it is."""
        for key, value in sorted(state.items()):
            tensor = isinstance(value, torch.Tensor)
            self.state.setdefault(index, {})[key] = compact(value) if tensor else value
            if spec is not None and tensor and value.dim() and tuple(value.shape) == tuple(shape):
                self.shards.setdefault(index, {})[key] = spec

    def finish(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, names: List[List[str]], rank: int,
               world_size: int, experts: int) -> Dict[str, Any]:
        groups = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
        return {"rank": rank, "world_size": world_size,
                "layout": {"kind": "mesh", "mesh": [world_size, 1, 1], "experts": experts,
                           "model_keys": list(model.state_dict(keep_vars=True).keys()),
                           "tied": [aliases for aliases, _ in tensor_names(model) if len(aliases) > 1],
                           "optimizer_names": names},
                "model": self.model, "model_shards": self.model_shards,
                "optimizer": {"state": self.state, "shards": self.shards, "param_groups": groups}}


def optimizer_names(model: torch.nn.Module, param_groups: Sequence[Dict[str, Any]]) -> List[List[str]]:
    """Per parameter group, its parameters by their first state_dict name (the user's optimizer's order)."""
    first = {id(value): names[0] for names, value in tensor_names(model)}
    found = []
    for group in param_groups:
        for param in group["params"]:
            if id(param) not in first:
                raise ValueError(f"the optimizer steps a tensor of shape {tuple(param.shape)} that is not in the "
                                 f"model: a sharded checkpoint names every optimized tensor by its state_dict name; "
                                 f"give the optimizer the model's parameters, or use checkpoint_format=full")
        found.append([first[id(param)] for param in group["params"]])
    return found


def shard_part(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, world_size: int,
               experts: int) -> Dict[str, Any]:
    """This rank's part of a sharded checkpoint (Strategy.shard_state_dict) under ddp x expert parallelism.

    Args:
        model: the model, its fused experts split (parameters carrying ``expert_shard``).
        optimizer: its optimizer, stepping the shares in the whole parameters' places.
        rank: this rank.
        world_size: ranks in the world (every one a data-parallel rank).
        experts: E, ranks per expert group.
    """
    names = optimizer_names(model, optimizer.param_groups)
    part = _Part()
    for aliases, value in tensor_names(model):
        shard = getattr(value, "expert_shard", None)
        if writes(rank, experts, shard is not None):
            part.add_tensor(aliases, value, shard.spec() if shard is not None else None)
    params = [param for group in optimizer.param_groups for param in group["params"]]
    for index, param in enumerate(params):
        shard = getattr(param, "expert_shard", None)
        if writes(rank, experts, shard is not None):
            part.add_state(index, optimizer.state.get(param, {}), param.shape,
                           shard.spec() if shard is not None else None)
    return part.finish(model, optimizer, names, rank, world_size, experts)


def fsdp_shard_part(model: torch.nn.Module, buckets: Sequence[fb.FlatBucket], optimizer: torch.optim.Optimizer,
                    param_groups: Sequence[Dict[str, Any]], rank: int, world_size: int, experts: int,
                    writes_slices: bool = True) -> Dict[str, Any]:
    """This rank's part of a sharded checkpoint under fsdp x expert parallelism: its own slice of
    every flat bucket, as the ranges of the parameters it cuts, with the same ranges of the shard
    optimizer's per-element state; its experts if it is in the first expert group; on rank 0 the
    tensors outside the buckets and the experts (buffers, untrained parameters).

    Args:
        model: the model, its fused experts split (parameters carrying ``expert_shard``).
        buckets: fsdp's flat buckets (every unit's), this rank's slices in ``shard``.
        optimizer: the shard optimizer: the buckets' shards and the expert shares, and the live hyperparameters.
        param_groups: the user's optimizer's groups (its expert parameters replaced by the shares):
            the numbering and names of the state written.
        rank: this rank (its slice of every bucket).
        world_size: ranks in the world (every one a data-parallel rank).
        experts: E, ranks per expert group (1 without experts: hsdp).
        writes_slices: this rank writes its slices of the buckets; False on a rank whose slices another
            rank writes (hsdp: every shard group but the first holds copies of the first's slices).
    """
    names = optimizer_names(model, param_groups)
    aliases_of = {id(value): aliases for aliases, value in tensor_names(model)}
    part = _Part()
    in_buckets = set()
    for bucket in buckets:
        low, high = bucket.own_range
        state = optimizer.state.get(bucket.shard, {})
        for param, index, offset in zip(bucket.params, bucket.param_indices, bucket.offsets):
            in_buckets.add(id(param))
            start, stop = max(low, offset), min(high, offset + param.numel())
            if start >= stop or not writes_slices:
                continue
            piece = FlatRange(start - offset, stop - offset, tuple(param.shape))
            own = slice(start - low, stop - low)
            part.add_tensor(aliases_of.get(id(param), []), bucket.shard.detach()[own], piece.spec())
            part.add_state(index, {key: value[own] if fb.is_elementwise(value) else value
                                   for key, value in state.items()}, (stop - start,), piece.spec())
    for aliases, value in tensor_names(model):
        shard = getattr(value, "expert_shard", None)
        if id(value) not in in_buckets and writes(rank, experts, shard is not None):
            part.add_tensor(aliases, value, shard.spec() if shard is not None else None)
    params = [param for group in param_groups for param in group["params"]]
    for index, param in enumerate(params):
        shard = getattr(param, "expert_shard", None)
        if shard is not None and writes(rank, experts, True):
            part.add_state(index, optimizer.state.get(param, {}), param.shape, shard.spec())
    return part.finish(model, optimizer, names, rank, world_size, experts)
