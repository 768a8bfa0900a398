"""The Trainer's checkpoints across ranks: rank 0 reads and writes, every rank receives by broadcast.

File handling (atomic writes, pruning, validation) is hvdtrain.checkpoint's; this module decides
who reads and writes, and what a resumed run on another worker count keeps (the global batch).
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Optional

from hvdtrain import dist
from hvdtrain.checkpoint import CheckpointStore
from hvdtrain.config import TrainConfig


class Checkpointing:
    """The checkpoints of one run, as seen by every rank of it."""

    def __init__(self, config: TrainConfig, world: dist.World, log: logging.Logger) -> None:
        self.config, self.world, self.log = config, world, log
        self.store = CheckpointStore(config.checkpoint_dir, keep=config.keep_checkpoints, log=log)

    def read_newest(self, broadcast: bool) -> Optional[Dict[str, Any]]:
        """Rank 0 reads the newest valid checkpoint; every rank receives it by broadcast.

        Without ``broadcast`` (Horovod elastic set-up, which must run no collective) only rank 0
        holds it; the elastic sync gives the others rank 0's state instead.
        """
        found = None
        if self.world.is_root:
            newest = self.store.read_newest_valid()
            if newest is not None:
                path, found = newest
                self.log.info(f"resuming from {path}")
        return dist.broadcast_state(found, root_rank=0, name="checkpoint") if broadcast else found

    def batch_per_worker(self, resumed: Optional[Dict[str, Any]], elastic: bool) -> int:
        """A run resumed on another worker count keeps the checkpoint's global batch, so each
        worker's batch follows from it (under elastic, the global batch follows the world)."""
        cfg, size = self.config, self.world.size
        if resumed is None or elastic or resumed["world_size"] == size:
            return cfg.batch_size
        global_batch = resumed["global_batch"]
        if global_batch % (size * cfg.accumulation):
            raise ValueError(
                f"the checkpoint's global batch {global_batch} (written by {resumed['world_size']} "
                f"workers) cannot be split over {size} workers x {cfg.accumulation} accumulation: "
                f"resume on a worker count that divides it, or start a new run"
            )
        per_worker = global_batch // (size * cfg.accumulation)
        self.log.warning(
            f"resuming a {resumed['world_size']}-worker checkpoint on {size} workers: the global batch "
            f"stays {global_batch}, so each worker now takes {per_worker} samples per micro-batch"
        )
        return per_worker

    def save(self, state: Dict[str, Any], step: int) -> None:
        """Rank 0 writes; the others wait at the barrier, so no rank runs ahead of a save."""
        if self.world.is_root:
            path = self.store.save(state, step)
            self.log.info(f"checkpoint {path}")
        dist.barrier()
