"""Who started this process, and what it says about the world, from environment variables alone.

This package never imports torch or Horovod: the launcher and the doctor use it on login nodes.
"""
from __future__ import annotations

import os
from typing import List, Mapping, Optional, Sequence, Type

from hvdtrain.distributed.environments.base import ClusterEnvironment, LauncherEnvironmentError
from hvdtrain.distributed.environments.horovodrun import HorovodRunEnvironment
from hvdtrain.distributed.environments.mpich import MPICHEnvironment
from hvdtrain.distributed.environments.openmpi import OpenMPIEnvironment
from hvdtrain.distributed.environments.pmix import PMIxEnvironment
from hvdtrain.distributed.environments.single import SingleProcessEnvironment
from hvdtrain.distributed.environments.slurm import SlurmEnvironment
from hvdtrain.distributed.environments.torchrun import TorchrunEnvironment

# First match wins. MPI launchers come before SLURM: mpirun inside an sbatch allocation inherits
# the batch shell's SLURM_* variables but is an mpirun launch. SLURM comes before bare PMIx:
# srun --mpi=pmix sets both, and SLURM's variables say more. torchrun comes before SLURM: under
# `srun torchrun` its variables describe the process, and it is refused either way (check_world).
ENVIRONMENTS: Sequence[Type[ClusterEnvironment]] = (
    HorovodRunEnvironment,
    OpenMPIEnvironment,
    MPICHEnvironment,
    TorchrunEnvironment,
    SlurmEnvironment,
    PMIxEnvironment,
    SingleProcessEnvironment,
)


def detect(env: Optional[Mapping[str, str]] = None) -> ClusterEnvironment:
    env = os.environ if env is None else env
    for environment in ENVIRONMENTS:
        if environment.detect(env):
            return environment(env)
    raise AssertionError("SingleProcessEnvironment always matches")


def is_elastic_launch(environ: Mapping[str, str] = os.environ) -> bool:
    """Started by Horovod elastic (horovodrun --min-np/--max-np), whose workers may join mid-run."""
    return environ.get("HOROVOD_ELASTIC") == "1"


def world_mismatches(environment: ClusterEnvironment, rank: int, size: int,
                     local_rank: int, local_size: int) -> List[str]:
    """Each value the launcher published that Horovod contradicts, as a sentence naming both.

    Args:
        environment: the launcher's variables, as found.
        rank: Horovod's rank.
        size: Horovod's size.
        local_rank: Horovod's local rank.
        local_size: Horovod's local size.
    """
    pairs = [
        ("world size", environment.world_size(), size, "hvd.size()"),
        ("rank", environment.global_rank(), rank, "hvd.rank()"),
        ("local rank", environment.local_rank(), local_rank, "hvd.local_rank()"),
        ("ranks on this host", environment.local_size(), local_size, "hvd.local_size()"),
    ]
    return [
        f"{what}: the launcher says {said}, Horovod says {seen} ({call})"
        for what, said, seen, call in pairs
        if said is not None and said != seen
    ]


def check_world(environment: ClusterEnvironment, rank: int, size: int,
                local_rank: int, local_size: int) -> None:
    """Refuse to train with a world that is not the one the launcher started.

    Args:
        environment: the launcher's variables, as found.
        rank: Horovod's rank.
        size: Horovod's size.
        local_rank: Horovod's local rank.
        local_size: Horovod's local size.
    """
    problems = world_mismatches(environment, rank, size, local_rank, local_size)
    if problems:
        raise LauncherEnvironmentError(
            f"started by {environment.name}, but this process's world is wrong:\n  - "
            + "\n  - ".join(problems)
            + f"\nHINT: {environment.hint}"
        )


__all__ = [
    "ENVIRONMENTS", "ClusterEnvironment", "LauncherEnvironmentError", "check_world", "detect", "is_elastic_launch",
    "world_mismatches", "HorovodRunEnvironment", "OpenMPIEnvironment", "MPICHEnvironment",
    "SlurmEnvironment", "PMIxEnvironment", "SingleProcessEnvironment", "TorchrunEnvironment",
]
