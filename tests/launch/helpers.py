"""Running launches from tests: own process group, hard timeout, root-aware environment."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PYTHON = sys.executable
LAUNCH_TIMEOUT = 300  # seconds; a launch that hangs fails instead of blocking CI


def launch_env(extra_env=None):
    """The test's environment for a launch: this venv first on PATH, and root allowed to mpirun."""
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", **(extra_env or {}))
    if os.geteuid() == 0:  # Open MPI refuses root unless told twice
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


def run(argv, timeout=LAUNCH_TIMEOUT, extra_env=None):
    """Run a launch in its own process group, so a timeout kills every rank it started."""
    env = launch_env(extra_env)
    process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        pytest.fail(f"{' '.join(argv)} did not finish in {timeout} s:\n{out[-3000:]}\n{err[-3000:]}")
    return process.returncode, out, err
