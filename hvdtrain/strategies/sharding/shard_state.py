"""A sharded strategy's own part of the state, for a sharded checkpoint, and the full state rebuilt
from every rank's part without the model's class.

zero1, zero2 and fsdp keep the optimizer's parameters in flat buckets (flat_buckets.py); rank r
owns slice r of every bucket. A rank's part (``shard_state_dict``) holds, with no communication:

  params     its slice of every bucket's flat parameters
  optimizer  its shard optimizer's state, by bucket index (per-element entries: its slices;
             scalars such as Adam's step), and the parameter groups' hyperparameters
  unmanaged  buffers, and parameters the optimizer does not train (whole on every rank)
  layout     what consolidation needs instead of the model: per bucket its parameters' names (as
             in model.state_dict()), shapes, offsets, padded size, dtype, parameter group and the
             user's optimizer's parameter indices; the model's keys in order; the groups' indices

``assemble_full_state`` assembles every rank's parts into the full {"model", "optimizer"} state in the
plain formats, as ``Strategy.state_dict()`` gathers it (flat_buckets.full_state_dict does the
optimizer's part for both). ``part_from`` fills a rank's part from a checkpoint of any layout,
``part_from_weights`` from pretrained weights, both read through a tensor source
(hvdtrain.checkpoint.sources.contract). Imports neither Horovod nor the strategies: it runs in one process.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch

from hvdtrain.strategies.base import tensor_names
from hvdtrain.strategies.sharding import flat_buckets as fb

SHARD_KEYS = ("rank", "world_size", "params", "optimizer", "unmanaged", "layout")


def layout(model: torch.nn.Module, buckets: Sequence[fb.FlatBucket], group_indices: List[List[int]]) -> Dict[str, Any]:
    """Where every element of the buckets belongs in the model and in the user's optimizer."""
    names = {id(value): aliases for aliases, value in tensor_names(model)}  # a tied parameter has several
    return {
        "model_keys": list(model.state_dict(keep_vars=True)),  # in the state_dict's order (checked on load)
        "group_indices": [list(indices) for indices in group_indices],
        "buckets": [{"index": b.index, "group": b.group, "param_indices": list(b.param_indices),
                     "names": [names.get(id(p), []) for p in b.params],
                     "shapes": [list(p.shape) for p in b.params], "offsets": list(b.offsets),
                     "padded_numel": b.padded_numel, "dtype": str(b.dtype).replace("torch.", "")}
                    for b in buckets],
    }


def compact(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor that owns exactly its elements: torch.save writes a view's whole storage (a ZeRO
    shard is a view of its full bucket), which would put the full bucket in every rank's file."""
    tensor = tensor.detach()
    if tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size() and tensor.is_contiguous():
        return tensor
    return tensor.clone()


def unmanaged_state(model: torch.nn.Module, buckets: Sequence[fb.FlatBucket]) -> Dict[str, torch.Tensor]:
    managed = {id(p) for bucket in buckets for p in bucket.params}
    return {name: tensor for name, tensor in model.state_dict(keep_vars=True).items() if id(tensor) not in managed}


def shard_state_dict(model: torch.nn.Module, buckets: Sequence[fb.FlatBucket], optimizer: torch.optim.Optimizer,
                     group_indices: List[List[int]]) -> Dict[str, Any]:
    """This rank's part (local: no collective); see the module's text.

    Args:
        model: the model.
        buckets: the flat buckets.
        optimizer: the shard optimizer.
        group_indices: per parameter group, torch's numbering of its parameters (indices_by_group).
    """
    states = {}
    for bucket in buckets:
        state = optimizer.state.get(bucket.shard, {})
        if state:
            states[bucket.index] = {key: compact(value) if isinstance(value, torch.Tensor) else value
                                    for key, value in state.items()}
    groups = [{**{k: v for k, v in group.items() if k != "params"},
               "params": [b.index for b in buckets if b.group == g]}
              for g, group in enumerate(optimizer.param_groups)]
    first = buckets[0] if buckets else None
    return {
        "rank": first.rank if first else 0,
        "world_size": first.world_size if first else 1,
        "params": [compact(bucket.shard) for bucket in buckets],
        "optimizer": {"state": states, "param_groups": groups},
        "unmanaged": {name: compact(tensor) for name, tensor in unmanaged_state(model, buckets).items()},
        "layout": layout(model, buckets, group_indices),
    }


def check_shard(model: torch.nn.Module, buckets: Sequence[fb.FlatBucket], group_indices: List[List[int]],
                state: Dict[str, Any]) -> None:
    """ValueError unless ``state`` is this rank's part for this model, optimizer and world (local).

    Args:
        model: the model.
        buckets: the flat buckets.
        group_indices: per parameter group, torch's numbering of its parameters (indices_by_group).
        state: the part to check, from a checkpoint.
    """
    missing = [key for key in SHARD_KEYS if key not in state]
    if missing:
        raise ValueError(f"not a strategy shard: missing {', '.join(missing)}")
    rank, size = (buckets[0].rank, buckets[0].world_size) if buckets else (state["rank"], state["world_size"])
    if (state["rank"], state["world_size"]) != (rank, size):
        raise ValueError(f"it is rank {state['rank']} of {state['world_size']}'s shard, this is rank {rank} of {size}")
    mine = layout(model, buckets, group_indices)
    if state["layout"] != mine:
        raise ValueError(f"it was written for another model, optimizer or bucket layout: {_first_difference(state['layout'], mine)}")
    for bucket, value in zip(buckets, state["params"]):
        if value.shape != bucket.shard.shape or value.dtype != bucket.shard.dtype:
            raise ValueError(f"bucket {bucket.index}'s slice has {tuple(value.shape)} {value.dtype}, this "
                             f"rank's {tuple(bucket.shard.shape)} {bucket.shard.dtype}")


def _first_difference(saved: Dict[str, Any], mine: Dict[str, Any]) -> str:
    if saved["model_keys"] != mine["model_keys"]:
        return f"the model's keys differ ({len(saved['model_keys'])} saved, {len(mine['model_keys'])} here)"
    if saved["group_indices"] != mine["group_indices"]:
        return f"parameter groups {saved['group_indices']} saved, {mine['group_indices']} here"
    if len(saved["buckets"]) != len(mine["buckets"]):
        return f"{len(saved['buckets'])} buckets saved, {len(mine['buckets'])} here"
    for theirs, ours in zip(saved["buckets"], mine["buckets"]):
        if theirs != ours:
            key = next(k for k in ours if theirs.get(k) != ours[k])
            return f"bucket {ours['index']}'s {key} differ ({theirs.get(key)} saved, {ours[key]} here)"
    return "the layouts differ"


def load_shard_state_dict(model: torch.nn.Module, buckets: Sequence[fb.FlatBucket], optimizer: torch.optim.Optimizer,
                          group_indices: List[List[int]], state: Dict[str, Any]) -> None:
    """Put this rank's part back: its slices into the buckets' shards, the unmanaged tensors into the
    model, the shard optimizer's state (local; a ZeRO strategy then all-gathers its parameters).

    Args:
        model: the model.
        buckets: the flat buckets.
        optimizer: the shard optimizer.
        group_indices: per parameter group, torch's numbering of its parameters (indices_by_group).
        state: this rank's part, checked by check_shard.
    """
    check_shard(model, buckets, group_indices, state)
    with torch.no_grad():
        for bucket, value in zip(buckets, state["params"]):
            bucket.shard.copy_(value)
    if state["unmanaged"]:
        model.load_state_dict(state["unmanaged"], strict=False)
    optimizer.load_state_dict(state["optimizer"])


def part_from(source: Any, mine: Mapping[str, Any], rank: int, world_size: int,
              unmanaged: Optional[Mapping[str, torch.Tensor]] = None) -> Dict[str, Any]:
    """A rank's part in its own layout, filled from a checkpoint of any layout: what its strategy's
    shard_state_dict() would hold had it written it. Every tensor of the layout (not only those of
    this rank's slices: every rank finds the same problem) and of ``unmanaged`` is checked for its
    shape and dtype before any element is read (local).

    Args:
        source: the checkpoint, asked as hvdtrain.checkpoint.sources.contract describes.
        mine: the layout of the strategy's part (its shard_layout()).
        rank: the rank whose part is read.
        world_size: how many ranks share the buckets.
        unmanaged: this model's buffers and untrained parameters (its part's "unmanaged"), to check
            the checkpoint's against; None: not checked.
    """
    source.check_flat_layout(mine)
    check_layout_tensors(source, mine)
    if unmanaged is not None:
        for name, value in unmanaged.items():
            source.check_tensor(source.first_held([name]), value.shape, value.dtype)
    params: List[torch.Tensor] = []
    states: Dict[int, Dict[str, Any]] = {}
    for entry in mine["buckets"]:
        size = entry["padded_numel"] // world_size
        low, high = rank * size, (rank + 1) * size
        flat = torch.zeros(size, dtype=getattr(torch, entry["dtype"]))  # padding stays zero, as when written
        state: Dict[str, Any] = {}
        for names, shape, offset in zip(entry["names"], entry["shapes"], entry["offsets"]):
            start, stop = max(low, offset), min(high, offset + math.prod(shape))
            if start >= stop:
                continue
            name = names[0]
            flat[start - low:stop - low] = source.read(name, start - offset, stop - offset)
            for key, value in source.optimizer_state(name).items():
                if fb.is_elementwise(value):
                    state.setdefault(key, torch.zeros(size, dtype=value.dtype))
                    state[key][start - low:stop - low] = source.read(name, start - offset, stop - offset, key)
                else:
                    state.setdefault(key, value.clone() if isinstance(value, torch.Tensor) else value)
        params.append(flat)
        if state:
            states[entry["index"]] = state
    groups = [{**{key: value for key, value in group.items() if key != "params"},
               "params": [entry["index"] for entry in mine["buckets"] if entry["group"] == g]}
              for g, group in enumerate(source.param_groups())]
    return {"rank": rank, "world_size": world_size, "params": params,
            "optimizer": {"state": states, "param_groups": groups},
            "unmanaged": {name: tensor.clone() for name, tensor in source.unmanaged().items()}, "layout": mine}


def check_layout_tensors(source: Any, layout: Mapping[str, Any], cast: bool = False) -> None:
    """CheckpointError unless ``source`` holds every tensor of the flat ``layout`` with the layout's
    shape and dtype (``cast``: another floating-point dtype too, converted as read: pretrained
    weights); checked before any element is read, so a tensor of another size is never read past."""
    for entry in layout["buckets"]:
        for names, shape in zip(entry["names"], entry["shapes"]):
            source.check_tensor(source.first_held(names), shape, entry["dtype"], cast=cast)


def part_from_weights(part: Dict[str, Any], source: Any) -> Dict[str, Any]:
    """This rank's ``part`` (its shard_state_dict(): the optimizer's state and groups kept as they
    are) with its slices and unmanaged tensors read from a ``source`` of weights only (a Hugging
    Face directory), each tensor found under any of its names and checked for its shape and dtype
    (a floating-point tensor of another precision is converted: pretrained bf16 weights into an
    fp32 model) before any is read (local)."""
    check_layout_tensors(source, part["layout"], cast=True)
    for name, value in part["unmanaged"].items():
        source.check_tensor(source.first_held([name]), value.shape, value.dtype, cast=True)
    rank, size = part["rank"], part["world_size"]
    params = []
    for entry in part["layout"]["buckets"]:
        slice_size = entry["padded_numel"] // size
        low, high = rank * slice_size, (rank + 1) * slice_size
        flat = torch.zeros(slice_size, dtype=getattr(torch, entry["dtype"]))  # padding stays zero
        for names, shape, offset in zip(entry["names"], entry["shapes"], entry["offsets"]):
            start, stop = max(low, offset), min(high, offset + math.prod(shape))
            if start < stop:
                name = source.first_held(names)
                flat[start - low:stop - low] = source.read(name, start - offset, stop - offset)
        params.append(flat)
    unmanaged = {}
    for name, value in part["unmanaged"].items():
        held = source.first_held([name])
        unmanaged[name] = source.full_tensor(held).reshape(value.shape).to(value.dtype)
    return {**part, "params": params, "unmanaged": unmanaged}


def assemble_full_state(shards: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """The full {"model", "optimizer"} state from every rank's part, in rank order: the model's
    state_dict and the user's optimizer's state_dict, as the strategy's state_dict() gathers them."""
    if not shards:
        raise ValueError("no shards to consolidate")
    first = shards[0]
    for position, shard in enumerate(shards):
        if shard["rank"] != position or shard["world_size"] != len(shards):
            raise ValueError(f"shard {position} says it is rank {shard['rank']} of {shard['world_size']}, "
                             f"expected rank {position} of {len(shards)}")
        if shard["layout"] != first["layout"]:
            raise ValueError(f"rank {position}'s layout differs from rank 0's: the shards come from different runs")
    shape = first["layout"]
    buckets = [_bucket_from_layout(entry, len(shards)) for entry in shape["buckets"]]
    values: Dict[str, torch.Tensor] = {}
    for position, (bucket, entry) in enumerate(zip(buckets, shape["buckets"])):
        flat = torch.cat([shard["params"][position] for shard in shards])
        for view, names in zip(bucket.views(flat), entry["names"]):
            value = view.clone()
            for name in names:
                values[name] = value
    values.update(first["unmanaged"])  # replicated; rank 0's, as the full format takes them
    missing = [key for key in shape["model_keys"] if key not in values]
    if missing:
        raise ValueError(f"the shards hold no value for {', '.join(missing)}")
    model = {key: values[key] for key in shape["model_keys"]}

    states = [shard["optimizer"]["state"] for shard in shards]
    shard_states = [states[0].get(bucket.index, {}) for bucket in buckets]
    gathered = [{key: torch.cat([state[bucket.index][key] for state in states])
                 for key, value in own.items() if fb.is_elementwise(value)}
                for bucket, own in zip(buckets, shard_states)]
    optimizer = fb.full_state_dict(buckets, shape["group_indices"], first["optimizer"]["param_groups"],
                                   shard_states, gathered)
    return {"model": model, "optimizer": optimizer}


def _bucket_from_layout(entry: Dict[str, Any], world_size: int) -> fb.FlatBucket:
    """A bucket with shape-only parameters (no memory): enough for its views and offsets."""
    dtype = getattr(torch, entry["dtype"])
    params = [torch.nn.Parameter(torch.empty(shape, dtype=dtype, device="meta")) for shape in entry["shapes"]]
    return fb.FlatBucket(index=entry["index"], group=entry["group"], param_indices=list(entry["param_indices"]),
                         params=params, offsets=list(entry["offsets"]), padded_numel=entry["padded_numel"],
                         rank=0, world_size=world_size)
