"""Where a job's start-up goes: seconds from this process's start to the end of its first step.

The clock counts from the moment the operating system started the process (psutil reads it), so
the imports before any hvdtrain code ran (torch alone takes seconds) count too. Four marks split
it, each taken the first time the code passes it in this process:

    imports        Python, torch, Horovod and the user's script up to hvdtrain.init()
    horovod init   hvd.init() (MPI or Gloo's rendezvous) and the ranks' agreement on devices
    set-up         the script's own work, then the Trainer's: model, optimizer, broadcast of rank 0's
                   state, strategy, data, a resumed checkpoint (to the start of training)
    first step     the first step: the first forward, backward, all-reduce and optimizer step

A process reports once (its first training), whatever runs after.
"""
from __future__ import annotations

import os
import time
from typing import Dict, Optional

PHASES = ("imports", "horovod init", "set-up", "first step")


def record_key(phase: str) -> str:
    """A phase's key in the ``startup`` record: ``set-up`` -> ``set_up_s``."""
    return phase.replace(" ", "_").replace("-", "_") + "_s"


def process_start_time() -> float:
    """The wall-clock time this process started (seconds since the epoch), to 10 ms on Linux.

    psutil's create_time adds the process's start in ticks since boot to the boot time, which Linux
    gives in whole seconds: up to a second off, as much as a launcher's whole share. The process's
    age from /proc (its start tick against the uptime, both since boot) is exact to a tick; psutil
    where /proc says nothing sensible (another OS, an uptime a container virtualizes).
    """
    import psutil  # Horovod needs it too; imported here only: the clock's first mark

    now, created = time.time(), psutil.Process().create_time()
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            start_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
            age = float(uptime.read().split()[0]) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return created
    return now - age if 0 <= age <= now - created + 2.0 else created


class StartupClock:
    """Marks in seconds since the process started; each phase once (the first time)."""

    def __init__(self, started_at: Optional[float] = None) -> None:
        self._started_at = started_at
        self.marks: Dict[str, float] = {}
        self.reported = False

    def mark(self, phase: str) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown start-up phase {phase!r}: one of {', '.join(PHASES)}")
        self.marks.setdefault(phase, time.time() - self.started_at)

    @property
    def started_at(self) -> float:
        """When this process started (wall-clock seconds since the epoch)."""
        if self._started_at is None:
            self._started_at = process_start_time()
        return self._started_at

    def durations(self) -> Dict[str, float]:
        """Each marked phase's seconds (from the mark before it, or the process start)."""
        durations, before = {}, 0.0
        for phase in PHASES:
            if phase in self.marks:
                durations[phase] = self.marks[phase] - before
                before = self.marks[phase]
        return durations

    def total(self) -> float:
        return max(self.marks.values(), default=0.0)

    def line(self) -> str:
        parts = ", ".join(f"{phase} {seconds:.1f} s" for phase, seconds in self.durations().items())
        return f"start-up: {self.total():.1f} s from the process's start to the end of the first step ({parts})"

    def take_report(self) -> Optional[Dict[str, float]]:
        """The record to log, the first time the first step has been marked; None after."""
        if self.reported or "first step" not in self.marks:
            return None
        self.reported = True
        return {"total_s": self.total(), **{record_key(phase): seconds for phase, seconds in self.durations().items()}}


CLOCK = StartupClock()
