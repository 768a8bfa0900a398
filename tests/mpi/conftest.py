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
