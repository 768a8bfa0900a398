"""scripts/setup.sh without root: the MPI first on PATH is enough to install from a wheelhouse; what is
missing is named only when a step needs it (mpirun always; compilers for a build; HOROVOD_BUILD=never
never builds). The install and build from a site's MPI run for real in tests/cluster/test_install_as_user.py."""
import subprocess
from pathlib import Path

import pytest

from tests.unit.test_setup_cuda import functions

SITE_MPIRUN = '#!/bin/sh\necho "mpirun (Open MPI) 4.1.4"\necho\necho "Report bugs to https://www.open-mpi.org"\n'


@pytest.fixture
def site_path(tmp_path):
    """A PATH with the tools the functions call, a user's `id`, and no compiler: a compute node's."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sed").symlink_to("/bin/sed")
    (bin_dir / "id").write_text("#!/bin/sh\necho 1000\n")  # not root, whoever runs the test
    (bin_dir / "id").chmod(0o755)
    return bin_dir


def run(path: Path, call: str, **env) -> subprocess.CompletedProcess:
    environment = {"PATH": str(path), "HOROVOD_BUILD": "auto", "WHEELHOUSE": "/shared/wheels", **env}
    return subprocess.run(["/bin/bash", "-c", functions() + call], capture_output=True, text=True,
                          env=environment, timeout=60)


def with_mpirun(bin_dir: Path) -> Path:
    mpirun = bin_dir / "mpirun"
    mpirun.write_text(SITE_MPIRUN)
    mpirun.chmod(0o755)
    return mpirun


def test_no_mpirun_without_root_asks_for_the_sites_mpi_module(site_path):
    result = run(site_path, "install_system_packages")
    assert result.returncode == 1
    assert "no mpirun on PATH" in result.stderr and "module load openmpi" in result.stderr, result.stderr


def test_the_mpirun_on_path_is_enough_and_named_and_a_build_asks_for_the_missing_compilers(site_path):
    mpirun = with_mpirun(site_path)
    result = run(site_path, 'install_system_packages && build_horovod_wheel "$WHEELHOUSE/horovod-key"')
    assert f"[setup] MPI: {mpirun} (mpirun (Open MPI) 4.1.4)" in result.stdout, result
    assert result.returncode == 1
    assert "Horovod must be built here (no wheel in /shared/wheels/horovod-key)" in result.stderr, result.stderr
    assert "libopenmpi-dev cmake g++ make" in result.stderr and "module load gcc cmake" in result.stderr


def test_horovod_build_never_refuses_to_build_and_says_where_to(site_path):
    with_mpirun(site_path)
    result = run(site_path, 'install_system_packages && build_horovod_wheel "$WHEELHOUSE/horovod-key"',
                 HOROVOD_BUILD="never")
    assert result.returncode == 1
    assert "no Horovod wheel in /shared/wheels/horovod-key and HOROVOD_BUILD=never" in result.stderr, result.stderr
    assert "WHEELHOUSE=/shared/wheels bash scripts/setup.sh" in result.stderr
