"""One checkpoint write at a time in a background thread, its outcome kept for the training thread.

The thread runs no collective (Horovod's collectives belong to the training thread, in the same
order on every rank): whether a write failed is agreed across ranks when the training thread next
waits for it, at the next save or at the end of the run.
"""
from __future__ import annotations

import threading
from typing import Callable, Optional


class BackgroundWrite:
    """At most one write in flight; ``wait`` returns its failure (None when it succeeded)."""

    def __init__(self, name: str = "hvdtrain-checkpoint-writer") -> None:
        self.name = name
        self._thread: Optional[threading.Thread] = None
        self._failure: Optional[str] = None

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, write: Callable[[], None]) -> None:
        """Run ``write`` in the background; the previous write must have been waited for."""
        if self._thread is not None:
            raise RuntimeError("a checkpoint write is still in flight: wait() for it first")
        self._failure = None

        def run() -> None:
            try:
                write()
            except BaseException as error:  # noqa: BLE001 - reported to the training thread by wait()
                self._failure = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__

        # Not a daemon: an interpreter that exits waits for the write rather than leaving half a file.
        self._thread = threading.Thread(target=run, name=self.name, daemon=False)
        self._thread.start()

    def wait(self) -> Optional[str]:
        """Block until the write in flight (if any) ends; its failure, or None."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        failure, self._failure = self._failure, None
        return failure
