"""Refusals: hvdtrain's errors that say what is wrong and what to do, printed as one line.

Every error that refuses a job's input (a setting, a hostfile, a checkpoint directory, a layout the
world does not fit, a missing path) derives from HvdtrainError, beside its historical base
(ValueError, RuntimeError, FileNotFoundError), so that callers catching those still do. hvdtrain
raises a refusal on every rank alike (the ranks agree on it with a collective first), so a job
that hits one can end on every rank at once, with one message: install_refusal_hook (run by
hvdtrain.init) makes an uncaught refusal print ``hvdtrain: <message>`` on rank 0's stderr, and
every rank exit with status 2 (the status of a settings error), without a traceback on each rank.
Any other exception keeps Python's traceback. HVDTRAIN_TRACEBACK=1 shows refusals' tracebacks too.

The other ranks do not exit at once: a launcher (mpirun, horovodrun, srun --kill-on-bad-exit) ends
the whole job at the first non-zero exit, so a rank that reached the refusal a moment before rank 0
would take rank 0's line down with it. They wait for rank 0's exit to end the job; a rank still
alive after the grace period (rank 0 did not refuse, or no launcher ends the job) prints the line
itself, naming its rank, so the reason is never lost.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from types import TracebackType
from typing import Mapping, Optional, Type

# Where each launcher puts a process's rank (Open MPI, srun's PMIx, Hydra, horovodrun over Gloo, srun):
# before Horovod starts, the only way to know which process speaks for the job.
RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "HOROVOD_RANK", "SLURM_PROCID")
REFUSED_EXIT_CODE = 2  # as argparse's usage errors, and a settings error (hvdtrain.config.loader.parse_job)
SHOW_TRACEBACK = "HVDTRAIN_TRACEBACK"
# How long a rank other than 0 waits for rank 0's exit to end the job before it speaks itself: far
# longer than rank 0 takes to print one line after the collective the ranks agreed on, under load.
REFUSAL_GRACE_SECONDS = 30.0


class HvdtrainError(Exception):
    """A refusal of the job's input; the message names what is wrong and what to do instead."""


class LayoutError(HvdtrainError, ValueError):
    """A layout of ranks (tensor, pipeline, data parallel) that the world or the model does not fit."""


class MissingPath(HvdtrainError, FileNotFoundError):
    """A path a setting names that does not exist or is not what the setting needs."""


def one_line(error: BaseException) -> str:
    """``hvdtrain: <message>``, on one line whatever the message holds."""
    return "hvdtrain: " + " ".join(str(error).split())


def launcher_rank(environ: Optional[Mapping[str, str]] = None) -> int:
    """This process's rank as its launcher's variables say (0 when none does: one process)."""
    environ = os.environ if environ is None else environ
    for name in RANK_VARIABLES:
        value = environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return 0


def install_refusal_hook(is_root: bool, grace_seconds: float = REFUSAL_GRACE_SECONDS) -> None:
    """Make an uncaught HvdtrainError end this process with one line on ``is_root``'s stderr and
    exit status 2 (every other exception: the previous hook's traceback). Idempotent. A rank other
    than the root waits up to ``grace_seconds`` for the root's exit to end the job first (see the
    module's docstring), then prints the line with its rank and exits.

    The hook ends the process by raising SystemExit, which Python honours from an excepthook: the
    interpreter then shuts down as after any exit (atexit: Horovod's shutdown, MPI's finalize), so
    that mpirun sees ranks that ended properly, with status 2, not ranks that vanished.
    """
    previous = sys.excepthook
    if getattr(previous, "hvdtrain_refusals", False):
        previous = previous.previous  # type: ignore[attr-defined]

    def hook(kind: Type[BaseException], error: BaseException, trace: Optional[TracebackType]) -> None:
        if not issubclass(kind, HvdtrainError):
            previous(kind, error, trace)
            return
        if os.environ.get(SHOW_TRACEBACK, "").strip() not in ("", "0"):
            previous(kind, error, trace)
        elif is_root:
            print(one_line(error), file=sys.stderr)
        else:
            wait_for_the_root_to_end_the_job(grace_seconds)
            print(one_line(error).replace("hvdtrain: ", f"hvdtrain: (rank {launcher_rank()}; rank 0 did not end "
                                          "the job) ", 1), file=sys.stderr)
        sys.stderr.flush()
        raise SystemExit(REFUSED_EXIT_CODE)

    hook.hvdtrain_refusals = True  # type: ignore[attr-defined]
    hook.previous = previous  # type: ignore[attr-defined]
    sys.excepthook = hook


def wait_for_the_root_to_end_the_job(grace_seconds: float) -> None:
    """Sleep up to ``grace_seconds``; a launcher's SIGTERM (rank 0 exited) ends this process at once,
    not a preemption handler that would only note it."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    time.sleep(grace_seconds)
