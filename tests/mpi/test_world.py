"""hvdtrain's view of the job agrees with the launcher that started it."""
import os

import pytest
import torch

from hvdtrain import dist

pytestmark = pytest.mark.mpi


def launcher_world():
    """(rank, size, controller) as the launcher's own variables say."""
    if "HOROVOD_GLOO_RENDEZVOUS_ADDR" in os.environ:  # horovodrun --gloo
        return int(os.environ["HOROVOD_RANK"]), int(os.environ["HOROVOD_SIZE"]), "gloo"
    if "OMPI_COMM_WORLD_SIZE" in os.environ:  # mpirun (or horovodrun over MPI)
        return int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"]), "mpi"
    return 0, 1, "mpi"  # one process, no launcher


def test_world_matches_the_launcher(world):
    rank, size, controller = launcher_world()
    ranks = dist.allgather_rows(torch.tensor([world.rank, world.local_rank]), name="world.ranks")

    assert (world.rank, world.size, world.controller) == (rank, size, controller)
    assert sorted(ranks[:, 0].tolist()) == list(range(size))
    assert world.local_size * world.cross_size == world.size
    assert 1 <= world.threads <= (os.cpu_count() or 1)
