"""docs/how-to/cluster-install.md, done by a non-root user on the two test hosts.

The user has what a site gives (tests/cluster/user_site.py): a module-style Open MPI, a home and shared
storage both hosts read, no root. As that user, on the login node (the machine: it reaches the
package index, the test hosts do not), scripts/setup.sh makes a venv on the shared storage and
installs Horovod from the wheelhouse that the project's own set-up built (HOROVOD_BUILD=never: no
second build), then hvdtrain from the user's clone; then, on hostA, mpirun from the module trains
train.py with one rank on each host. Root builds the hosts (namespaces, sshd) and the user; everything after
that runs as the user.
"""
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from tests.cluster import user_site as site
from tests.cluster.test_cluster import FINAL_LINE, REQUIRED_ACCURACY, untagged_lines

ROOT = Path(__file__).resolve().parents[2]
INSTALL_TIMEOUT = 600  # a venv and hvdtrain's dependencies from the package index: 60-150 s on 2 loaded cores
LAUNCH_TIMEOUT = 300  # 2 ranks, one per host: ~20 s
pytestmark = [pytest.mark.cluster,
              pytest.mark.timeout(INSTALL_TIMEOUT + LAUNCH_TIMEOUT + 120, method="signal", func_only=True)]

# train.py at 2 workers reaches 95% in 6 epochs (0.972 here, against 12 epochs for 2 hosts x 2 in
# test_cluster.py: half the workers, twice the steps per epoch); 4 epochs reached only 0.947.
EPOCHS = 6
START_LINE = re.compile(r"\b2 workers \(2 hosts x 1\)")


def project_wheelhouse() -> Path:
    """The wheelhouse the project's set-up installed this venv's Horovod from (its stamp names the wheel)."""
    stamp = Path(sys.prefix) / ".horovod-wheel"
    if not stamp.exists():
        pytest.fail(f"{stamp} is missing: run scripts/setup.sh (it builds the Horovod wheel this test installs)")
    wheel = Path(stamp.read_text().split()[0])
    assert wheel.exists(), f"{stamp} names {wheel}, which is gone: run scripts/setup.sh again"
    return wheel.parent.parent


def user_python(user) -> str:
    """An interpreter of this Python's version (the wheel is built for it) that the user may run:
    the system's first, as a site's; this one's base may lie where only root reads (a pyenv in /root)."""
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    candidates = [*(f"{directory}/python{version}" for directory in ("/usr/bin", "/usr/local/bin")),
                  os.path.realpath(getattr(sys, "_base_executable", sys.executable))]
    for candidate in dict.fromkeys(candidates):
        ran = site.run_as(user, [candidate, "-c", "import sys; print(sys.version_info[:2])"], 30, user.env(), user.home)
        if ran.returncode == 0 and ran.stdout.strip() == str(sys.version_info[:2]):
            return candidate
    pytest.fail(f"no Python {version} that a non-root user may run among {candidates}: install one (apt-get install python{version})")


def test_a_user_with_a_module_mpi_installs_from_the_wheelhouse_and_trains_on_two_hosts(cluster):
    user = site.add_user(cluster)
    modulefile = site.module_mpi(cluster)
    mpi_home = modulefile.parent
    shared = site.shared_directory(cluster, user)
    clone, venv = shared / "hvdtrain", shared / "venv"
    site.copy_checkout(ROOT, clone, user)
    wheelhouse = project_wheelhouse()
    python = user_python(user)
    modules = f". {modulefile} && . {site.module_pytorch(cluster, python)}"

    # PIP_NO_COMPILE: no .pyc files at install time (they are written at first import instead);
    # halves pip's time here, where CI time is the budget.
    setup_env = user.env(VENV=str(venv), PYTHON=python, WHEELHOUSE=str(wheelhouse), HOROVOD_BUILD="never",
                         TORCH_SPEC=f"torch=={torch.__version__}", HVDTRAIN_EXTRAS="examples", EDITABLE="0",
                         PIP_NO_COMPILE="1")
    installed = site.run_as(user, ["bash", "-c", f"{modules} && bash scripts/setup.sh"], INSTALL_TIMEOUT,
                            setup_env, clone)
    print(f"\nset-up as {user.name}: {installed.seconds:.0f} s\n{installed.stdout}")
    assert installed.returncode == 0, installed.describe(lines=60)
    assert f"[setup] MPI: {mpi_home}/bin/mpirun (mpirun (Open MPI)" in installed.stdout, installed.stdout
    assert "building Horovod" not in installed.stdout
    assert "installing torch" not in installed.stdout  # the module's torch, which the wheel was built against
    # Installed from the project's wheel, with its checksum stamped into the user's venv.
    stamp = (venv / ".horovod-wheel").read_text().split()
    assert Path(stamp[0]).parent.parent == wheelhouse and len(stamp) == 2 and len(stamp[1]) == 64, stamp
    assert (venv / "bin" / "python").lstat().st_uid == user.uid
    assert not list(venv.glob("lib/python*/site-packages/__editable__*hvdtrain*")), "an editable install"

    runs = shared / "runs"
    train_env = user.env(OMP_WAIT_POLICY="PASSIVE", HOROVOD_STALL_CHECK_TIME_SECONDS="10",
                         HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="60")
    # mpirun by its full path: Open MPI starts orted on hostB from the same prefix (as --prefix would).
    # -x PYTHONPATH: the pytorch module's path, to the rank on hostB too.
    launch = (f"{modules} && $MPI_HOME/bin/mpirun -np 2 -H hostA,hostB --bind-to none -x PYTHONPATH "
              "-x OMP_WAIT_POLICY -x HOROVOD_STALL_CHECK_TIME_SECONDS -x HOROVOD_STALL_SHUTDOWN_TIME_SECONDS "
              f"{venv}/bin/python train.py --epochs {EPOCHS} --require-accuracy {REQUIRED_ACCURACY} "
              f"--train.run_dir={runs}")
    trained = site.run_as(user, ["bash", "-c", launch], LAUNCH_TIMEOUT, train_env, clone, host=cluster.head)
    context = trained.describe(lines=60)
    print(f"training as {user.name}: {trained.seconds:.0f} s")
    assert not trained.timed_out and trained.returncode == 0, context
    lines = untagged_lines(trained.stdout)
    assert any(START_LINE.search(line) for line in lines), f"no '2 workers (2 hosts x 1)' start line\n{context}"
    assert any("ranks per host: hostA: 0; hostB: 1" in line for line in lines), context
    final = FINAL_LINE.search(lines[-1]) if lines else None
    assert final and int(final.group(2)) == 2, context
    assert float(final.group(1)) >= REQUIRED_ACCURACY, context
    print(lines[-1])
    # The run's files are the user's: rank 0 wrote them as that user.
    run_dir, = runs.iterdir()
    assert (run_dir / "metrics.jsonl").stat().st_uid == user.uid
