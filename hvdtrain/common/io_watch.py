"""Checkpoint storage work in flight, each with its own clock, for the stall watchdog to watch.

A save is slow, not stuck, as long as its storage calls return; a save on a hung mount has one
that never does. Every storage section of a save or resume runs inside ``watching(path, kind)``:
an activity registered for as long as it runs, in whichever thread it runs (a background save's
writer thread and the lease's renewal thread as well as the training thread). Its clock restarts
with each sign of progress: each block a writer writes through ``activity.counting(handle)``,
each block a checksum reads, and each storage call that returns where the code says so
(``progress()``: after a poll, a removal, a rename). Activities nest (a save holds its files'
writes): progress inside restarts every enclosing clock too. A library call that does its I/O at
once (torch.load, safetensors) is one call: its clock runs from its start. A call that hangs, the
first ``open`` of the lease check as much as a write of the data, stops every clock of its thread.
The watchdog (hvdtrain.fault_tolerance.watchdog) looks at ``active()`` from its own thread every
few seconds; nothing here runs per training step, and progress costs a few assignments.
"""
from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional


class IOActivity:
    """Storage work in flight: its path, its kind ("write", "read", "checkpoint save", "lease
    renewal"...), the bytes moved so far, when it last progressed, and the activity it runs in."""

    def __init__(self, path: "os.PathLike | str", kind: str, parent: Optional["IOActivity"] = None) -> None:
        self.path, self.kind, self.parent = str(path), kind, parent
        self.started = self.last_progress = time.monotonic()
        self.bytes = 0
        self.thread = threading.current_thread().name
        self.depth = 0 if parent is None else parent.depth + 1

    def progress(self, count: int = 0) -> None:
        """``count`` more bytes moved, or a storage call returned: this activity and those it
        runs in are alive."""
        now = time.monotonic()
        activity: Optional[IOActivity] = self
        while activity is not None:
            activity.bytes += count
            activity.last_progress = now
            activity = activity.parent

    def silent_for(self, now: float) -> float:
        return now - self.last_progress

    def counting(self, handle: Any) -> "CountingFile":
        """``handle`` with its writes and reads counted as this activity's progress."""
        return CountingFile(handle, self)


class CountingFile:
    """A file handle whose ``write``/``read`` report their bytes to an activity; all else is the handle's."""

    def __init__(self, handle: Any, activity: IOActivity) -> None:
        self._handle, self._activity = handle, activity

    def write(self, data: Any) -> int:
        written = self._handle.write(data)
        self._activity.progress(written if isinstance(written, int) else memoryview(data).nbytes)
        return written

    def read(self, size: int = -1) -> bytes:
        data = self._handle.read(size)
        self._activity.progress(len(data))
        return data

    def __getattr__(self, name: str) -> Any:  # flush, fileno, seek, tell...
        return getattr(self._handle, name)


_lock = threading.Lock()
_active: Dict[int, IOActivity] = {}
_innermost = threading.local()  # this thread's innermost activity, as .activity


def current() -> Optional[IOActivity]:
    """The innermost activity of this thread, or None."""
    return getattr(_innermost, "activity", None)


@contextmanager
def watching(path: "os.PathLike | str", kind: str) -> Iterator[IOActivity]:
    """``path`` is worked on (``kind``) inside: an activity the watchdog sees until the block ends,
    nested in this thread's current one."""
    activity = IOActivity(path, kind, current())
    with _lock:
        _active[id(activity)] = activity
    _innermost.activity = activity
    try:
        yield activity
    finally:
        _innermost.activity = activity.parent
        with _lock:
            del _active[id(activity)]
        if activity.parent is not None:  # its end is a storage call that returned
            activity.parent.progress()


def progress(count: int = 0) -> None:
    """A storage call of this thread returned (``count`` bytes moved): its activities are alive.
    Outside any activity: nothing."""
    activity = current()
    if activity is not None:
        activity.progress(count)


def active() -> List[IOActivity]:
    """The activities in flight now, oldest first (read from the watchdog's thread)."""
    with _lock:
        return sorted(_active.values(), key=lambda activity: activity.started)
