"""Horovod's timeline for a few steps of a run, written into its run directory (Chrome trace format)."""
from __future__ import annotations

import logging
import os
import time
from typing import Optional, Tuple

from hvdtrain.distributed import collectives

from hvdtrain.distributed import startup
from hvdtrain.observability.run_directory import TIMELINE_FILE, RunDirectory


class TimelineWindow:
    """Horovod's timeline for a few steps, after 5 warm-up steps of this start.

    Every rank starts and stops it at the same step (both are collectives in Horovod).

    Args:
        steps: steps to record (train.timeline_steps); 0: none.
        first_step: the step this start begins at.
        run_dir: where the timeline is written (None: the working directory).
        log: where warnings go.
    """

    def __init__(self, steps: int, first_step: int, run_dir: Optional[RunDirectory], log: logging.Logger) -> None:
        self.log = log
        self.window: Optional[Tuple[int, int]] = None
        self._run_dir = run_dir
        self._file = ""
        if not steps:
            return
        if not startup.timeline_armed():
            log.warning(f"train.timeline_steps={steps} ignored: start Horovod with "
                        f"hvdtrain.init(config) (the run's TrainConfig) or hvdtrain.init(..., timeline=True) to record a timeline")
            return
        first = first_step + 5
        self.window = (first, first + steps)

    def _path(self) -> str:
        if self._run_dir is not None:
            return str(self._run_dir.path / TIMELINE_FILE)
        return os.path.abspath(f"horovod-timeline-{time.strftime('%Y%m%d-%H%M%S')}.json")

    def after_step(self, step: int) -> None:
        """Start or stop the timeline at the window's edges."""
        if self.window is None:
            return
        first, last = self.window
        if step == first:
            self._file = self._path()
            collectives.start_timeline(self._file)
        elif step == last:
            collectives.stop_timeline()
            self.window = None
            self.log.info(f"Horovod timeline of steps {first + 1}-{last} written to {self._file}: "
                          f"open it in https://ui.perfetto.dev or chrome://tracing (Load)")

    def close(self, step: int) -> None:
        """Training ended inside the window: close the file."""
        if self.window is not None and step >= self.window[0]:
            collectives.stop_timeline()
            self.window = None
