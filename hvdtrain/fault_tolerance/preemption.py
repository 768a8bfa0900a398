"""Preemption: a signal asks for a checkpoint; the ranks agree at a step boundary; the job requeues.

The signal handler only sets a flag. Checkpointing inside a handler would run collectives from
an arbitrary point of the step, on whichever ranks got the signal, and hang (peers fail their
users this way). Ranks can receive the signal at different steps, so every few steps they agree
with one tiny all-reduce: if any rank was signalled, all of them stop after the same step.
"""
from __future__ import annotations

import shutil
import signal
import subprocess
import threading
from typing import Mapping, Optional, Tuple

import torch

from hvdtrain.distributed import collectives
class PreemptionFlag:
    """Set by ``signal_name`` (e.g. "USR1", as in ``#SBATCH --signal=USR1@90``); empty disables it.
    ``on_term``: TERM sets it too (train.preempt_on_term: SLURM's preemption with GraceTime)."""

    def __init__(self, signal_name: str, on_term: bool = False) -> None:
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
