"""hvdtrain's view of the job agrees with the launcher that started it."""
import os

import pytest
import torch

from hvdtrain.distributed import collectives
from hvdtrain.distributed import environments as env

pytestmark = pytest.mark.mpi


def test_world_matches_the_launcher(world):
    launcher = env.detect()
    ranks = collectives.allgather_rows(torch.tensor([world.rank, world.local_rank]), name="world.ranks")
    expected_launcher = ("horovodrun (Gloo)" if "HOROVOD_GLOO_RENDEZVOUS_ADDR" in os.environ
                         else "Open MPI mpirun" if "OMPI_COMM_WORLD_SIZE" in os.environ
                         else "single process")

    assert world.launcher == launcher.name == expected_launcher
    assert (world.rank, world.size) == (launcher.global_rank(), launcher.world_size())
    assert (world.local_rank, world.local_size) == (launcher.local_rank(), launcher.local_size())
    assert world.controller == ("gloo" if expected_launcher.startswith("horovodrun") else "mpi")
    assert sorted(ranks[:, 0].tolist()) == list(range(world.size))
    assert world.local_size * world.cross_size == world.size
    assert 1 <= world.threads <= (os.cpu_count() or 1)
