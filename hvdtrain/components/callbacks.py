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

import contextlib
import math
from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch

from hvdtrain.distributed import collectives


class Callback:
    """Override the hooks you need; each gets the Trainer first (or, in your own loop, the Session:
    ``trainer.request_stop(why)`` ends training at the next agreement point)."""

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

    # State that must survive a resume (the EMA's averages): kept per rank in every checkpoint (full
    # and sharded), given back to the same rank of a run resumed on the same layout.

    def state_dict(self) -> Optional[Dict[str, Any]]:
        """This rank's state to checkpoint, or None when there is none (the default)."""
        return None

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """This rank's state from a checkpoint of the same layout (workers, mesh)."""

    def discard_state(self) -> None:
        """A checkpoint of another layout was loaded (another worker count or strategy; Horovod elastic
        after a world change): this rank's state no longer fits what it holds; start it anew."""


class Callbacks:
    """A Trainer's (or Session's) callbacks, and a stop one of them asked for; ``trainer`` is what
    each hook is given first, the object the user holds."""

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

    def state_dict(self) -> Dict[str, Any]:
        """This rank's callbacks' states, by position and class (a list reordered is refused on load)."""
        states = {self._key(index, callback): callback.state_dict() for index, callback in enumerate(self.callbacks)}
        return {key: state for key, state in states.items() if state is not None}

    def load_state_dict(self, states: Dict[str, Any]) -> None:
        keys = {self._key(index, callback): callback for index, callback in enumerate(self.callbacks)}
        unknown = sorted(set(states) - set(keys))
        if unknown:
            raise ValueError(f"the checkpoint holds state for callbacks {', '.join(unknown)}, which this run does not "
                             f"have (it has {', '.join(keys) or 'none'}): pass the same callbacks, in the same order")
        for key, state in states.items():
            keys[key].load_state_dict(state)

    def discard_state(self) -> None:
        for callback in self.callbacks:
            callback.discard_state()

    @staticmethod
    def _key(index: int, callback: Callback) -> str:
        return f"{index}.{type(callback).__name__}"

    def forget_stop(self) -> None:
        """A stop ends one fit() (or one epochs()); the next one trains again."""
        self.stop_reason = None

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
    """Stop when a validation metric has not improved for a few evaluations in a row.
    Evaluations happen at each epoch's end, and every train.eval_every steps when set.

    Args:
        monitor: the validation metric, e.g. val_loss.
        mode: min or max: which way is better.
        patience: evaluations in a row without improvement before stopping.
        min_delta: the least change that counts as an improvement.
    """

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


class EMA(Callback):
    """An exponential moving average of the weights, updated after every optimizer step:
    ``average = decay * average + (1 - decay) * weights``, starting from the weights at the first fit().

    Each rank averages what it holds (``Strategy.owned_parameters``): the whole model under ddp and
    ps; its slices of the flat buckets under zero1, zero2 and fsdp (1/N of the model each, nothing
    gathered); its slices and stage under tensor and pipeline parallelism. The averages go into every
    checkpoint with the rank's own state (sharded where the checkpoint is) and resume bitwise on the
    same layout; a run resumed on another layout starts its averages anew from the loaded weights.
    Buffers (batch-norm statistics) are not averaged: they are used as they are.

    Evaluate or export with the averages swapped in, every rank alike (zero1/zero2 gather them)::

        ema = EMA(decay=0.999)
        trainer = Trainer(..., callbacks=[ema]); trainer.fit()
        with ema.applied(trainer):
            metrics = trainer.evaluate()
            weights = trainer.strategy.exported_model_state()   # or trainer.export_hf(directory)

    Parameters in half precision are averaged in float32; the others in their own dtype.
    """

    def __init__(self, decay: float = 0.999) -> None:
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA(decay=...) must be a number in [0, 1) (e.g. 0.999: about the last 1000 steps), "
                             f"got {decay!r}")
        self.decay = float(decay)
        self.averages: Optional[List[torch.Tensor]] = None
        self.updates = 0  # steps averaged since the averages started
        self._on_device = True  # false after a load: the averages come on the CPU

    def on_train_start(self, trainer: Any) -> None:
        if self.averages is None:  # not resumed from a checkpoint of this layout
            self.averages = [_averaging_copy(tensor) for tensor in trainer.strategy.owned_parameters()]

    def on_step_end(self, trainer: Any, step: int) -> None:
        if self.averages is None:  # discarded mid-run (a checkpoint of another layout): start from here
            self.on_train_start(trainer)
        weights = self._held(trainer)
        with torch.no_grad():
            for average, weight in zip(self.averages, weights):
                average.mul_(self.decay).add_(weight.detach().to(average.dtype), alpha=1.0 - self.decay)
        self.updates += 1

    @contextlib.contextmanager
    def applied(self, trainer: Any) -> Iterator[None]:
        """The model holds the averages inside the block, its trained weights again after it (bitwise).
        Every rank enters it (zero1/zero2 gather the averaged slices: a collective)."""
        weights = self._held(trainer)
        trained = [weight.detach().clone() for weight in weights]
        with torch.no_grad():
            for weight, average in zip(weights, self.averages):
                weight.copy_(average)
        trainer.strategy.owned_parameters_changed()
        try:
            yield
        finally:
            with torch.no_grad():
                for weight, kept in zip(weights, trained):
                    weight.copy_(kept)
            trainer.strategy.owned_parameters_changed()

    def state_dict(self) -> Optional[Dict[str, Any]]:
        if self.averages is None:
            return None
        return {"decay": self.decay, "updates": self.updates,
                "averages": [average.detach().cpu().clone() for average in self.averages]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state["decay"] != self.decay:
            raise ValueError(f"the checkpoint's EMA has decay {state['decay']:g}, this run's EMA {self.decay:g}: "
                             f"resume with EMA(decay={state['decay']:g}), or start a new run")
        self.averages, self.updates = list(state["averages"]), state["updates"]
        self._on_device = False

    def discard_state(self) -> None:
        self.averages, self.updates = None, 0

    def _held(self, trainer: Any) -> List[torch.Tensor]:
        """The rank's parameters, checked against the averages (and the averages put on their device)."""
        if self.averages is None:
            raise RuntimeError("the EMA has no averages yet: it starts at fit() (pass it in Trainer(callbacks=[...]))")
        weights = trainer.strategy.owned_parameters()
        shapes = [tuple(weight.shape) for weight in weights]
        if shapes != [tuple(average.shape) for average in self.averages]:
            raise ValueError(f"the EMA's averages do not fit the parameters this rank holds ({len(self.averages)} "
                             f"tensors vs {len(weights)}): the model, strategy or worker count changed without a "
                             f"resume through the Trainer's checkpoints; build a new EMA")
        if not self._on_device:
            self.averages = [average.to(weight.device) for average, weight in zip(self.averages, weights)]
            self._on_device = True
        return weights


def _averaging_copy(tensor: torch.Tensor) -> torch.Tensor:
    dtype = torch.float32 if tensor.dtype in (torch.float16, torch.bfloat16) else tensor.dtype
    return tensor.detach().to(dtype=dtype, copy=True)
