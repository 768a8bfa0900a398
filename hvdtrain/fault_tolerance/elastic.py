"""Horovod elastic: workers that die do not end the run, and workers that come back rejoin.

Launched with ``horovodrun --min-np --max-np --host-discovery-script`` (Gloo), the training loop
runs inside ``hvd.elastic.run``. The state is committed every few steps (a copy in memory, on every
rank). When a worker dies, the survivors' collective fails, they roll back to the last commit,
Horovod forms a new world, the Trainer follows it, and training goes on. A worker that joins
receives rank 0's state at the next sync, before its first step. Under zero1, zero2 and fsdp the
newest checkpoint takes the in-memory commit's place (CheckpointedElasticState).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Dict, Sequence

import torch

import horovod.torch as hvd
from horovod.common.elastic import State
from horovod.common.exceptions import HostsUpdatedInterrupt

from hvdtrain.distributed import collectives
from hvdtrain.components.position import Position
from hvdtrain.components.precision import Precision


@dataclass
class Commits:
    """When the loop commits the state survivors roll back to: every ``every`` steps, or, when the
    checkpoints are the commits (CheckpointedElasticState), right after each checkpoint; and at
    every epoch's end. A commit is also where Horovod raises to resize the world."""
    commit: Callable[[], None]
    every: int
    with_checkpoints: bool

    def after_step(self, step: int) -> None:
        if not self.with_checkpoints and step % self.every == 0:
            self.commit()

    def after_checkpoint(self) -> None:
        if self.with_checkpoints:
            self.commit()

    def at_epoch_end(self) -> None:
        self.commit()


class ElasticState(State):
    """The model, the optimizer, the position and fp16's loss scale, committed in memory and synced
    from rank 0 (a joining worker with its own scale would skip other steps than the rest).

    Not Horovod's TorchState: its optimizer sync initialises an empty optimizer state with a
    zero-gradient step (which moves parameters under weight decay); hvdtrain's broadcast does not.

    Args:
        model: the model, synced from rank 0.
        optimizer: its optimizer, synced from rank 0.
        position: the run's position (epoch, step).
        precision: holds fp16's loss scale.
        on_reset: runs after Horovod formed a new world.
        on_sync: run after rank 0's state arrived (collectives allowed: every rank syncs).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, position: Position,
                 precision: Precision, on_reset: Callable[[], None], on_sync: Sequence[Callable[[], None]]) -> None:
        super().__init__(bcast_object=hvd.broadcast_object, get_rank=hvd.rank)
        self.model, self.optimizer, self.position, self.precision = model, optimizer, position, precision
        self.on_sync = list(on_sync)
        self.register_reset_callbacks([on_reset])
        self.save()

    def save(self) -> None:
        self._saved = copy.deepcopy({
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "position": self.position.as_dict(),
            "precision": self.precision.state_dict(),
        })

    def restore(self) -> None:
        self.model.load_state_dict(self._saved["model"])
        self.optimizer.load_state_dict(self._saved["optimizer"])
        self.position.update(**self._saved["position"])
        self.precision.load_state_dict(self._saved["precision"])

    def sync(self) -> None:
        collectives.broadcast_model_and_optimizer(self.model, self.optimizer, root_rank=0)
        counters: Dict[str, int] = collectives.broadcast_state(self.position.as_dict(), root_rank=0, name="elastic.position")
        self.position.update(**counters)
        self.precision.load_state_dict(collectives.broadcast_object(self.precision.state_dict(), root_rank=0,
                                                                    name="elastic.precision"))
        for callback in self.on_sync:
            callback()
        # A rollback after this point returns to the synced state, not to this worker's own start.
        self.save()


class CheckpointedElasticState(State):
    """Under zero1, zero2 and fsdp, whose state is cut into one shard per worker: a lost worker takes its
    shard along, and every shard changes with the world, so a world change continues from the newest
    checkpoint, resharded for the new world, instead of an in-memory commit. The checkpoints are the
    commits: the loop commits (and so learns of added or removed hosts) right after each save.

    ``continue_from_checkpoint`` (every rank, collectives allowed) loads the newest checkpoint; at a
    fresh start, with none yet, it spreads rank 0's state and writes step 0's.
    """

    def __init__(self, continue_from_checkpoint: Callable[[], None], on_reset: Callable[[], None],
                 on_sync: Sequence[Callable[[], None]]) -> None:
        super().__init__(bcast_object=hvd.broadcast_object, get_rank=hvd.rank)
        self.continue_from_checkpoint = continue_from_checkpoint
        self.on_sync = list(on_sync)
        self.register_reset_callbacks([on_reset])

    def save(self) -> None:
        """Nothing to copy: the checkpoint just written is the commit."""

    def restore(self) -> None:
        """Nothing yet: the sync loads the newest checkpoint once the new world is formed."""

    def sync(self) -> None:
        self.continue_from_checkpoint()
        for callback in self.on_sync:
            callback()

    def check_host_updates(self) -> None:
        """Horovod skips the sync after hosts were only removed (the survivors' state is whole under
        ddp); here every survivor's shard changes with the world, so the sync runs then too."""
        try:
            super().check_host_updates()
        except HostsUpdatedInterrupt:
            raise HostsUpdatedInterrupt(False) from None


def run(state: State, body: Callable[[], None]) -> None:
    """Run ``body`` (the training loop) until it returns, through every worker loss and join."""
    hvd.elastic.run(lambda _state: body())(state)
