"""Horovod elastic: workers that die do not end the run, and workers that come back rejoin.

Launched with ``horovodrun --min-np --max-np --host-discovery-script`` (Gloo), every worker runs
the Trainer's loop inside ``hvd.elastic.run``. The Trainer commits its state every few steps (a
copy in memory, on every rank). When a worker dies, the survivors' collective fails, they roll
back to the last commit, Horovod forms a new world, the Trainer adapts to its size, and training
goes on. A worker that joins receives rank 0's state before its first step.
"""
from __future__ import annotations

import copy
import os
from typing import Any, Callable, Dict, Mapping

import horovod.torch as hvd
from horovod.common.elastic import State

from hvdtrain.distributed import startup as dist


def is_elastic_launch(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get("HOROVOD_ELASTIC") == "1"


class TrainerState(State):
    """The Trainer's model, optimizer and position, committed in memory and synced from rank 0.

    Not Horovod's TorchState: its optimizer sync initialises an empty optimizer state with a
    zero-gradient step (which moves parameters under weight decay); hvdtrain's broadcast does not.
    """

    def __init__(self, trainer: Any, on_reset: Callable[[], None]) -> None:
        super().__init__(bcast_object=hvd.broadcast_object, get_rank=hvd.rank)
        self.trainer = trainer
        self.register_reset_callbacks([on_reset])
        self.save()

    def _counters(self) -> Dict[str, int]:
        t = self.trainer
        return {"epoch": t.epoch, "step": t.step, "epoch_position": t.epoch_position}

    def _set_counters(self, counters: Dict[str, int]) -> None:
        for name, value in counters.items():
            setattr(self.trainer, name, value)

    def save(self) -> None:
        self._saved = copy.deepcopy({
            "model": self.trainer.model.state_dict(),
            "optimizer": self.trainer.optimizer.state_dict(),
            "counters": self._counters(),
        })

    def restore(self) -> None:
        self.trainer.model.load_state_dict(self._saved["model"])
        self.trainer.optimizer.load_state_dict(self._saved["optimizer"])
        self._set_counters(self._saved["counters"])

    def sync(self) -> None:
        dist.broadcast_model_and_optimizer(self.trainer.model, self.trainer.optimizer, root_rank=0)
        self._set_counters(dist.broadcast_state(self._counters(), root_rank=0, name="elastic.counters"))
        self.trainer._configure_lr()  # the LR schedule follows the step rank 0 is at
        # A rollback after this point returns to the synced state, not to this worker's own start.
        self.save()


def run(state: TrainerState, body: Callable[[], None]) -> None:
    """Run ``body`` (the training loop) until it returns, through every worker loss and join."""
    hvd.elastic.run(lambda _state: body())(state)
