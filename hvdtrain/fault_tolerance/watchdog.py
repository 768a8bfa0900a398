"""A rank that stops taking steps ends the job, saying where every rank is stuck.

Horovod alone turns a rank that stops calling collectives into a silent hang (its stall check
does not fire under Gloo, nor for a frozen rank under MPI). Every rank runs this watchdog: the
training loop beats after each step; when no beat comes for ``timeout`` seconds, the watchdog
names the rank, host and last step, and the all-reduces this rank waits in, then ends the
process, and the launcher ends the job. The rank that stopped is the one waiting in none. It also
guards the Trainer's set-up (its collectives). While every rank saves or resumes, the step clock is
paused (a large save is slow, not stuck; the ranks that do not write wait for the one that does),
and the storage work of the save or resume is watched instead (hvdtrain.common.io_watch), in any
thread (a background save's, the lease's renewal too): a storage call that does not return, or a
write whose bytes stop moving, for ``io_timeout`` seconds (train.checkpoint_timeout) is a stall too,
reported with the innermost work stuck (its file, the bytes moved so far). So a rank stuck on a
hung mount ends the job rather than hanging every rank.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Iterator, List, Optional

from hvdtrain.common import io_watch

if TYPE_CHECKING:
    from hvdtrain.fault_tolerance.flight import FlightRecording

STALL_EXIT_CODE = 75
# Seconds a stalled rank gives its flight record before it exits without it. A full record (2 x 2048
# entries and the stacks) is under 1 MB, written once: 0.07 s on a local disk, well under a second
# on a file system that answers, even a loaded parallel one; one silent for 5 s is taken to hang.
FLIGHT_DUMP_SECONDS = 5.0


class StallWatchdog:
    """Ends the process when the training loop's beats stop for ``timeout`` seconds (see the module's text).

    Args:
        timeout: seconds without a beat that count as a stall; 0: the steps are not watched.
        rank: this rank, for the message.
        host: its host, for the message.
        pending: the names of the collectives this rank waits in; None: not known (set-up).
        exit_process: ends the process with the exit code (os._exit; a stand-in in the tests).
        phase: what is guarded (training, set-up), for the message.
        io_timeout: seconds a checkpoint's storage call may not return (a write: move no byte)
            before it counts as a stall (train.checkpoint_timeout); 0: checkpoint I/O is not watched.
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
        """The message for storage work in flight that stalled."""
        elapsed = now - activity.started
        if activity.kind == "write":
            what = (f"the checkpoint write of {activity.path} moved no byte for {activity.silent_for(now):.0f} s "
                    f"({activity.bytes} bytes written so far, {elapsed:.0f} s since it began)")
        elif activity.kind == "read":
            what = f"the checkpoint read of {activity.path} has not ended after {elapsed:.0f} s"
            if activity.bytes:
                what += f" (no byte for {activity.silent_for(now):.0f} s, {activity.bytes} bytes read so far)"
        else:
            what = (f"the {activity.kind} of {activity.path} is stuck in a storage call: none returned for "
                    f"{activity.silent_for(now):.0f} s ({elapsed:.0f} s since it began)")
        return (f"[hvdtrain] STALL rank {self.rank} on {self.host}: {what}, in thread {activity.thread}; its "
                f"file system may hang (a hung mount, a full quota). Ending the job "
                f"(checkpoint_timeout={self.io_timeout:g} s).")

    def stalled_io(self, now: float) -> Optional[io_watch.IOActivity]:
        """Storage work in flight silent for more than io_timeout seconds, if any: of the work
        stuck, the innermost (a save's file write rather than the save), the one named."""
        if not self.io_timeout:
            return None
        stuck = [activity for activity in io_watch.active() if activity.silent_for(now) > self.io_timeout]
        return max(stuck, key=lambda activity: activity.depth, default=None)

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
                self._end_job(message, grace=interval + 2.0)
                return

    def _end_job(self, message: str, grace: float) -> None:
        """The STALL line, the flight record (bounded), then the exit, whatever the record does.

        The line goes out first and alone: the record is written into the run directory, which may be
        on the very mount that hangs (a blocked mkdir never returns, and no thread can be cancelled).
        ``grace``: one watchdog interval plus 2 s. The other ranks' watchdogs fire within one interval
        of this one: rank 0 waits that long for their records, and every rank waits it again before
        this exit (the launcher then kills every rank), so their reports are not cut short."""
        print(message, file=sys.stderr, flush=True)
        recorded = self.flight is None or self._record_flight(self.flight, grace)
        if recorded:  # (a record that did not end in time was waited for longer than the grace already)
            time.sleep(grace)
        self._exit(STALL_EXIT_CODE)

    def _record_flight(self, flight: "FlightRecording", grace: float) -> bool:
        """This rank's flight record, where it went, and (rank 0) the verdict, written by a daemon
        thread given FLIGHT_DUMP_SECONDS plus ``grace`` (rank 0's wait for the others' records).
        False: it had not ended by then (it goes on, and dies with the process)."""
        def record() -> None:
            where = flight.on_stall()
            if where:
                print(f"[hvdtrain] STALL rank {self.rank} on {self.host}: {where}", file=sys.stderr, flush=True)
            flight.verdict(within=grace)
        bound = FLIGHT_DUMP_SECONDS + grace
        writer = threading.Thread(target=record, name="hvdtrain-stall-record", daemon=True)
        writer.start()
        writer.join(bound)
        if writer.is_alive():
            print(f"[hvdtrain] STALL rank {self.rank} on {self.host}: flight record not written in {bound:.0f} s "
                  f"(the run directory's file system may hang too); ending the job without it", file=sys.stderr,
                  flush=True)
            return False
        return True
