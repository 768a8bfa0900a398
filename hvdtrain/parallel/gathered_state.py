"""The whole model's and optimizer's state from a model split over a mesh, and back: what one process
would hold, under the full model's names and parameter order, so that a checkpoint written under
any layout resumes under any other. Gathering: every rank allocates each tensor whole, in zeros;
exactly one rank writes each element; one all-reduce sum gives every rank the exact values. It holds
the whole state on every rank while it runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch

import horovod.torch as hvd


@dataclass
class Placement:
    """One tensor of the full state, seen from this rank."""

    name: str
    shape: torch.Size  # the full tensor's
    dtype: torch.dtype
    local: Optional[torch.Tensor]  # this rank's copy or slice; None when its stage does not hold it
    shard: Any = None  # a TensorShard when ``local`` is a slice of the full tensor (take/place)
    writes: bool = False  # this rank writes its part into the gathered tensor

    def full_from_local(self, out: torch.Tensor) -> None:
        if self.shard is not None:
            self.shard.place(out, self.local)
        else:
            out.copy_(self.local.reshape(out.shape))

    def local_from_full(self, full: torch.Tensor) -> torch.Tensor:
        return self.shard.take(full) if self.shard is not None else full


def gather(placements: Sequence[Placement], device: torch.device, name: str) -> List[torch.Tensor]:
    """The full tensors, on every rank (a collective over the world: every rank passes the same
    names, shapes and dtypes in the same order)."""
    full = [torch.zeros(p.shape, dtype=p.dtype, device=device) for p in placements]
    for placement, out in zip(placements, full):
        if placement.writes:
            placement.full_from_local(out)
    if not full:
        return full
    # Horovod's sum has no boolean form: booleans travel as bytes.
    wire = [t.to(torch.uint8) if t.dtype == torch.bool else t for t in full]
    reduced = hvd.grouped_allreduce(wire, op=hvd.Sum, name=name)
    return [r.to(torch.bool) if t.dtype == torch.bool else r for r, t in zip(reduced, full)]


def scatter_into(placements: Sequence[Placement], full: Dict[str, torch.Tensor]) -> None:
    """Copy each held tensor's part out of the full state (every rank holds it all; no collective)."""
    with torch.no_grad():
        for placement in placements:
            if placement.local is not None:
                source = full[placement.name]
                if tuple(source.shape) != tuple(placement.shape):
                    raise ValueError(f"the checkpoint's {placement.name} has shape {tuple(source.shape)}, "
                                     f"this model's {tuple(placement.shape)}: it is another model")
                placement.local.copy_(placement.local_from_full(source.to(placement.local.device)))
