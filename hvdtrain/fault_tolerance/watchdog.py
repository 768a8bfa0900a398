"""A rank that stops taking steps ends the job, saying where every rank is stuck.

Horovod alone turns a rank that stops calling collectives into a silent hang (its stall check
does not fire under Gloo, nor for a frozen rank under MPI). Every rank runs this watchdog: the
training loop beats after each step; when no beat comes for ``timeout`` seconds, the watchdog
names the rank, host and last step, and the all-reduces this rank waits in, then ends the
process, and the launcher ends the job. The rank that stopped is the one waiting in none. It also
guards the Trainer's set-up (its collectives). While every rank saves or resumes, the step clock is
paused (a large save is slow, not stuck; the ranks that do not write wait for the one that does),
and each checkpoint file in flight is watched instead (hvdtrain.common.io_watch), in any thread (a
background save's too): a write whose bytes stop moving, or a read that does not end, for
``io_timeout`` seconds (train.checkpoint_timeout) is a stall too, reported with the file and the
bytes moved so far. So a rank stuck on a hung mount ends the job rather than hanging every rank.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, List, Optional

from hvdtrain.common import io_watch

STALL_EXIT_CODE = 75


class StallWatchdog:
    """Ends the process when the training loop's beats stop for ``timeout`` seconds (see the module's text).

    Args:
        timeout: seconds without a beat that count as a stall; 0: the steps are not watched.
        rank: this rank, for the message.
        host: its host, for the message.
        pending: the names of the collectives this rank waits in; None: not known (set-up).
        exit_process: ends the process with the exit code (os._exit; a stand-in in the tests).
        phase: what is guarded (training, set-up), for the message.
        io_timeout: seconds a checkpoint file in flight may move no byte (a read: may last) before
            it counts as a stall (train.checkpoint_timeout); 0: checkpoint I/O is not watched.
    """
    def __init__(self, timeout: float, rank: int, host: str, pending: Optional[Callable[[], List[str]]],
                 exit_process: Callable[[int], None] = os._exit, phase: str = "training",
                 io_timeout: float = 0.0) -> None:
        self.timeout, self.io_timeout = timeout, io_timeout
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
            # The strategy knows its gradient reductions only; the flight recorder sees every
            # Horovod operation this rank started and has not seen end (a metric, a broadcast).
            elsewhere = self.flight.in_flight() if self.flight is not None and not waiting else []
            where = (f"waiting in the all-reduce of {', '.join(waiting[:10])}"
                     + (f" and {len(waiting) - 10} more" if len(waiting) > 10 else "")
                     if waiting else
                     f"waiting in {', '.join(elsewhere[:3])}" if elsewhere else
                     "not waiting in any collective: THIS rank stopped calling them (stuck in data loading, "
                     "in user code, or in I/O)")
        finished = "nothing finished" if self.phase == "set-up" else "no step finished"
        return (f"[hvdtrain] STALL rank {self.rank} on {self.host}: {finished} for "
                f"{silent_for:.0f} s after step {self._step}; {where}. Ending the job "
                f"(stall_timeout={self.timeout:g} s).")

    def io_report(self, activity: io_watch.IOActivity, now: float) -> str:
        """The message for a checkpoint file in flight that stalled."""
        elapsed = now - activity.started
        if activity.kind == "write":
            what = (f"the checkpoint write of {activity.path} moved no byte for {activity.silent_for(now):.0f} s "
                    f"({activity.bytes} bytes written so far, {elapsed:.0f} s since it began)")
        else:
            what = f"the checkpoint read of {activity.path} has not ended after {elapsed:.0f} s"
            if activity.bytes:
                what += f" (no byte for {activity.silent_for(now):.0f} s, {activity.bytes} bytes read so far)"
        return (f"[hvdtrain] STALL rank {self.rank} on {self.host}: {what}, in thread {activity.thread}; its "
                f"file system may hang (a hung mount, a full quota). Ending the job "
                f"(checkpoint_timeout={self.io_timeout:g} s).")

    def stalled_io(self, now: float) -> Optional[io_watch.IOActivity]:
        """The oldest checkpoint file in flight silent for more than io_timeout seconds, if any."""
        if not self.io_timeout:
            return None
        return next((activity for activity in io_watch.active()
                     if activity.silent_for(now) > self.io_timeout), None)

    def stall_message(self) -> Optional[str]:
        """What ends the job now (the steps stopped outside a checkpoint, or a checkpoint file in
        flight stalled), or None."""
        now = time.monotonic()
        silent_for = now - self._last_beat
        if self.timeout and silent_for > self.timeout and not self._paused:
            return self.report(silent_for)
        activity = self.stalled_io(now)
        return self.io_report(activity, now) if activity is not None else None

    def _watch(self) -> None:
        shortest = min((t for t in (self.timeout, self.io_timeout) if t), default=5.0)
        interval = max(0.1, min(5.0, shortest / 5))
        while not self._stopped.wait(interval):
            message = self.stall_message()
            if message is not None:
                # The flight record goes with the report (where it was written); rank 0 then prints
                # the analysis once every rank's record is in.
                flight = self.flight
                print(message + (flight.on_stall() if flight is not None else ""), file=sys.stderr, flush=True)
                if flight is not None:
                    flight.verdict(within=interval + 2.0)
                # The other ranks' watchdogs fire within one interval: let them report too before
                # this exit makes the launcher kill them.
                time.sleep(interval + 2.0)
                self._exit(STALL_EXIT_CODE)
                return
