"""MPI tests run in every rank of one launch:

    mpirun -np 2 python -m pytest --with-mpi tests/mpi
    horovodrun -np 2 --gloo python -m pytest --with-mpi tests/mpi

Every test is written for any world size (1, 2, 4, ...), runs all its collectives before
it asserts, and takes the same code path on every rank, so a failure fails every rank
instead of leaving the others waiting in a collective.
"""
import pytest


@pytest.fixture(scope="session")
def world():
    from hvdtrain import dist

    return dist.init(seed=1234, threads=1)


@pytest.fixture
def shared_tmp_path(world, tmp_path, request):
    """Rank 0's tmp_path, the same directory on every rank (one host). pytest-mpi's mpi_tmp_path
    is per rank under horovodrun --gloo, where mpi4py sees each process as a world of its own."""
    from pathlib import Path

    from hvdtrain import dist

    return Path(dist.allgather_object(str(tmp_path), name=f"shared_tmp_path.{request.node.nodeid}")[0])
