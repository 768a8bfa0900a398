"""Preemption: a signal asks for a checkpoint; the ranks agree at a step boundary; the job requeues.

The signal handler only sets a flag. Checkpointing inside a handler would run collectives from
an arbitrary point of the step, on whichever ranks got the signal, and hang (peers fail their
users this way). Ranks can receive the signal at different steps, so every few steps they agree
with one tiny all-reduce: if any rank was signalled, all of them stop after the same step.

A signal that can never arrive is refused at start rather than armed. Under ``hvdtrain launch``
only USR1 and USR2 reach the ranks; INT, HUP and TERM stop the whole job (the ranks are killed
within seconds: mpirun sends them TERM, then KILL a second later). hvdtrain launch says which
signals reach the ranks in their environment (hvdtrain.launch.runner.rank_variables; the names
below).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
from typing import Mapping, Optional, Tuple

import torch

from hvdtrain.common.errors import HvdtrainError
from hvdtrain.distributed import collectives

# Set by hvdtrain launch for every rank (hvdtrain.launch.runner: LAUNCHER_VARIABLE, SIGNALS_VARIABLE):
# the launcher it started, and the signals sent to it that reach the ranks, comma-separated.
LAUNCHER_VARIABLE = "HVDTRAIN_LAUNCHER"
SIGNALS_VARIABLE = "HVDTRAIN_LAUNCH_SIGNALS"


class PreemptionRefused(HvdtrainError, ValueError):
    """A train.preempt_signal that cannot reach the ranks under this launch."""


def unreachable_signal(signal_name: str, environ: Mapping[str, str]) -> Optional[str]:
    """Why ``signal_name`` can never reach this rank under hvdtrain launch (None: it can, or this is
    not such a launch), with what to use instead."""
    name = signal_name.strip().upper().removeprefix("SIG")
    if not name or SIGNALS_VARIABLE not in environ:
        return None
    passed = [part.strip() for part in environ[SIGNALS_VARIABLE].split(",") if part.strip()]
    if name in passed:
        return None
    launcher = environ.get(LAUNCHER_VARIABLE, "?")
    return (f"train.preempt_signal={name} cannot ask for a checkpoint under hvdtrain launch --launcher {launcher}: "
            f"of the signals sent to it only {' and '.join(passed) or 'none'} reach the ranks; INT, HUP and TERM "
            f"stop the whole job, killing the ranks within seconds (mpirun: TERM, then KILL a second later; srun: "
            f"KILL), before any checkpoint. Set train.preempt_signal=USR1 and have SLURM send it before the time "
            f"limit with #SBATCH --signal=B:USR1@90")


class PreemptionFlag:
    """Set by ``signal_name`` (e.g. "USR1", as in ``#SBATCH --signal=USR1@90``); empty disables it.
    ``on_term``: TERM sets it too (train.preempt_on_term: SLURM's preemption with GraceTime).
    ``environ`` (default: this process's) says whether hvdtrain launch started this rank: a
    ``signal_name`` that cannot reach the ranks under it is refused (PreemptionRefused)."""

    def __init__(self, signal_name: str, on_term: bool = False, environ: Optional[Mapping[str, str]] = None) -> None:
        refusal = unreachable_signal(signal_name, os.environ if environ is None else environ)
        if refusal:
            raise PreemptionRefused(refusal)
        self.signal_name = signal_name
        self._requested = False
        names = [signal_name] if signal_name else []
        if on_term:
            names.append("TERM")
        if names and threading.current_thread() is threading.main_thread():
            for name in dict.fromkeys(name.upper().removeprefix("SIG") for name in names):
                number = getattr(signal, f"SIG{name}", None)
                if number is None:
                    raise ValueError(f"unknown signal {signal_name!r}: use a name such as USR1, USR2 or TERM")
                signal.signal(number, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self._requested = True

    def agreed(self, stop_asked: bool = False) -> Tuple[bool, bool]:
        """(any rank signalled, any rank's ``stop_asked``), the same on every rank: one collective
        that also carries a callback's request to stop (hvdtrain.components.callbacks)."""
        votes = collectives.allreduce_sum(torch.tensor([int(self._requested), int(stop_asked)]), name="preempt.vote")
        return int(votes[0]) > 0, int(votes[1]) > 0


def requeue_command(environ: Mapping[str, str]) -> Optional[list]:
    """``scontrol requeue JOB`` when this is a SLURM job and scontrol exists, else None."""
    job = environ.get("SLURM_JOB_ID")
    if job and shutil.which("scontrol"):
        return ["scontrol", "requeue", job]
    return None


def requeue(command: list) -> str:
    """Put this SLURM job back in the queue. SLURM ends the job's steps right away: say
    everything before calling this. Returns what went wrong, if this process is still alive."""
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        return f"`{' '.join(command)}` failed: {done.stderr.strip()}"
    return ""
