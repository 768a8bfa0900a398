"""Run one measured worker job (N ranks under a launcher) with a time limit and read its result.

A benchmark worker is a module run as ``python -m <module> --out FILE ...``; rank 0 writes its
result as JSON to FILE. Each job is its own launch, so variants that cannot share a process
(Horovod-MPI, Horovod-Gloo, torch DDP, no distribution) are measured the same way.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional, Sequence

from hvdtrain.common.atomic import write_text_atomically
from hvdtrain.launch.commands import JOB_LAUNCHERS, job_argv
from hvdtrain.launch.hostfile import Host

LAUNCHERS = JOB_LAUNCHERS


class JobFailed(RuntimeError):
    """A worker job exited non-zero, timed out, or wrote no result."""


def worker_argv(module: str, args: Sequence[str], out: Path, np: int, launcher: str,
                hosts: Sequence[Host] = (), environ: Mapping[str, str] = os.environ) -> list:
    """The command that runs ``module`` as the worker on ``np`` ranks, writing rank 0's result to ``out``.

    Args:
        module: the worker's module, run with ``python -m``.
        args: the worker's own arguments.
        out: the file rank 0 writes its JSON result to.
        np: ranks.
        launcher: none, mpirun or horovodrun (launch.commands.job_argv).
        hosts: the hosts to run on (default: this one).
        environ: the environment that decides which launcher binaries to use.
    """
    return job_argv([sys.executable, "-m", module, "--out", str(out), *args], np, launcher, hosts, environ)


def run_job(module: str, args: Sequence[str], np: int, launcher: str, timeout: float,
            env: Optional[Mapping[str, str]] = None, hosts: Sequence[Host] = ()) -> Dict[str, Any]:
    """Launch the worker, wait at most ``timeout`` seconds, return rank 0's JSON result.

    Args:
        module: the worker's module.
        args: the worker's own arguments.
        np: ranks.
        launcher: none, mpirun or horovodrun.
        timeout: seconds before the job is killed.
        env: variables added to this process's environment.
        hosts: the hosts to run on (default: this one).
    """
    environ = dict(os.environ)
    environ.update(env or {})
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        environ.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-") as tmp:
        out = Path(tmp) / "result.json"
        argv = worker_argv(module, args, out, np, launcher, hosts, environ)
        # Own session: a timeout kills every rank, not only the launcher.
        process = subprocess.Popen(argv, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, start_new_session=True)
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            raise JobFailed(f"{' '.join(argv)} did not finish in {timeout:.0f} s; its last output:\n"
                            f"{output[-2000:]}") from None
        if process.returncode != 0 or not out.exists():
            raise JobFailed(f"{' '.join(argv)} exited {process.returncode}; its last output:\n{output[-2000:]}")
        return json.loads(out.read_text())


def write_result(out: Path, payload: Dict[str, Any]) -> None:
    """Rank 0 of a worker job: leave the result where ``run_job`` reads it (whole or not at all)."""
    write_text_atomically(Path(out), json.dumps(payload))


def driver_or_worker(argv: Sequence[str], worker: Callable[[Sequence[str]], int],
                     add_arguments: Callable[[argparse.ArgumentParser], None],
                     run: Callable[[argparse.Namespace], int], description: str, worker_flag: str = "--out") -> int:
    """The main of a module that is both a benchmark's driver and its worker: ``run_job`` starts the
    worker with ``worker_flag`` among its arguments.

    Args:
        argv: the command line.
        worker: the worker's main, run when ``worker_flag`` is in ``argv``.
        add_arguments: adds the driver's options to its parser.
        run: the driver's main, given the parsed options.
        description: the driver's --help text.
        worker_flag: the flag that marks a worker's command line (--out FILE, unless the driver takes --out too).
    """
    if worker_flag in argv:
        return worker(argv)
    parser = argparse.ArgumentParser(description=description.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
