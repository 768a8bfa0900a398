"""The optimizer side of data parallelism: Horovod's DistributedOptimizer and LR scaling.

With N workers each averaging gradients over its batch B, one step sees N*B samples; the
linear scaling rule (Goyal et al. 2017) multiplies the learning rate by N (and by the number
of accumulated micro-batches), reached by a linear warm-up from the single-worker rate.
"""
from __future__ import annotations

from typing import Callable, Iterable, Sequence, Tuple

import torch

import horovod.torch as hvd


def lr_scale(global_batch: int, base_batch: int, enabled: bool) -> float:
    """How many one-worker batches one step sees: workers x accumulation, in the usual case.

    Measured in samples, so a run resumed on another worker count with the same global batch
    (and so a smaller or larger batch per worker) keeps the learning rate it had.
    """
    return global_batch / base_batch if enabled else 1.0


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


def distributed_optimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[Tuple[str, torch.nn.Parameter]],
    accumulation: int,
    fp16_allreduce: bool,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so gradients are averaged across ranks as they become ready.

    Horovod hooks every gradient accumulator: each all-reduce starts while backward is still
    running (overlap) and small tensors are fused into one buffer (tensor fusion).
    The user's optimizer state is carried over: Horovod's wrapper starts with an empty one.
    """
    state = optimizer.state_dict()
    wrapped = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=list(named_parameters),
        compression=hvd.Compression.fp16 if fp16_allreduce else hvd.Compression.none,
        backward_passes_per_step=accumulation,
        op=hvd.Average,
    )
    if state["state"]:
        wrapped.load_state_dict(state)
    return wrapped
