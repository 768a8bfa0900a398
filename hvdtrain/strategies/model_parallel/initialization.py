"""Model parallelism's deferred initialization: each rank keeps only its tensor slices and its stage.

The model built on the meta device is split first, while its tensors hold no memory: a split
layer gets a placeholder of its slice's shape that remembers its whole (hvdtrain.parallel.tensor.layers),
and the pipeline decides which layers this rank's stage holds. Then every rank runs every
initialization step (hvdtrain.strategies.deferred_init), so the random numbers come in the same
order as for the model built whole. Every operation the steps run is looked at first (a dispatch
mode): a whole tensor it touches comes into memory (this rank's slice of it restored, the rest
unset); a whole tensor no longer touched goes: its slice into the split layer's parameter when this
rank holds that layer, otherwise nowhere. A whole tensor this rank holds whole (a norm, a
replicated bias, any layer of its stage that is not split) stays.

So a rank holds its own part of the model and, besides it, the whole tensors the current operation
touches (one module's, for every model seen so far): never the whole model. An initialization that
reads across a tensor (scaling by its own norm) reads unset values and is refused by name.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Sequence, Set

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from hvdtrain.distributed import collectives
from hvdtrain.parallel.tensor.plan import Replacement
from hvdtrain.strategies.deferred_init import DeferredInit, is_unset, mark_unset, nbytes, touched
from hvdtrain.strategies.sharding.storage import allocate_storage, is_allocated, release_storage


class _Whole:
    """A whole tensor of the model as built, and what this rank keeps of it."""

    def __init__(self, name: str, tensor: torch.Tensor) -> None:
        self.name, self.tensor = name, tensor
        self.slices: List[nn.Parameter] = []  # split parameters of held layers cut from it
        self.held_whole = False  # this rank's stage holds it as it is

    @property
    def kept(self) -> bool:
        return self.held_whole or bool(self.slices)

    def bring_in(self) -> None:
        allocate_storage(self.tensor)
        mark_unset(self.tensor)
        for local in self.slices:  # what was initialized of it before, back in its place
            if is_allocated(local):
                local.tensor_shard.place(self.tensor, local.detach())

    def put_away(self) -> None:
        for local in self.slices:
            if not is_allocated(local):
                allocate_storage(local)
            local.detach().copy_(local.tensor_shard.take(self.tensor))
        release_storage(self.tensor)


@torch.no_grad()
def initialize_by_slice(deferred: DeferredInit, model: nn.Module, held: Set[int],
                        replacements: Sequence[Replacement] = ()) -> None:
    """Give the model the values of the model built whole, each rank only its part (collective: the
    verdict on tensors nothing initialized is every rank's). While the steps run, the model has its
    layers as built, so that a step that walks the model (a reset_parameters from above) meets the
    whole tensors.

    Args:
        deferred: the model's deferred initialization: its placeholders and the steps that give values.
        model: the model, split, its stage chosen.
        held: ids of the parameters and buffers this rank's stage holds.
        replacements: the layers tensor parallelism replaced: (parent, attribute, the layer as built, its split).
    """
    deferred.granularity = "by tensor slice and pipeline stage"
    wholes: Dict[int, _Whole] = {id(t): _Whole(name, t) for name, t in deferred.placeholders.items()}
    split: List[nn.Parameter] = []
    for parameter in _distinct(model.parameters()):
        whole = getattr(parameter, "deferred_whole", None)
        if whole is not None:
            if id(parameter) in held:
                wholes[id(whole)].slices.append(parameter)
            split.append(parameter)
        elif id(parameter) in wholes and id(parameter) in held:
            wholes[id(parameter)].held_whole = True
    for buffer in model.buffers():  # every rank keeps every buffer, as without a meta device (a
        if id(buffer) in wholes:       # pipeline stage recomputes its rotary embeddings from the model's)
            wholes[id(buffer)].held_whole = True
    on_touch = _WholesOnTouch(wholes.values(), deferred.tie_bytes)
    for parent, attribute, built, _ in replacements:
        setattr(parent, attribute, built)
    try:
        with on_touch:
            deferred.run()
    finally:
        for parent, attribute, _, split_layer in replacements:
            setattr(parent, attribute, split_layer)
        for entry in on_touch.present:
            if not entry.held_whole:
                entry.put_away()
    deferred.peak_bytes = on_touch.peak_bytes
    kept_whole = [entry for entry in wholes.values() if entry.held_whole]
    for entry in kept_whole:  # held, and no operation touched it: nothing initialized it
        if not is_allocated(entry.tensor):
            allocate_storage(entry.tensor)
            mark_unset(entry.tensor)
    problems = [entry.name for entry in kept_whole if is_unset(entry.tensor)]
    problems += [entry.name for entry in wholes.values() for local in entry.slices
                 if not is_allocated(local) or is_unset(local)]
    for parameter in split:
        del parameter.deferred_whole  # the whole tensors go with the model as built
    everywhere = sorted({name for names in collectives.allgather_object(problems, name="model_parallel.deferred_init")
                         for name in names})
    if everywhere:
        raise ValueError(deferred.unset_message(everywhere))


def _distinct(tensors: Iterable[torch.Tensor]) -> List[torch.Tensor]:
    seen, out = set(), []
    for tensor in tensors:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            out.append(tensor)
    return out


class _WholesOnTouch(TorchDispatchMode):
    """Before each operation: the whole tensors it touches in memory; the others this rank does not
    hold whole go (their slices kept where this rank holds them)."""

    def __init__(self, wholes: Iterable[_Whole], scratch_bytes: int) -> None:
        super().__init__()
        self.by_storage = {entry.tensor.untyped_storage()._cdata: entry for entry in wholes}
        self.present: List[_Whole] = []
        self.kept_bytes = sum(nbytes(local) for entry in self.by_storage.values() for local in entry.slices)
        self.scratch_bytes = scratch_bytes
        self.peak_bytes = self.kept_bytes + scratch_bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        needed = touched(args, kwargs, self.by_storage)
        if any(entry not in self.present for entry in needed):
            for entry in [entry for entry in self.present if entry not in needed and not entry.held_whole]:
                entry.put_away()
                self.present.remove(entry)
            for entry in needed:
                if entry not in self.present:
                    entry.bring_in()
                    self.present.append(entry)
            whole_bytes = sum(nbytes(entry.tensor) for entry in self.present)
            self.peak_bytes = max(self.peak_bytes, self.kept_bytes + self.scratch_bytes + whole_bytes)
        return func(*args, **(kwargs or {}))
