"""Rank 0's view of a running job: a tqdm bar on a terminal, plain lines in a batch log.

SLURM writes stdout to a file: a bar's carriage returns would fill it with thousands of
partial lines, so ``auto`` draws a bar only when rank 0's stderr is a terminal.
"""
from __future__ import annotations

import logging
import sys
import time
from typing import Mapping, Optional

from hvdtrain.observability.efficiency import describe


def resolve_mode(mode: str, is_root: bool, stream=None) -> str:
    """The display actually used: 'bar', 'log' or 'off' (other ranks show nothing)."""
    if not is_root:
        return "off"
    if mode == "auto":
        stream = stream or sys.stderr
        return "bar" if hasattr(stream, "isatty") and stream.isatty() else "log"
    return mode


def format_eta(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class Progress:
    """Steps done out of the run's; ``report`` adds the latest loss and rate every log_every steps.

    Args:
        mode: bar (tqdm), log (a line every log_every steps) or off.
        total: the run's optimizer steps (None: unknown, a stream without len(): no ETA).
        initial: the steps already done (a resumed run).
        logger: where log lines go.
    """

    def __init__(self, mode: str, total: Optional[int], initial: int, logger: logging.Logger) -> None:
        self.mode = mode
        self.total = total
        self._logger = logger
        self._first_step = initial
        self._started = time.perf_counter()
        self._bar = None
        if mode == "bar":
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                             file=sys.stderr, leave=True)

    def advance(self) -> None:
        """One optimizer step done: cheap (tqdm redraws at most a few times a second)."""
        if self._bar is not None:
            self._bar.update(1)

    def eta(self, step: int) -> Optional[float]:
        done = step - self._first_step
        if done <= 0 or self.total is None:
            return None
        return (time.perf_counter() - self._started) / done * max(0, self.total - step)

    def report(self, epoch: int, step: int, loss: float, lr: float, samples_per_sec: float,
               comm_fraction: float, efficiency: Optional[Mapping[str, float]] = None) -> None:
        """The latest figures: the bar's postfix, or a log line with the ETA.

        Args:
            epoch: the epoch, from 0 (as epochs() yields it).
            step: optimizer steps done.
            loss: the mean training loss since the last report.
            lr: the current learning rate.
            samples_per_sec: global samples per second.
            comm_fraction: the share of the time spent waiting for gradients.
            efficiency: tokens_per_sec, tflops_per_rank and mfu (hvdtrain.observability.efficiency).
        """
        efficiency = efficiency or {}
        if self._bar is not None:
            more = {"mfu": f"{efficiency['mfu']:.1%}"} if "mfu" in efficiency else {}
            self._bar.set_postfix(epoch=epoch, loss=f"{loss:.4f}", samples_s=f"{samples_per_sec:.0f}",
                                  comm=f"{comm_fraction:.0%}", **more, refresh=False)
        elif self.mode == "log":
            eta = self.eta(step)
            figures = describe(efficiency)
            self._logger.info(
                f"epoch {epoch} step {step}{'' if self.total is None else f'/{self.total}'} loss {loss:.4f} lr {lr:.4g} "
                f"{samples_per_sec:.0f} samples/s, {figures + ', ' if figures else ''}"
                f"{comm_fraction:.0%} waiting for gradients"
                + (f", ETA {format_eta(eta)}" if eta is not None else "")
            )

    def message(self, text: str) -> None:
        """A log line that does not tear the bar."""
        if self._bar is not None:
            self._bar.clear()
            self._logger.info(text)
            self._bar.refresh()
        else:
            self._logger.info(text)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
