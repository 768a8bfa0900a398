"""Callbacks: your own code at the loop's usual points (hvdtrain.Trainer(callbacks=[...])).

Every rank calls every hook, in the callbacks' order, with the same arguments: the metrics are
means over every rank's samples, so what a callback decides from them it decides on every rank
alike (EarlyStopping does). A stop is agreed all the same (an all-reduce after each evaluation,
at each epoch's end, and every train.preempt_check_every steps in the preemption vote, which carries
it): a rank that asks alone stops the
run on every rank at the next such point, never a hang. A stopped run ends as at max_steps, with a
checkpoint of the step it stopped at.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence

import torch

from hvdtrain.distributed import collectives


class Callback:
    """Override the hooks you need; each gets the Trainer first (``trainer.request_stop(why)``
    ends training at the next agreement point)."""

    def on_train_start(self, trainer: Any) -> None:
        """fit() begins (also a fit() that continues a resumed run)."""

    def on_step_end(self, trainer: Any, step: int) -> None:
        """An optimizer step is done; ``step`` counts them from the run's start."""

    def on_log(self, trainer: Any, step: int, metrics: Dict[str, float]) -> None:
        """Every log_every steps: the training metrics' means over the window, over every rank."""

    def on_evaluation_end(self, trainer: Any, step: int, metrics: Dict[str, float]) -> None:
        """The validation metrics (val_loss, val_<metric>), at eval_every steps and each epoch's end."""

    def on_epoch_end(self, trainer: Any, record: Dict[str, float]) -> None:
        """The epoch's record, as metrics.jsonl holds it (train and validation metrics, samples/s, lr)."""

    def on_checkpoint(self, trainer: Any, step: int) -> None:
        """A checkpoint of ``step`` was written (asynchronous saves: handed to the writer)."""

    def on_train_end(self, trainer: Any, history: List[Dict[str, float]]) -> None:
        """fit() is over (steps or epochs reached, a stop, or a preemption); ``history``: its epoch records."""


class Callbacks:
    """A Trainer's callbacks, and a stop one of them asked for."""

    def __init__(self, trainer: Any, callbacks: Sequence[Callback]) -> None:
        for callback in callbacks:
            if not isinstance(callback, Callback):
                raise TypeError(f"callbacks must be hvdtrain Callback instances (subclass hvdtrain.Callback), "
                                f"got {type(callback).__name__}")
        self.trainer, self.callbacks = trainer, list(callbacks)
        self.stop_reason: Optional[str] = None

    def call(self, hook: str, *args: Any) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(self.trainer, *args)

    def request_stop(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason

    def stop_agreed(self, name: str) -> bool:
        """True on every rank when a callback asked on any rank (a collective: every rank calls it,
        with or without callbacks of its own)."""
        votes = collectives.allreduce_sum(torch.tensor([int(self.stop_reason is not None)]), name=name)
        return self.agreed(bool(int(votes[0])))

    def agreed(self, stop: bool) -> bool:
        """``stop``, as every rank voted it; a rank whose own callbacks did not ask learns why it stops."""
        if stop and self.stop_reason is None:
            self.stop_reason = "a callback on another rank asked to stop"
        return stop


class EarlyStopping(Callback):
    """Stop when ``monitor`` (a validation metric, e.g. val_loss) has not improved by more than
    ``min_delta`` for ``patience`` evaluations in a row; ``mode`` min or max says which way is better.
    Evaluations happen at each epoch's end, and every train.eval_every steps when set."""

    def __init__(self, monitor: str = "val_loss", mode: str = "min", patience: int = 3, min_delta: float = 0.0) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"EarlyStopping(mode=...) must be 'min' or 'max', got {mode!r}")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ValueError(f"EarlyStopping(patience=...) must be a whole number >= 1, got {patience!r}")
        if not (math.isfinite(min_delta) and min_delta >= 0):
            raise ValueError(f"EarlyStopping(min_delta=...) must be a finite number >= 0, got {min_delta!r}")
        self.monitor, self.mode, self.patience, self.min_delta = monitor, mode, patience, min_delta
        self.best: Optional[float] = None
        self.best_step: Optional[int] = None
        self.waited = 0

    def on_evaluation_end(self, trainer: Any, step: int, metrics: Dict[str, float]) -> None:
        if self.monitor not in metrics:
            raise ValueError(f"EarlyStopping monitors {self.monitor!r}, which the evaluation does not report: "
                             f"it reports {', '.join(sorted(metrics)) or 'nothing (no validation set?)'}")
        value = metrics[self.monitor]
        if self.best is None or self._better(value, self.best):
            self.best, self.best_step, self.waited = value, step, 0
            return
        self.waited += 1
        if self.waited >= self.patience:
            trainer.request_stop(f"early stopping: {self.monitor} has not improved on {self.best:.6g} (step "
                                 f"{self.best_step}) by more than {self.min_delta:g} in {self.waited} evaluations")

    def _better(self, value: float, best: float) -> bool:
        return value < best - self.min_delta if self.mode == "min" else value > best + self.min_delta
