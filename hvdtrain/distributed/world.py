"""Who this process is in the job, as Horovod reports it after start-up."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class World:
    """Who this process is in the job, as Horovod reports it after init."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    hostname: str
    controller: str  # "mpi" or "gloo"
    launcher: str  # which launcher's variables were found, e.g. "SLURM srun"
    threads: int
    device: torch.device
    # HOROVOD_HIERARCHICAL_ALLREDUCE asked for (> 0) when Horovod started (hierarchical_effect: applied or not).
    hierarchical_allreduce: bool = False
    # What train.cpu_allocator did to this CPU rank's malloc, in words for the start line ("": a GPU rank).
    cpu_allocator: str = ""

    @property
    def is_root(self) -> bool:
        return self.rank == 0
