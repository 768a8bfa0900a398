"""The two-host test cluster (tests/cluster/harness.py), built once per pytest session.

Runs in one plain pytest process: `python -m pytest tests/cluster`. The tests launch their own
ranks across the test hosts, so they are skipped inside an MPI or Horovod launch.
"""
import os

import pytest

from tests.cluster import harness

_RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "HOROVOD_RANK")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "cluster: needs the two-host test cluster (root, Linux, ip netns); one plain pytest process")


def _not_a_plain_process(config):
    if config.getoption("--with-mpi", default=False):
        return "cluster tests run in one plain pytest process, not under --with-mpi"
    launched = [name for name in _RANK_VARIABLES if name in os.environ]
    if launched:
        return f"cluster tests run in one plain pytest process, not in a rank of a launch ({launched[0]} is set)"
    return None


@pytest.fixture(scope="session")
def cluster(request):
    """The running cluster; skips every cluster test where it cannot be built, with the reason."""
    reason = _not_a_plain_process(request.config) or harness.skip_reason()
    if reason:
        pytest.skip(reason)
    with harness.running_cluster() as built:
        yield built
