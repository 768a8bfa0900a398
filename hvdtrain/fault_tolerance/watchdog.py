"""A rank that stops taking steps ends the job, saying where every rank is stuck.

Horovod alone turns a rank that stops calling collectives into a silent hang (its stall check
does not fire under Gloo, nor for a frozen rank under MPI). Every rank runs this watchdog: the
training loop beats after each step; when no beat comes for ``timeout`` seconds, the watchdog
names the rank, host and last step, and the all-reduces this rank waits in, then ends the
process, and the launcher ends the job. The rank that stopped is the one waiting in none. It also
guards the Trainer's set-up (its collectives), and it is paused while a checkpoint is written:
a large save is slow, not stuck.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, List, Optional


STALL_EXIT_CODE = 75


class StallWatchdog:
    """Ends the process when the training loop's beats stop for ``timeout`` seconds (see the module's text).

    Args:
        timeout: seconds without a beat that count as a stall.
        rank: this rank, for the message.
        host: its host, for the message.
        pending: the names of the collectives this rank waits in; None: not known (set-up).
        exit_process: ends the process with the exit code (os._exit; a stand-in in the tests).
        phase: what is guarded (training, set-up), for the message.
    """
    def __init__(self, timeout: float, rank: int, host: str, pending: Optional[Callable[[], List[str]]],
                 exit_process: Callable[[int], None] = os._exit, phase: str = "training") -> None:
        self.timeout = timeout
        self.rank, self.host = rank, host
        self._pending = pending  # None: the collectives in flight are not known (set-up)
        self._exit = exit_process
        self.phase = phase
        self._last_beat = time.monotonic()
        self._step = 0
        self._paused = False
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hvdtrain-watchdog", daemon=True)
        self.flight = None  # the flight recorder (hvdtrain.fault_tolerance.flight), set by FaultHandling

    def start(self) -> "StallWatchdog":
        self.beat(self._step)
        self._thread.start()
        return self

    def beat(self, step: int) -> None:
        """Called by the training loop after each step: two assignments, nothing else."""
        self._last_beat = time.monotonic()
        self._step = step

    def stop(self) -> None:
        self._stopped.set()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No stall is counted inside (every rank pauses alike: a checkpoint save); the clock
        restarts when it ends."""
        self._paused = True
        try:
            yield
        finally:
            self.beat(self._step)
            self._paused = False

    def report(self, silent_for: float) -> str:
        if self._pending is None:
            where = "in the Trainer's set-up (its broadcasts, the mesh, reading the checkpoint)"
        else:
            waiting = self._pending()
            where = (f"waiting in the all-reduce of {', '.join(waiting[:10])}"
                     + (f" and {len(waiting) - 10} more" if len(waiting) > 10 else "")
                     if waiting else
                     "not waiting in any collective: THIS rank stopped calling them (stuck in data loading, "
                     "in user code, or in I/O)")
        finished = "nothing finished" if self.phase == "set-up" else "no step finished"
        return (f"[hvdtrain] STALL rank {self.rank} on {self.host}: {finished} for "
                f"{silent_for:.0f} s after step {self._step}; {where}. Ending the job "
                f"(stall_timeout={self.timeout:g} s).")

    def _dump_flight_record(self) -> str:
        """On a stall: this rank's flight record written into the run directory; where, for the report."""
        return self.flight.on_stall() if self.flight is not None else ""

    def _flight_verdict(self, within: float) -> None:
        """On a stall, rank 0 prints the analysis of every rank's flight record (waiting ``within`` s at most)."""
        if self.flight is not None:
            self.flight.verdict(within)

    def _watch(self) -> None:
        interval = max(0.1, min(5.0, self.timeout / 5))
        while not self._stopped.wait(interval):
            silent_for = time.monotonic() - self._last_beat
            if silent_for > self.timeout and not self._paused:
                print(self.report(silent_for) + self._dump_flight_record(), file=sys.stderr, flush=True)
                self._flight_verdict(within=interval + 2.0)
                # The other ranks' watchdogs fire within one interval: let them report too before
                # this exit makes the launcher kill them.
                time.sleep(interval + 2.0)
                self._exit(STALL_EXIT_CODE)
                return
