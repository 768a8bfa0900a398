"""The optimizer side of data parallelism: Horovod's DistributedOptimizer and LR scaling.

With N workers each averaging gradients over its batch B, one step sees N*B samples; the
linear scaling rule (Goyal et al. 2017) multiplies the learning rate by N (and by the number
of accumulated micro-batches), reached by a linear warm-up from the single-worker rate.

Under Adasum (train.reduction=adasum) the rate is not scaled by the workers: Adasum adds
orthogonal updates and averages parallel ones, so it grows the step by itself. Horovod's Adasum
guide: on CPUs over MPI, one worker's best rate; with NCCL on GPUs (which averages within a host
and applies Adasum across hosts), one worker's rate times the GPUs per host.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional, Sequence, Tuple

import torch

import horovod.torch as hvd


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


def combines_updates(reduction: str, world_size: int) -> bool:
    """Whether Horovod's DistributedOptimizer is its Adasum optimizer: with op=Adasum and more than
    one rank, each rank steps every parameter with its own gradient inside backward and the
    updates (new - old parameters) are combined by Adasum; step() collects and applies them.
    At one rank Horovod returns its usual optimizer (Adasum of one tensor is that tensor)."""
    return reduction == "adasum" and world_size > 1


def adasum_refusal(size: int, local_size: int, cross_size: int, mpi_enabled: bool, gpu_nccl: bool,
                   homogeneous: bool) -> Optional[str]:
    """Why Horovod 0.28.1's Adasum cannot run on this world, or None.

    Horovod has Adasum only among its MPI operations (horovod/common/operations.cc: no Gloo one;
    a reduction under Gloo fails with "No Adasum operation enabled"), and combines ranks pairwise
    in a binary tree, so it refuses other rank counts (horovod/torch/mpi_ops.py: "non-power of 2
    ranks"; with NCCL on GPUs, hosts). Checked at start, on every rank, before any collective.
    """
    average = "or use train.reduction=average"
    if not mpi_enabled:
        return ("train.reduction=adasum needs Horovod's MPI operations, and this job runs on Gloo "
                "(horovodrun --gloo, or Horovod elastic): Horovod has no Adasum over Gloo, so every "
                "reduction would fail with 'No Adasum operation enabled'. Launch with MPI (mpirun, or "
                f"horovodrun without --gloo), {average}")
    if gpu_nccl:
        if not homogeneous:
            return ("train.reduction=adasum with NCCL on GPUs needs the same number of ranks on every "
                    "host (Horovod averages within a host with NCCL, then applies Adasum across hosts). "
                    f"Launch as many ranks on each host, {average}")
        if not is_power_of_two(cross_size):
            return (f"train.reduction=adasum with NCCL on GPUs needs a power-of-two number of hosts "
                    f"(Horovod applies Adasum across hosts pairwise, in a binary tree); this job has "
                    f"{cross_size} hosts. Use 1, 2, 4, 8 ... hosts, {average}")
        return None
    if not is_power_of_two(size):
        return (f"train.reduction=adasum needs a power-of-two number of workers (Horovod combines the "
                f"ranks pairwise, in a binary tree); this job has {size}. Launch 1, 2, 4, 8 ... "
                f"workers, {average}")
    return None


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


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
    reduction: str = "average",
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so gradients are averaged across ranks as they become ready.

    Horovod hooks every gradient accumulator: each all-reduce starts while backward is still
    running (overlap) and small tensors are fused into one buffer (tensor fusion).
    The user's optimizer state is carried over: Horovod's wrapper starts with an empty one.
    ``reduction="adasum"``: Horovod's Adasum optimizer instead (see combines_updates), whose
    all-reduces combine each parameter's update with Adasum, per tensor even when fused.
    """
    state = optimizer.state_dict()
    wrapped = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=list(named_parameters),
        compression=hvd.Compression.fp16 if fp16_allreduce else hvd.Compression.none,
        backward_passes_per_step=accumulation,
        op=hvd.Adasum if reduction == "adasum" else hvd.Average,
    )
    if state["state"]:
        wrapped.load_state_dict(state)
    return wrapped
