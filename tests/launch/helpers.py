"""Running launches from tests: own session, hard timeout, root-aware environment."""
import difflib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hvdtrain.launch.sessions import kill_session  # noqa: F401 (the tests' name for it)

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
    """Run a launch in its own session, so a timeout kills every rank it started."""
    env = launch_env(extra_env)
    process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    return finish(process, timeout, " ".join(argv))


def finish(process, timeout=LAUNCH_TIMEOUT, what="the launch"):
    """(exit code, stdout, stderr) of ``process`` (started in its own session, its output piped), or
    the test fails naming what it printed, every process of its session killed."""
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_session(process.pid)
        out, err = process.communicate()
        pytest.fail(f"{what} did not finish in {timeout} s:\n{out[-3000:]}\n{err[-3000:]}")
    return process.returncode, out, err


def kill_when(argv, ready, what=None, timeout=240.0, poll=0.02):
    """Start the launch ``argv`` and SIGKILL every process of it as soon as ``ready()`` is true (or
    the path ``ready`` exists); fail if it ends first or ``what`` (the awaited moment, for the
    message) has not come in time."""
    if isinstance(ready, Path):
        ready, what = ready.exists, what or ready.name
    process = subprocess.Popen(argv, cwd=ROOT, env=launch_env(), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + timeout
    try:
        while not ready():
            assert process.poll() is None, f"the run ended (exit {process.returncode}) before {what}"
            assert time.monotonic() < deadline, f"{what} did not come in {timeout:.0f} s"
            time.sleep(poll)
    finally:
        kill_session(process.pid)
        process.wait()


def signal_when(argv, ready: Path, signum, ranks=None, timeout=240.0, extra_env=None):
    """Start the launch ``argv`` (with ``extra_env``) and, once the path ``ready`` exists, send
    ``signum`` to its first process (or to each process running the command ``ranks``: the ranks, as
    SLURM signals its tasks); return (exit code, stdout, stderr, the session's processes left at its
    end). Every process of it is killed if it does not end in time."""
    from hvdtrain.launch.sessions import descendants_running, session_members

    process = subprocess.Popen(argv, cwd=ROOT, env=launch_env(extra_env), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + timeout
    try:
        while not ready.exists():
            assert process.poll() is None, f"the launch ended (exit {process.returncode}) before {ready.name}"
            assert time.monotonic() < deadline, f"no {ready.name} in {timeout:.0f} s"
            time.sleep(0.05)
        if ranks is None:
            process.send_signal(signum)
        else:
            pids = descendants_running(process.pid, ranks)
            assert len(pids) == 2, pids
            for pid in pids:
                os.kill(pid, signum)
        out, err = process.communicate(timeout=max(deadline - time.monotonic(), 30))
        left = session_members(process.pid)
    except subprocess.TimeoutExpired:
        kill_session(process.pid)
        out, err = process.communicate()
        pytest.fail(f"the launch did not end after the signal:\n{out[-3000:]}\n{err[-3000:]}")
    finally:
        kill_session(process.pid)
    return process.returncode, out, err, left


def code_lines(path):
    """A script's lines after its docstring (which says what the script is, not what it does)."""
    text = Path(path).read_text()
    return text[text.index('"""', 3) + 3:].splitlines()


def port_diff(original, port):
    """The lines a port takes out of ``original`` and puts into ``port`` (docstrings aside), and the
    unified diff itself, to show when a count is off."""
    diff = list(difflib.unified_diff(code_lines(original), code_lines(port), lineterm="", n=0))
    removed = [line for line in diff if line.startswith("-") and not line.startswith("---")]
    added = [line for line in diff if line.startswith("+") and not line.startswith("+++")]
    return removed, added, "\n".join(diff)
