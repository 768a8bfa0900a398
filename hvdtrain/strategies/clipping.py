"""Clipping by the global norm, applied to the averaged gradients (after synchronize). Replicated
gradients (ddp): torch's own arithmetic, the same on every rank. Sharded gradients (zero, fsdp, ps,
a model split over a mesh): each rank's squared slices summed in float64 and all-reduced, each
element counted by exactly one rank, so every rank scales its own by the factor one process would.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

import horovod.torch as hvd

# torch.nn.utils.clip_grad_norm_'s guard against dividing by a zero norm.
EPSILON = 1e-6


def clip_replicated(gradients: Sequence[torch.Tensor], max_norm: float) -> float:
    """torch's clip_grad_norm_ arithmetic on gradients every rank holds whole (no collective);
    returns the norm before clipping."""
    if not gradients:
        return 0.0
    norm = torch.nn.utils.get_total_norm(gradients)
    factor = torch.clamp(max_norm / (norm + EPSILON), max=1.0)
    for gradient in gradients:
        gradient.mul_(factor.to(gradient.device))
    return float(norm)


def clip_sharded(slices: Sequence[torch.Tensor], max_norm: float, name: str,
                 counted: Optional[Sequence[torch.Tensor]] = None) -> float:
    """Clip gradients of which each rank holds ``slices`` (a collective: every rank calls it); returns
    the global norm before clipping, the same on every rank.

    Args:
        slices: this rank's gradient slices, clipped in place.
        max_norm: the global L2 norm to clip to.
        name: the collective's name, the same on every rank.
        counted: the slices whose squares this rank adds to the norm, when ranks hold some of them alike (a
            model-parallel replica's replicated parameters: one rank counts each); None: all.
    """
    device = slices[0].device if slices else torch.device("cpu")
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for piece in slices if counted is None else counted:
        squares += piece.detach().double().square().sum()
    total = hvd.allreduce(squares, op=hvd.Sum, name=name)
    norm = total.sqrt()
    factor = torch.clamp(max_norm / (norm + EPSILON), max=1.0)
    for piece in slices:
        piece.detach().mul_(factor.to(piece.dtype))
    return float(norm)
