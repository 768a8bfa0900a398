"""How ddp combines the ranks' gradients: Horovod's average, or Adasum, and what Adasum needs of the world."""
from __future__ import annotations

from typing import Optional


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

    Args:
        size: ranks in the world.
        local_size: ranks per host.
        cross_size: hosts.
        mpi_enabled: Horovod runs over MPI.
        gpu_nccl: the ranks reduce on GPUs with NCCL.
        homogeneous: every host runs as many ranks.
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
