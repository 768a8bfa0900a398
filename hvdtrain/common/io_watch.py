"""Checkpoint reads and writes in flight, each with its own clock, for the stall watchdog to watch.

A save is slow, not stuck, as long as its bytes move; a save on a hung mount moves none. Every
checkpoint file written or read runs inside ``watching(path, kind)``: an activity registered for
as long as it runs, in whichever thread it runs (a background save's writer thread as well as the
training thread). A writer writes through ``activity.counting(handle)``, which counts the bytes
and restarts the activity's clock with each write: the progress beat. A read that a library does
at once (torch.load, safetensors) is one activity without beats: its clock runs from its start.
The watchdog (hvdtrain.fault_tolerance.watchdog) looks at ``active()`` from its own thread every
few seconds; nothing here runs per training step, and a write costs two assignments more.
"""
from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List


class IOActivity:
    """One file being written or read: its path, the bytes moved so far, when the last one moved."""

    def __init__(self, path: "os.PathLike | str", kind: str) -> None:
        self.path, self.kind = str(path), kind  # kind: "write" or "read"
        self.started = self.last_progress = time.monotonic()
        self.bytes = 0
        self.thread = threading.current_thread().name

    def progress(self, count: int) -> None:
        """``count`` more bytes moved: the activity is alive."""
        self.bytes += count
        self.last_progress = time.monotonic()

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


@contextmanager
def watching(path: "os.PathLike | str", kind: str) -> Iterator[IOActivity]:
    """``path`` is written or read (``kind``) inside: an activity the watchdog sees until the block ends."""
    activity = IOActivity(path, kind)
    with _lock:
        _active[id(activity)] = activity
    try:
        yield activity
    finally:
        with _lock:
            del _active[id(activity)]


def active() -> List[IOActivity]:
    """The activities in flight now, oldest first (read from the watchdog's thread)."""
    with _lock:
        return sorted(_active.values(), key=lambda activity: activity.started)
