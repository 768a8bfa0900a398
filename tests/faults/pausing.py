"""A paused process: stopped (SIGSTOP) at a chosen point, continued (SIGCONT) later.

    with pause_when_blocked(mount, owner) as paused:  # owner stopped right after its stopped call
        ...                                           # another host takes over meanwhile
    # leaving the block continues it (or paused.resume() earlier)

The owner an operator's ``scontrol suspend`` or a stalled node leaves behind: it checked its lease,
then did nothing for a while, then goes on from where it was.
"""
import os
import signal
import time
from typing import Union

from tests.faults.hung_mount import Call, HungMount
from tests.faults.processes import started_by, thread_states

POLL_SECONDS = 0.02
STOPPED = ("T", "t")  # stopped by a signal, or by a tracer


class Paused:
    """A process stopped by SIGSTOP; ``resume`` (or leaving the ``with`` block) sends SIGCONT."""

    def __init__(self, pid: int, call: Union[Call, None] = None):
        self.pid = pid
        self.call = call  # the call it was stopped after, when pause_when_blocked chose the moment
        self.resumed = False

    def resume(self) -> None:
        if not self.resumed:
            self.resumed = True
            try:
                os.kill(self.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass  # it ended (killed while stopped): nothing to continue

    def __enter__(self) -> "Paused":
        return self

    def __exit__(self, *exc_info) -> None:
        self.resume()


def pid_of(process) -> int:
    """The pid of a Popen, or the pid itself."""
    return process if isinstance(process, int) else process.pid


def pause(process, timeout: float = 10.0) -> Paused:
    """Stops ``process`` (a Popen or a pid) and waits until every thread of it has stopped."""
    pid = pid_of(process)
    os.kill(pid, signal.SIGSTOP)
    paused = Paused(pid)
    _wait_until_stopped(paused, timeout)
    return paused


def pause_when_blocked(mount: HungMount, process, timeout: float = 30.0) -> Paused:
    """Waits until ``process`` (a Popen or a pid), or a process it started, has a call stopped on
    ``mount``; stops that process (SIGSTOP), releases the mount and waits until all its threads
    have stopped. The stopped call then has returned, and nothing of the process after it ran;
    its other threads would have gone on with their calls, were it running. Every other stopped
    call of the mount goes on too."""
    root = pid_of(process)
    deadline = time.monotonic() + timeout
    while True:
        mine = [call for call in mount.blocked() if started_by(call.pid, root)]
        if mine:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {root} had no call stopped on {mount.path} within {timeout} s")
        time.sleep(POLL_SECONDS)
    call = mine[0]
    os.kill(call.pid, signal.SIGSTOP)
    paused = Paused(call.pid, call)
    try:
        mount.release()
        _wait_until_stopped(paused, max(deadline - time.monotonic(), 5.0))
    except BaseException:
        paused.resume()
        raise
    return paused


def _wait_until_stopped(paused: Paused, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        states = thread_states(paused.pid)
        if not states or any(state in "ZX" for state in states.values()):
            raise RuntimeError(f"process {paused.pid} ended instead of stopping")
        if all(state in STOPPED for state in states.values()):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {paused.pid} did not stop within {timeout} s: threads {states}")
        time.sleep(POLL_SECONDS)
