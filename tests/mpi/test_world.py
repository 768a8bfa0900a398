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


def test_a_rank_that_cannot_take_its_device_makes_every_rank_refuse_at_start(world, monkeypatch):
    """The last rank's CUDA fails while start-up picks its device (start-up again: Horovod's init is
    idempotent, the device gather runs again). It still enters the gather, and every rank raises the
    same error naming it; before, it raised alone and the others waited in the gather."""
    from hvdtrain.distributed import startup

    def broken():
        raise RuntimeError("CUDA driver initialization failed")

    if world.rank == world.size - 1:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", broken)
    try:
        startup.init(seed=1234, threads=world.threads)
        refusal = None
    except ValueError as error:
        refusal = str(error)
    everyone = collectives.allgather_object(refusal, name="world.device_refusal")

    assert len(set(everyone)) == 1, everyone
    last = collectives.allgather_object(world.hostname, name="world.hosts")[-1]
    assert everyone[0].startswith(f"no device for rank {world.size - 1} on {last}: RuntimeError: CUDA driver "
                                  f"initialization failed")
