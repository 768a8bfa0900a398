"""Refusals: hvdtrain's errors that say what is wrong and what to do, printed as one line.

Every error that refuses a job's input (a setting, a hostfile, a checkpoint directory, a layout the
world does not fit, a missing path) derives from HvdtrainError, beside its historical base
(ValueError, RuntimeError, FileNotFoundError), so that callers catching those still do. hvdtrain
raises a refusal on every rank alike (the ranks agree on it with a collective first), so a job
that hits one can end on every rank at once, with one message: install_refusal_hook (run by
hvdtrain.init) makes an uncaught refusal print ``hvdtrain: <message>`` on rank 0's stderr, and
every rank exit with status 2 (the status of a settings error), without a traceback on each rank.
Any other exception keeps Python's traceback. HVDTRAIN_TRACEBACK=1 shows refusals' tracebacks too.
"""
from __future__ import annotations

import os
import sys
from types import TracebackType
from typing import Optional, Type

REFUSED_EXIT_CODE = 2  # as argparse's usage errors, and a settings error (hvdtrain.config.loader.parse_job)
SHOW_TRACEBACK = "HVDTRAIN_TRACEBACK"


class HvdtrainError(Exception):
    """A refusal of the job's input; the message names what is wrong and what to do instead."""


class LayoutError(HvdtrainError, ValueError):
    """A layout of ranks (tensor, pipeline, data parallel) that the world or the model does not fit."""


class MissingPath(HvdtrainError, FileNotFoundError):
    """A path a setting names that does not exist or is not what the setting needs."""


def one_line(error: BaseException) -> str:
    """``hvdtrain: <message>``, on one line whatever the message holds."""
    return "hvdtrain: " + " ".join(str(error).split())


def install_refusal_hook(is_root: bool) -> None:
    """Make an uncaught HvdtrainError end this process with one line on ``is_root``'s stderr and
    exit status 2 (every other exception: the previous hook's traceback). Idempotent.

    The exit skips the interpreter's shutdown (Horovod's, which could wait for peers): a refusal
    comes before anything worth flushing but the standard streams, which it flushes.
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
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(REFUSED_EXIT_CODE)

    hook.hvdtrain_refusals = True  # type: ignore[attr-defined]
    hook.previous = previous  # type: ignore[attr-defined]
    sys.excepthook = hook
