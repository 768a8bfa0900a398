"""What follows from the world size and the global batch: this rank's loaders, the steps per epoch,
and the learning rate scaled to the global batch with its warm-up.

They change together: built once at start, and again when Horovod elastic re-forms the world
(the global batch then follows the world, and so do the shards and the rate).
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader, Dataset

from hvdtrain.distributed import startup as dist
from hvdtrain.config.train import TrainConfig
from hvdtrain.data.sharding import ShardedSampler, sharded_loader
from hvdtrain.distributed.startup import World
from hvdtrain.training.lr import adasum_lr_factor, lr_scale, set_scaled_lr, warmup_factor


class Batching:
    """This rank's view of the data for one world: loaders over its shards, whole global batches."""

    def __init__(self, config: TrainConfig, world: World, batch_size: int, train_dataset: Dataset,
                 val_dataset: Optional[Dataset]) -> None:
        self.config, self.world, self.batch_size = config, world, batch_size
        self.dataset_size = len(train_dataset)  # type: ignore[arg-type]
        pin = world.device.type == "cuda"
        self.train_loader: DataLoader = sharded_loader(
            train_dataset, batch_size, world.rank, world.size, config.seed,
            global_batch=self.global_batch_size, num_workers=config.num_workers, pin_memory=pin,
        )
        self.val_loader: Optional[DataLoader] = None
        if val_dataset is not None:
            self.val_loader = sharded_loader(val_dataset, batch_size, world.rank, world.size, config.seed,
                                             num_workers=config.num_workers, pin_memory=pin)
        # Whole global batches only: every step is B x accumulation full micro-batches per rank.
        self.steps_per_epoch = self.dataset_size // self.global_batch_size
        self.warmup_steps = round(config.warmup_epochs * self.steps_per_epoch)

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.config.accumulation * self.world.size

    @property
    def sampler(self) -> ShardedSampler:
        return self.train_loader.sampler  # type: ignore[return-value]

    def has_steps_left(self, epoch_position: int) -> bool:
        """Whether a whole global batch remains after ``epoch_position`` samples of the epoch."""
        return self.dataset_size - epoch_position >= self.global_batch_size

    def describe(self, lr_scale: float) -> str:
        cfg = self.config
        return (f"global batch {self.global_batch_size} = {self.batch_size} x {cfg.accumulation} "
                f"accumulation x {self.world.size} workers; {self.steps_per_epoch} steps/epoch; "
                f"lr {cfg.lr:g} x {lr_scale:g} after {self.warmup_steps} warm-up steps; "
                f"strategy {cfg.strategy}; reduction {cfg.reduction}{self._adasum_rule()}")

    def _adasum_factor(self) -> int:
        return adasum_lr_factor(self.world.device.type, dist.nccl_built(), self.world.local_size)

    def _adasum_rule(self) -> str:
        """The LR rule under Adasum, for the start line."""
        if self.config.reduction != "adasum" or not self.config.scale_lr:
            return ""
        factor = self._adasum_factor()
        how = (f" x {factor} GPUs per host: Horovod's rule for Adasum with NCCL, which averages within a host"
               if factor > 1 else ": Horovod's rule for Adasum over MPI")
        return (f" (the lr is not scaled by the {self.world.size} workers, only by one worker's batch x "
                f"accumulation{how})")

    def lr_schedule(self, optimizer: torch.optim.Optimizer, base_lrs: Sequence[float],
                    step: int) -> Tuple[float, LambdaLR]:
        """(scale, scheduler): one worker's rates times how many one-worker batches a step sees
        (linear scaling; under Adasum, only this worker's own, see hvdtrain.training.lr), reached by a
        linear warm-up from the one-worker rate; the scheduler continues at ``step``."""
        cfg = self.config
        adasum_factor = self._adasum_factor() if cfg.reduction == "adasum" else 1
        scale = lr_scale(self.global_batch_size, cfg.batch_size, cfg.scale_lr, cfg.reduction, self.world.size,
                         adasum_factor)
        set_scaled_lr(optimizer, base_lrs, scale)
        return scale, LambdaLR(optimizer, warmup_factor(scale, self.warmup_steps), last_epoch=step - 1)
