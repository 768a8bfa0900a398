"""MPI tests run in every rank of one launch:

    mpirun -np 2 python -m pytest --with-mpi tests/mpi
    horovodrun -np 2 --gloo python -m pytest --with-mpi tests/mpi

Every test is written for any world size (1, 2, 4, ...), runs all its collectives before
it asserts, and takes the same code path on every rank, so a failure fails every rank
instead of leaving the others waiting in a collective.

A test that runs past its time limit ends its process with every thread's stack (pytest-timeout's
thread method) instead of raising inside the test: raised, it would run the test's clean-up
collectives while the other ranks still wait in the test's own, and the launch would hang until
its hard limit. A process that exits makes mpirun and horovodrun end the launch at once.
"""
import os

import pytest


def pytest_collection_modifyitems(config, items):
    for item in items:
        marker = item.get_closest_marker("timeout")
        seconds = marker.args[0] if marker is not None and marker.args else float(config.getini("timeout"))
        item.add_marker(pytest.mark.timeout(seconds, method="thread"), append=False)


@pytest.fixture(scope="session")
def world(request):
    from hvdtrain.distributed import startup
    # Dynamic process sets slow every collective (a small all-reduce at 4 ranks under Gloo on 2
    # cores: 28 ms without, 57 ms with), so they are on only when a collected test builds a mesh.
    # Every rank collects the same tests, so every rank decides alike.
    process_sets = any(item.get_closest_marker("process_sets") for item in request.session.items)
    world = startup.init(seed=1234, threads=1, dynamic_process_sets=process_sets)
    if world.local_size >= len(os.sched_getaffinity(0)):
        from hvdtrain.distributed.waiting import wait_without_spinning
        wait_without_spinning()
    return world


@pytest.fixture
def shared_tmp_path(world, tmp_path, request):
    """Rank 0's tmp_path, the same directory on every rank (one host). pytest-mpi's mpi_tmp_path
    is per rank under horovodrun --gloo, where mpi4py sees each process as a world of its own."""
    from pathlib import Path

    from hvdtrain.distributed import collectives

    return Path(collectives.allgather_object(str(tmp_path), name=f"shared_tmp_path.{request.node.nodeid}")[0])
