"""The learning rate of data parallelism: one worker's rate scaled to the global batch, warmed up.

With N workers each averaging gradients over its batch B, one step sees N*B samples; the
linear scaling rule (Goyal et al. 2017) multiplies the learning rate by N (and by the number
of accumulated micro-batches), reached by a linear warm-up from the single-worker rate.

Under Adasum (train.reduction=adasum) the rate is not scaled by the workers: Adasum adds
orthogonal updates and averages parallel ones, so it grows the step by itself. Horovod's Adasum
guide: on CPUs over MPI, one worker's best rate; with NCCL on GPUs (which averages within a host
and applies Adasum across hosts), one worker's rate times the GPUs per host.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch


def lr_scale(global_batch: int, base_batch: int, enabled: bool, reduction: str = "average",
             workers: int = 1, adasum_factor: int = 1) -> float:
    """How many one-worker batches one step sees: workers x accumulation, in the usual case.

    Measured in samples, so a run resumed on another worker count with the same global batch
    (and so a smaller or larger batch per worker) keeps the learning rate it had.
    Under Adasum, only one worker's own samples count (its accumulation), times
    ``adasum_factor`` (adasum_lr_factor: 1 over MPI, the GPUs per host with NCCL).
    """
    if not enabled:
        return 1.0
    if reduction == "adasum":
        return global_batch / workers / base_batch * adasum_factor
    return global_batch / base_batch


def adasum_lr_factor(device_type: str, nccl_built: bool, local_size: int) -> int:
    """Horovod's rule for the LR under Adasum: on GPUs with NCCL the ranks of a host are averaged
    (NCCL) before Adasum combines the hosts, so scale by the GPUs per host; otherwise (MPI, every
    rank combined by Adasum) do not scale by the workers at all."""
    return local_size if device_type == "cuda" and nccl_built else 1


def warmup_factor(scale: float, warmup_steps: int) -> Callable[[int], float]:
    """Multiplier on the scaled LR at each step: 1/scale at step 0, rising linearly to 1.

    The optimizer's LR is already multiplied by ``scale``, so training starts at the
    single-worker rate and reaches the scaled rate after ``warmup_steps`` steps.
    """
    if scale <= 0:
        raise ValueError(f"LR scale must be positive, got {scale}")
    if warmup_steps <= 0 or scale == 1.0:
        return lambda step: 1.0
    start = 1.0 / scale

    def factor(step: int) -> float:
        progress = min(1.0, step / warmup_steps)
        return start + (1.0 - start) * progress

    return factor


def set_scaled_lr(optimizer: torch.optim.Optimizer, base_lrs: Sequence[float], scale: float) -> None:
    """Each group's rate = its one-worker rate x scale (also as the scheduler's initial_lr)."""
    for group, base in zip(optimizer.param_groups, base_lrs):
        group["lr"] = group["initial_lr"] = base * scale
