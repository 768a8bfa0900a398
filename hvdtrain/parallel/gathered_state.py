"""The whole model's and optimizer's state from a model split over a mesh: what one process would
hold, under the full model's names and parameter order, so that a checkpoint written under any
layout resumes under any other. Gathering: every rank allocates each tensor whole, in zeros;
exactly one rank writes each element; one all-reduce sum gives every rank the exact values.
``gather`` holds the whole state on every rank while it runs; ``gather_each`` one tensor at a time.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Sequence, Tuple

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
    full = [_written_part(p, device) for p in placements]
    return _summed(full, name) if full else full


def gather_each(placements: Sequence[Placement], device: torch.device, name: str
                ) -> Iterator[Tuple[Placement, torch.Tensor]]:
    """The full tensors one at a time, on every rank (a collective, as ``gather``; every rank
    iterates to the end): each is valid until the next is asked for, so no rank holds more than
    one whole tensor of the state at once."""
    for placement in placements:
        yield placement, _summed([_written_part(placement, device)], f"{name}.{placement.name}")[0]


def _written_part(placement: Placement, device: torch.device) -> torch.Tensor:
    """The full tensor in zeros, holding this rank's part where it writes one."""
    out = torch.zeros(placement.shape, dtype=placement.dtype, device=device)
    if placement.writes:
        placement.full_from_local(out)
    return out


def _summed(full: List[torch.Tensor], name: str) -> List[torch.Tensor]:
    # Horovod's sum has no boolean form: booleans travel as bytes.
    wire = [t.to(torch.uint8) if t.dtype == torch.bool else t for t in full]
    reduced = hvd.grouped_allreduce(wire, op=hvd.Sum, name=name)
    return [r.to(torch.bool) if t.dtype == torch.bool else r for r, t in zip(reduced, full)]
