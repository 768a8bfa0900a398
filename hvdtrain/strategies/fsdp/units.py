"""FSDP's wrapping units and their sharded flat buffers, laid out once when the strategy is built.

A unit is a submodule (a transformer block, say) whose parameters are gathered together before it
computes and freed after; the root unit holds every optimizer parameter outside the units (the
embeddings, the final norm, the head). A unit's parameters are packed into flat buffers, one per
parameter group of the user's optimizer (and dtype and device), each padded to a multiple of the
world size: rank r keeps only slice r of each (the shard), as ZeRO does (flat_buckets.py).

Each buffer also has ONE full-size tensor for the strategy's whole life, whose storage is
allocated while the unit is gathered and resized to 0 bytes otherwise; the parameters' .data are
views of it. The tensors autograd saved in forward are views of that same storage, so when backward
gathers the unit again they read the re-gathered values (PyTorch FSDP1's technique).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from hvdtrain.strategies.sharding import flat_buckets as fb
from hvdtrain.components.blocks import model_blocks
from hvdtrain.strategies.sharding.storage import release_storage

WrapPolicy = Callable[[nn.Module], bool]
FREE, GATHERING, GATHERED = "free", "gathering", "gathered"  # a unit's full parameters


@dataclass(eq=False)
class ShardedBucket(fb.FlatBucket):
    """A flat buffer of one unit and one parameter group. ``flat_param`` is the full tensor whose
    storage comes and goes; ``shard`` (the optimizer's leaf) and ``shard_grad`` persist."""

    reducing: Optional[torch.Tensor] = None  # the full gradient while its reduce-scatter runs

    def name(self, what: str) -> str:
        return f"fsdp.{what}.{self.index}.{self.padded_numel}"

    @property
    def full_bytes(self) -> int:
        return self.padded_numel * self.params[0].element_size()


@dataclass(eq=False)
class FSDPUnit:
    path: str  # the module's name in the model; "" for the root
    module: nn.Module
    buckets: List[ShardedBucket]
    state: str = FREE

    @property
    def full_bytes(self) -> int:
        return sum(bucket.full_bytes for bucket in self.buckets)

    @property
    def reduction_started(self) -> bool:
        return all(bucket.started for bucket in self.buckets)


# Which modules are units.

def default_wrap_policy(model: nn.Module) -> WrapPolicy:
    """The model's blocks (hvdtrain.components.blocks); other modules (embeddings, norms, heads) stay
    in the root."""
    blocks = {id(module) for _, module in model_blocks(model)}
    return lambda module: id(module) in blocks


def find_units(model: nn.Module, policy: WrapPolicy) -> List[Tuple[str, nn.Module]]:
    """(path, module) of every module ``policy`` accepts, top-down: a unit's submodules are part of
    it, never units of their own; the model itself is the root."""
    found: List[Tuple[str, nn.Module]] = []
    seen = set()

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            if id(child) in seen:
                continue
            seen.add(id(child))
            path = f"{prefix}{name}"
            if policy(child):
                found.append((path, child))
            else:
                visit(child, path + ".")

    visit(model, "")
    return found


def parameter_owners(model: nn.Module, unit_paths: Sequence[str]) -> Dict[int, Optional[str]]:
    """id(parameter) -> the path of the unit that holds it, or None for the root: a parameter
    registered in modules of two units, or of a unit and the root (a tied weight), goes to the
    root, since it must be there whenever any of them computes."""
    owners: Dict[int, set] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        unit = next((u for u in unit_paths if path == u or path.startswith(u + ".")), None)
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), set()).add(unit)
    return {key: next(iter(units)) if len(units) == 1 else None for key, units in owners.items()}


# Packing a unit into sharded buckets.

def build_units(model: nn.Module, optimizer: torch.optim.Optimizer, policy: WrapPolicy, rank: int,
                world_size: int, keep_initial: bool, with_values: bool = True, whole: Collection[int] = (),
                ) -> Tuple[FSDPUnit, List[FSDPUnit], List[torch.Tensor]]:
    """(root, the units with parameters in registration order, and when kept, the full buffers of the
    parameters' values as given, bucket by bucket). Every trainable optimizer parameter goes to one
    bucket; afterwards it is a view of a freed full buffer.

    Args:
        model: the model.
        optimizer: its optimizer, whose trainable parameters are sharded.
        policy: picks the units.
        rank: this rank among the data-parallel ranks.
        world_size: data-parallel ranks.
        keep_initial: also return the full buffers of the parameters' values as given.
        with_values: False: the shards start at zero (the parameters hold no values: a re-cut for a new world, filled
            from a checkpoint next).
        whole: ids of optimizer parameters left out of the buckets, held whole by this rank (a subclass
            reduces and steps them: expert parallelism's shares).
    """
    found = find_units(model, policy)
    owners = parameter_owners(model, [path for path, _ in found])
    registration = {id(p): i for i, p in enumerate(model.parameters())}
    members: Dict[Optional[str], List[Tuple[int, int, nn.Parameter]]] = {}
    for group, indices in enumerate(fb.indices_by_group(optimizer)):
        for index, param in zip(indices, optimizer.param_groups[group]["params"]):
            if param.requires_grad and id(param) not in whole:
                members.setdefault(owners.get(id(param)), []).append((group, index, param))
    units, initial, count = [], [], 0
    for path, module in [("", model)] + found:
        indexed = sorted(members.get(path or None, []), key=lambda m: registration.get(id(m[2]), -1))
        buckets = []
        for group, kind_members in _by_group_and_kind(indexed):
            bucket = _bucket(count, group, kind_members, rank, world_size)
            full = (pack(bucket, [p.detach() for p in bucket.params]) if with_values else
                    torch.zeros(bucket.padded_numel, dtype=bucket.dtype, device=bucket.device))
            _shard(bucket, full)
            if keep_initial:
                initial.append(full)
            buckets.append(bucket)
            count += 1
        units.append(FSDPUnit(path, module, buckets))
    return units[0], [unit for unit in units[1:] if unit.buckets], initial


def _by_group_and_kind(indexed: Sequence[Tuple[int, int, nn.Parameter]]):
    """One run of (index, parameter) per parameter group, dtype and device: what one flat buffer
    cannot mix."""
    runs: Dict[Tuple, List[Tuple[int, nn.Parameter]]] = {}
    for group, index, param in indexed:
        runs.setdefault((group, param.dtype, param.device), []).append((index, param))
    return [(key[0], run) for key, run in sorted(runs.items(), key=lambda item: item[0][0])]


def _bucket(index: int, group: int, members: List[Tuple[int, nn.Parameter]], rank: int,
            world_size: int) -> ShardedBucket:
    offsets, numel = [], 0
    for _, param in members:
        offsets.append(numel)
        numel += param.numel()
    return ShardedBucket(index=index, group=group, param_indices=[i for i, _ in members],
                         params=[p for _, p in members], offsets=offsets,
                         padded_numel=-(-numel // world_size) * world_size, rank=rank, world_size=world_size)


def pack(bucket: ShardedBucket, values: Sequence[torch.Tensor]) -> torch.Tensor:
    """A new full flat buffer holding ``values`` (shaped like the bucket's parameters), zero padding."""
    flat = torch.zeros(bucket.padded_numel, dtype=bucket.dtype, device=bucket.device)
    with torch.no_grad():
        for view, value in zip(bucket.views(flat), values):
            view.copy_(value)
    return flat


def _shard(bucket: ShardedBucket, full: torch.Tensor) -> None:
    """Keep the own slice as a leaf of its own; the parameters become views of a full buffer that
    holds no memory until the unit is gathered."""
    bucket.shard = nn.Parameter(bucket.own_slice(full).clone())
    bucket.shard_grad = torch.zeros_like(bucket.shard)
    bucket.shard.grad = bucket.shard_grad
    bucket.flat_param = torch.empty_like(full)
    for param, view in zip(bucket.params, bucket.views(bucket.flat_param)):
        param.data = view
    release_storage(bucket.flat_param)


def load_shards(model: nn.Module, buckets: Sequence[ShardedBucket], full: Dict[str, torch.Tensor]) -> None:
    """Each bucket's shard cut from a full model state_dict (local, one full buffer at a time); the
    keys must be the model's, even those of buffers and untrained parameters, which it leaves alone."""
    own = model.state_dict(keep_vars=True)
    missing, unexpected = sorted(own.keys() - full.keys()), sorted(full.keys() - own.keys())
    if missing or unexpected:
        raise RuntimeError(f"the model state does not fit this model: missing keys {missing}, "
                           f"unexpected keys {unexpected}")
    names: Dict[int, str] = {}  # a tied parameter has several names: any one holds its value
    for name, tensor in own.items():
        names.setdefault(id(tensor), name)
    for bucket in buckets:
        values = [_checked_value(full, names[id(p)], p) for p in bucket.params]
        with torch.no_grad():
            bucket.shard.copy_(bucket.own_slice(pack(bucket, values)))


def _checked_value(full: Dict[str, torch.Tensor], name: str, param: torch.Tensor) -> torch.Tensor:
    value = full[name]
    if tuple(value.shape) != tuple(param.shape):
        raise RuntimeError(f"size mismatch for {name}: the model state has {tuple(value.shape)}, "
                           f"this model {tuple(param.shape)}")
    return value
