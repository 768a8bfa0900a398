"""Refusals: hvdtrain's errors that say what is wrong and what to do, printed as one line.

Every error that refuses a job's input (a setting, a hostfile, a checkpoint directory, a layout the
world does not fit, a missing path) derives from HvdtrainError, beside its historical base
(ValueError, RuntimeError, FileNotFoundError), so that callers catching those still do. hvdtrain
raises a refusal on every rank alike (the ranks agree on it with a collective first), so a job
that hits one can end on every rank at once, with one message: install_refusal_hook (run by
hvdtrain.init) makes an uncaught refusal print ``hvdtrain: <message>`` on rank 0's stderr, and
every rank exit with status 2 (the status of a settings error), without a traceback on each rank.
Any other exception keeps Python's traceback. HVDTRAIN_TRACEBACK=1 shows refusals' tracebacks too.

No rank exits before rank 0 has printed: a launcher (mpirun, horovodrun, srun --kill-on-bad-exit)
ends the whole job at the first non-zero exit, so a rank that reached the refusal a moment before
rank 0 would take rank 0's line down with it. Every rank meets the others (``meet``: one Horovod
collective, which rank 0 joins once its line is out) before it exits. A rank that meets nobody
within the grace period (rank 0 did not refuse) prints the line itself, naming its rank, so the
reason is never lost.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from types import TracebackType
from typing import Callable, Mapping, Optional, Type

# Where each launcher puts a process's rank (Open MPI, srun's PMIx, Hydra, horovodrun over Gloo, srun):
# before Horovod starts, the only way to know which process speaks for the job.
RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "HOROVOD_RANK", "SLURM_PROCID")
REFUSED_EXIT_CODE = 2  # as argparse's usage errors, and a settings error (hvdtrain.config.loader.parse_job)
SHOW_TRACEBACK = "HVDTRAIN_TRACEBACK"
# How long a rank waits to meet the others before it speaks (or, rank 0, exits) alone: far longer
# than rank 0 takes to reach its refusal after the collective the ranks agreed on, under load.
REFUSAL_GRACE_SECONDS = 30.0
# Every rank's meeting before it exits: True once all ranks have joined it within the seconds given.
Meeting = Callable[[float], bool]


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


def install_refusal_hook(is_root: bool, meet: Optional[Meeting] = None,
                         grace_seconds: float = REFUSAL_GRACE_SECONDS) -> None:
    """Make an uncaught HvdtrainError end this process with one line on ``is_root``'s stderr and
    exit status 2 (every other exception: the previous hook's traceback). Idempotent. Before it
    exits, every rank ``meet``s the others (the root once its line is out); a rank other than the
    root that meets nobody within ``grace_seconds`` (or has no ``meet``) prints the line with its
    rank (see the module's docstring).

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
            sys.stderr.flush()
            if meet is not None:
                meet(grace_seconds)
        elif not meet_or_wait(meet, grace_seconds):
            print(one_line(error).replace("hvdtrain: ", f"hvdtrain: (rank {launcher_rank()}; rank 0 did not say "
                                          "it) ", 1), file=sys.stderr)
        sys.stderr.flush()
        raise SystemExit(REFUSED_EXIT_CODE)

    hook.hvdtrain_refusals = True  # type: ignore[attr-defined]
    hook.previous = previous  # type: ignore[attr-defined]
    sys.excepthook = hook


def meet_or_wait(meet: Optional[Meeting], grace_seconds: float) -> bool:
    """A rank other than the root: whether it met the others (rank 0 among them, its line out)
    within ``grace_seconds``; with no ``meet``, False after waiting them out. A launcher's SIGTERM
    (the job ended) ends this process at once, not a preemption handler that would only note it."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if meet is not None:
        return meet(grace_seconds)
    time.sleep(grace_seconds)
    return False
