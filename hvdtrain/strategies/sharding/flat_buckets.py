"""Flat buckets for ZeRO: parameters packed back to back into padded flat buffers.

A bucket holds parameters of one optimizer group, one dtype and one device, at most
``bucket_bytes`` of them (a larger parameter gets a bucket of its own). Its buffer is padded to a
multiple of the world size, so that rank r owns the slice [r * shard, (r + 1) * shard) of every
bucket: the unit a reduce-scatter hands out and an all-gather collects.

Also here: moving per-parameter optimizer state (torch's format) to a bucket's own slice and back.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Collection, Dict, List, Optional, Sequence, Tuple

import torch

IndexedParameter = Tuple[int, torch.nn.Parameter]  # (index in the user's optimizer, parameter)


@dataclass(eq=False)
class FlatBucket:
    index: int
    group: int  # the parameter group of the user's optimizer
    param_indices: List[int]  # the user's optimizer's numbering, 0..P-1 across groups
    params: List[torch.nn.Parameter]
    offsets: List[int]  # where each parameter starts in the flat buffer
    padded_numel: int
    rank: int
    world_size: int
    grad_name: str = field(init=False)  # the collectives' names: the same on every rank
    param_name: str = field(init=False)
    flat_param: torch.Tensor = field(init=False)
    shard: torch.nn.Parameter = field(init=False)  # the own slice, as the shard optimizer's leaf
    # Stage 1: the persistent full gradient buffer. Stage 2 and fsdp: allocated when the bucket's first
    # gradient of a micro-batch arrives, released once its reduce-scatter has finished.
    flat_grad: Optional[torch.Tensor] = None
    written: List[bool] = field(default_factory=list)  # stage 2, fsdp: which parameters' gradients flat_grad holds
    shard_grad: Optional[torch.Tensor] = None  # the averaged gradient of the own slice
    fp16_wire: bool = False  # its gradients travel as fp16 (fp16_allreduce)
    arrived: int = 0  # parameters whose gradient this micro-batch's backward has produced
    started: bool = False  # this micro-batch's reduce-scatter has been started

    def __post_init__(self) -> None:
        self.grad_name, self.param_name = self.name("grad"), self.name("param")

    @property
    def real_numel(self) -> int:
        """The parameters' elements, without the padding after them."""
        return self.offsets[-1] + self.params[-1].numel()

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    @property
    def own_range(self) -> Tuple[int, int]:
        start = self.rank * self.shard_numel
        return start, start + self.shard_numel

    @property
    def dtype(self) -> torch.dtype:
        return self.params[0].dtype

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    def name(self, what: str) -> str:
        """A collective's name: the same on every rank, unique per bucket and layout."""
        return f"zero.{what}.{self.index}.{self.padded_numel}"

    def own_slice(self, flat: torch.Tensor) -> torch.Tensor:
        return self.slice_of(flat, self.rank)

    def slice_of(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s slice of a full-size flat buffer (a view)."""
        return flat[rank * self.shard_numel:(rank + 1) * self.shard_numel]

    def views(self, flat: torch.Tensor) -> List[torch.Tensor]:
        """``flat`` cut into tensors shaped like the bucket's parameters (views, no copy)."""
        return [flat[offset:offset + p.numel()].view(p.shape)
                for p, offset in zip(self.params, self.offsets)]


def bucket_parameters(model: torch.nn.Module, optimizer: torch.optim.Optimizer, bucket_bytes: int,
                      rank: int, world_size: int, whole: Collection[int] = ()) -> List[FlatBucket]:
    """The optimizer's trainable parameters packed into buckets, each parameter now a view of its
    bucket's buffer. Group by group, each group in reverse registration order: the order in which
    backward produces the gradients, so that the first buckets fill up first.

    Args:
        model: the model.
        optimizer: its optimizer, whose trainable parameters are packed.
        bucket_bytes: the largest bucket, in bytes.
        rank: this rank among the data-parallel ranks: which slice of each bucket it owns.
        world_size: data-parallel ranks.
        whole: ids of optimizer parameters left out of the buckets, held whole by this rank (a
            strategy that reduces and steps them itself names them: expert shares).
    """
    registration = {id(p): i for i, p in enumerate(model.parameters())}
    buckets: List[FlatBucket] = []
    for group, indices in enumerate(indices_by_group(optimizer)):
        indexed = [(i, p) for i, p in zip(indices, optimizer.param_groups[group]["params"])
                   if p.requires_grad and id(p) not in whole]
        backward_order = sorted(indexed, key=lambda ip: registration.get(id(ip[1]), -1), reverse=True)
        for members in _split(backward_order, bucket_bytes):
            buckets.append(_bucket(len(buckets), group, members, rank, world_size))
    with torch.no_grad():
        for bucket in buckets:
            _flatten(bucket)
    return buckets


def indices_by_group(optimizer: torch.optim.Optimizer) -> List[List[int]]:
    """torch's numbering of an optimizer's parameters (0..P-1 across groups), group by group."""
    indices, start = [], 0
    for group in optimizer.param_groups:
        indices.append(list(range(start, start + len(group["params"]))))
        start += len(group["params"])
    return indices


def _split(indexed: Sequence[IndexedParameter], bucket_bytes: int) -> List[List[IndexedParameter]]:
    runs: List[List[IndexedParameter]] = []
    size = 0
    for index, param in indexed:
        nbytes = param.numel() * param.element_size()
        if not runs or size + nbytes > bucket_bytes or _kind(runs[-1][0][1]) != _kind(param):
            runs.append([])
            size = 0
        runs[-1].append((index, param))
        size += nbytes
    return runs


def _kind(param: torch.Tensor) -> Tuple[torch.dtype, torch.device]:
    """What one flat buffer cannot mix."""
    return param.dtype, param.device


def _bucket(index: int, group: int, members: List[IndexedParameter], rank: int,
            world_size: int) -> FlatBucket:
    offsets, numel = [], 0
    for _, param in members:
        offsets.append(numel)
        numel += param.numel()
    padded = -(-numel // world_size) * world_size
    return FlatBucket(index=index, group=group, param_indices=[i for i, _ in members],
                      params=[p for _, p in members], offsets=offsets, padded_numel=padded,
                      rank=rank, world_size=world_size)


def _flatten(bucket: FlatBucket) -> None:
    """Move the parameters into one flat buffer (zero padding) and make each a view of it; the
    shard is a leaf over the own slice, so stepping it updates the buffer, and the model, in place."""
    bucket.flat_param = torch.zeros(bucket.padded_numel, dtype=bucket.dtype, device=bucket.device)
    for param, view in zip(bucket.params, bucket.views(bucket.flat_param)):
        view.copy_(param.detach())
        param.data = view
    bucket.shard = torch.nn.Parameter(bucket.own_slice(bucket.flat_param))


def attach_gradient_views(bucket: FlatBucket, flat_grad: torch.Tensor) -> None:
    """Make every parameter's .grad a view of ``flat_grad``: autograd then accumulates in place."""
    bucket.flat_grad = flat_grad
    for param, view in zip(bucket.params, bucket.views(flat_grad)):
        param.grad = view


def release_gradients(bucket: FlatBucket) -> None:
    bucket.flat_grad = None
    for param in bucket.params:
        param.grad = None


# Stage 2 and fsdp: a micro-batch's full gradient buffer, filled by copying each gradient in as it
# arrives. Autograd hands each parameter a gradient of its own (a tensor backward just made, taken
# over without a copy); one copy puts it in place. Views attached beforehand would need the buffer
# zeroed first and every gradient added to it: three passes over the buffer's memory, not one.

def take_gradient(bucket: FlatBucket, index: int) -> None:
    """Move parameter ``index``'s .grad into its place in the bucket's buffer (made at the first
    one: its padding zeroed, the rest written by the gradients) and set .grad to None; a second
    gradient in one micro-batch is added."""
    if bucket.flat_grad is None:
        bucket.flat_grad = torch.empty(bucket.padded_numel, dtype=bucket.dtype, device=bucket.device)
        bucket.flat_grad[bucket.real_numel:].zero_()
        bucket.written = [False] * len(bucket.params)
    param, offset = bucket.params[index], bucket.offsets[index]
    place = bucket.flat_grad[offset:offset + param.numel()].view_as(param)
    with torch.no_grad():
        place.add_(param.grad) if bucket.written[index] else place.copy_(param.grad)
    bucket.written[index] = True
    param.grad = None


def complete_gradients(bucket: FlatBucket) -> torch.Tensor:
    """The buffer to reduce: zeros where no gradient arrived (all of it when none did)."""
    if bucket.flat_grad is None:
        bucket.flat_grad = torch.zeros(bucket.padded_numel, dtype=bucket.dtype, device=bucket.device)
        bucket.written = [True] * len(bucket.params)
    for index, param in enumerate(bucket.params):
        if not bucket.written[index]:
            bucket.flat_grad[bucket.offsets[index]:bucket.offsets[index] + param.numel()].zero_()
    return bucket.flat_grad


# Stage 2 and fsdp: the shard gradient over a step's micro-batches. zero_grad leaves the shard's
# .grad None, torch's convention, with no pass over the memory; the step's first reduce-scatter
# output then becomes the shard gradient as it is (no copy, no add), the later ones are added to it.
# A .grad set to None by the user's optimizer.zero_grad() is honoured the same way.

def accumulate_shard_gradient(bucket: FlatBucket, reduced: torch.Tensor) -> None:
    """Add this rank's averaged slice ``reduced`` (a reduce-scatter's output, owned by no one else)
    to the shard gradient, or make it the shard gradient when the shard's .grad was cleared."""
    if bucket.shard.grad is not None:
        bucket.shard_grad.add_(reduced)
    elif reduced.dtype == bucket.shard_grad.dtype:
        bucket.shard_grad = reduced
    else:  # fp16 on the wire
        bucket.shard_grad.copy_(reduced)
    bucket.shard.grad = bucket.shard_grad


def settle_shard_gradient(bucket: FlatBucket) -> None:
    """Zeros for a shard gradient that no reduction reached since it was cleared (a step with no
    backward, say): what the optimizer, clipping and the checks read is then never stale."""
    if bucket.shard.grad is None:
        bucket.shard_grad.zero_()
        bucket.shard.grad = bucket.shard_grad


# Optimizer state: torch keeps it per parameter; the shard optimizer per bucket slice.

def is_elementwise(value: Any) -> bool:
    """Per-element state (Adam's exp_avg) as opposed to a scalar (Adam's step)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0


def shard_state_dict(buckets: Sequence[FlatBucket], group_indices: List[List[int]],
                     full: Dict[str, Any]) -> Dict[str, Any]:
    """The shard optimizer's state_dict holding this rank's slices of a full one (torch's format,
    as the user's optimizer writes it): what to give the shard optimizer's load_state_dict."""
    saved_groups = full["param_groups"]
    if [len(g["params"]) for g in saved_groups] != [len(i) for i in group_indices]:
        raise ValueError("the optimizer state's parameter groups do not match this optimizer's: "
                         f"{[len(g['params']) for g in saved_groups]} parameters per group "
                         f"against {[len(i) for i in group_indices]}")
    # torch pairs saved and live parameters by position, group by group.
    saved_index = {mine: theirs for saved, indices in zip(saved_groups, group_indices)
                   for mine, theirs in zip(indices, saved["params"])}
    state = {}
    for bucket in buckets:
        shard = _shard_state(bucket, [full["state"].get(saved_index[i]) for i in bucket.param_indices])
        if shard:
            state[bucket.index] = shard
    groups = [{**_hyperparameters(saved), "params": [b.index for b in buckets if b.group == g]}
              for g, saved in enumerate(saved_groups)]
    return {"state": state, "param_groups": groups}


def full_state_dict(buckets: Sequence[FlatBucket], group_indices: List[List[int]],
                    param_groups: List[Dict[str, Any]], shard_states: Sequence[Dict[str, Any]],
                    gathered: Sequence[Dict[str, torch.Tensor]]) -> Dict[str, Any]:
    """The user's optimizer's state_dict from the shards' states and their gathered full buffers.

    Args:
        buckets: the flat buckets.
        group_indices: per parameter group, torch's numbering of its parameters (indices_by_group).
        param_groups: the user's optimizer's parameter groups.
        shard_states: every rank's shard optimizer state.
        gathered: per bucket, its state tensors' full buffers gathered from every rank.
    """
    state: Dict[int, Dict[str, Any]] = {}
    for bucket, shard, full in zip(buckets, shard_states, gathered):
        if shard:
            state.update(zip(bucket.param_indices, _parameter_states(bucket, shard, full)))
    groups = [{**_hyperparameters(group), "params": list(indices)}
              for group, indices in zip(param_groups, group_indices)]
    return {"state": dict(sorted(state.items())), "param_groups": groups}


def _hyperparameters(group: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def _shard_state(bucket: FlatBucket, states: Sequence[Optional[Dict[str, Any]]]) -> Dict[str, Any]:
    """The shard's state from its parameters' states: this rank's slice of the per-element
    entries (zeros for padding and for parameters without state), the scalars as they are."""
    present = [s for s in states if s]
    shard: Dict[str, Any] = {}
    for key in dict.fromkeys(k for s in present for k in s):
        values = [s.get(key) if s else None for s in states]
        first = next((v for v in values if v is not None), None)
        shard[key] = _own_slice_of(bucket, key, values) if is_elementwise(first) \
            else _common_scalar(bucket, key, values)
    return shard


def _own_slice_of(bucket: FlatBucket, key: str, values: Sequence[Optional[torch.Tensor]]) -> torch.Tensor:
    like = next(v for v in values if v is not None)
    own = torch.zeros(bucket.shard_numel, dtype=like.dtype, device=bucket.device)
    lo, hi = bucket.own_range
    for value, param, offset, index in zip(values, bucket.params, bucket.offsets, bucket.param_indices):
        if value is None:
            continue
        if value.numel() != param.numel():
            raise ValueError(f"optimizer state {key!r} of parameter {index} has {value.numel()} "
                             f"elements, the parameter {param.numel()}: not this model's state")
        start, stop = max(lo, offset), min(hi, offset + param.numel())
        if start < stop:
            own[start - lo:stop - lo].copy_(value.reshape(-1)[start - offset:stop - offset])
    return own


def _common_scalar(bucket: FlatBucket, key: str, values: Sequence[Any]) -> Any:
    """One scalar serves the whole shard, so the bucket's parameters must agree on it."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    first = present[0]
    for other in present[1:]:
        same = torch.equal(first, other) if isinstance(first, torch.Tensor) else first == other
        if not same:
            raise ValueError(
                f"optimizer state {key!r} differs between parameters {bucket.param_indices} "
                f"({first} vs {other}), which ZeRO steps as one flat shard: such state (parameters "
                "that skipped steps) cannot be sharded; resume it with --train.strategy=ddp")
    return first.clone() if isinstance(first, torch.Tensor) else first


def _parameter_states(bucket: FlatBucket, shard: Dict[str, Any],
                     gathered: Dict[str, torch.Tensor]) -> List[Dict[str, Any]]:
    """Per-parameter states in torch's format: the per-element entries cut from the gathered full
    buffers (shaped like the parameters), the scalars copied for each parameter."""
    cut = {key: bucket.views(flat) for key, flat in gathered.items()}
    return [{key: cut[key][i] if key in cut else (value.clone() if isinstance(value, torch.Tensor) else value)
             for key, value in shard.items()}
            for i in range(len(bucket.params))]
