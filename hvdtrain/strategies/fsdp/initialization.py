"""fsdp's deferred initialization: the model's initialization run with one unit in memory at a time.

Every rank runs every step (hvdtrain.strategies.deferred_init), so the random numbers come in the
same order as for the model built whole. Every operation the steps run is looked at first
(a dispatch mode): one that touches a unit's parameters gets that unit's flat buffers in memory,
its own slices filled from its shards and the rest unset; a unit no longer touched goes back into
its shards and its buffers are freed. So it does not matter which module's step writes a unit's
parameters (its own, or a module above it, as nn.Transformer's and hvdtrain's textlm's do): a
rank holds the root, the buffers and the parameters outside the optimizer whole (as always), and
besides them only the units the current operation touches (one, for every model seen so far).

An operation that reads across a parameter (scaling it by its own norm, say) would read other
ranks' unset slices: its result is unset too, and is refused by name like any tensor nothing
initialized.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hvdtrain.distributed import collectives
from hvdtrain.strategies.deferred_init import DeferredInit, is_unset, mark_unset, nbytes, touched
from hvdtrain.strategies.fsdp import units as fu
from hvdtrain.strategies.sharding import storage


@torch.no_grad()
def initialize_by_unit(deferred: DeferredInit, root: fu.FSDPUnit, units: Sequence[fu.FSDPUnit]) -> None:
    """Each rank's shards, buffers and unsharded parameters hold the values of the model built
    whole (collective: the verdict on tensors nothing initialized is every rank's)."""
    deferred.granularity = "by fsdp unit"
    in_buckets = {id(p) for unit in [root, *units] for bucket in unit.buckets for p in bucket.params}
    whole = {name: t for name, t in deferred.placeholders.items() if id(t) not in in_buckets}
    for tensor in whole.values():
        storage.allocate_storage(tensor)
        mark_unset(tensor)
    for unit in [root, *units]:
        for bucket in unit.buckets:
            _mark_shard_unset(bucket)
    _bring_in(root)
    on_touch = _UnitsOnTouch(units, held=sum(nbytes(t) for t in whole.values()) + deferred.tie_bytes + root.full_bytes)
    with on_touch:
        deferred.run()
    for unit in on_touch.present + [root]:
        _put_away(unit)
    deferred.peak_bytes = on_touch.peak_bytes
    problems = [name for name, tensor in whole.items() if is_unset(tensor)] + _unset_in_shards(deferred.model, [root, *units])
    everywhere = sorted({name for names in collectives.allgather_object(problems, name="fsdp.deferred_init")
                         for name in names})
    if everywhere:
        raise ValueError(deferred.unset_message(everywhere))


def _mark_shard_unset(bucket: fu.ShardedBucket) -> None:
    """The shard as the own slice of a buffer whose values are unset and whose padding is zero."""
    start, _ = bucket.own_range
    mark_unset(bucket.shard)
    bucket.shard[max(0, bucket.real_numel - start):].zero_()


def _bring_in(unit: fu.FSDPUnit) -> None:
    """The unit's full buffers in memory: its own slices from the shards, the rest unset."""
    for bucket in unit.buckets:
        storage.allocate_storage(bucket.flat_param)
        mark_unset(bucket.flat_param)
        bucket.flat_param[bucket.real_numel:].zero_()
        bucket.own_slice(bucket.flat_param).copy_(bucket.shard)


def _put_away(unit: fu.FSDPUnit) -> None:
    for bucket in unit.buckets:
        bucket.shard.copy_(bucket.own_slice(bucket.flat_param))
        storage.release_storage(bucket.flat_param)


def _unset_in_shards(model: torch.nn.Module, units: Sequence[fu.FSDPUnit]) -> List[str]:
    names: Dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name)
    unset = []
    for unit in units:
        for bucket in unit.buckets:
            start, stop = bucket.own_range
            for param, offset in zip(bucket.params, bucket.offsets):
                low, high = max(start, offset), min(stop, offset + param.numel())
                if low < high and is_unset(bucket.shard[low - start:high - start]):
                    unset.append(names[id(param)])
    return unset


class _UnitsOnTouch(TorchDispatchMode):
    """Before each operation: the units whose parameters it touches in memory, the others put
    away (the parameters are views of their unit's flat buffers, so one storage names the unit)."""

    def __init__(self, units: Sequence[fu.FSDPUnit], held: int) -> None:
        super().__init__()
        self.unit_of: Dict[int, fu.FSDPUnit] = {bucket.flat_param.untyped_storage()._cdata: unit
                                                for unit in units for bucket in unit.buckets}
        self.present: List[fu.FSDPUnit] = []
        self.held, self.peak_bytes = held, held

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        needed = touched(args, kwargs, self.unit_of)
        if any(unit not in self.present for unit in needed):
            for unit in [unit for unit in self.present if unit not in needed]:
                _put_away(unit)
                self.present.remove(unit)
            for unit in needed:
                if unit not in self.present:
                    _bring_in(unit)
                    self.present.append(unit)
            self.peak_bytes = max(self.peak_bytes, self.held + sum(unit.full_bytes for unit in self.present))
        return func(*args, **(kwargs or {}))
