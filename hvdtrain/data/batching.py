"""What follows from the data-parallel world and the global batch: this rank's loaders over its
shards, the global batch and the steps per epoch. Built at start, and again when Horovod elastic
re-forms the world (the global batch then follows the world, and so do the shards)."""
from __future__ import annotations

from typing import Any, Callable, List, Optional

from torch.utils.data import DataLoader, Dataset

from hvdtrain.config.train import TrainConfig
from hvdtrain.data.sharding import ShardedSampler, sharded_loader
from hvdtrain.distributed.world import World


class Batching:
    """This rank's view of the data for one world: loaders over its shards, whole global batches."""

    def __init__(self, config: TrainConfig, world: World, batch_size: int, train_dataset: Dataset,
                 val_dataset: Optional[Dataset], collate_fn: Optional[Callable[[List[Any]], Any]] = None) -> None:
        self.config, self.collate_fn = config, collate_fn
        self.train_dataset, self.val_dataset = train_dataset, val_dataset
        self.dataset_size = len(train_dataset)  # type: ignore[arg-type]
        self.rebuild(world, batch_size)

    def rebuild(self, world: World, batch_size: int) -> None:
        """Shards, loaders and steps for ``world`` (the data-parallel view) and this batch per worker."""
        config = self.config
        self.world, self.batch_size = world, batch_size
        loading = {"num_workers": config.num_workers, "pin_memory": world.device.type == "cuda",
                   "collate_fn": self.collate_fn, "prefetch_factor": config.prefetch_factor}
        self.train_loader: DataLoader = sharded_loader(
            self.train_dataset, batch_size, world.rank, world.size, config.seed,
            global_batch=self.global_batch_size, **loading,
        )
        self.val_loader: Optional[DataLoader] = None
        if self.val_dataset is not None:
            self.val_loader = sharded_loader(self.val_dataset, config.eval_batch_size or batch_size, world.rank,
                                             world.size, config.seed, **loading)
        # Whole global batches only: every step is B x accumulation full micro-batches per rank.
        self.steps_per_epoch = self.dataset_size // self.global_batch_size
        self.warmup_steps = round(config.warmup_epochs * self.steps_per_epoch)
        # The run's last step, where a decaying LR schedule ends: the epochs', or max_steps if sooner.
        every_epoch = config.epochs * self.steps_per_epoch
        self.total_steps = every_epoch if config.max_steps is None else min(config.max_steps, every_epoch)

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.config.accumulation * self.world.size

    @property
    def sampler(self) -> ShardedSampler:
        return self.train_loader.sampler  # type: ignore[return-value]

    def has_steps_left(self, epoch_position: int) -> bool:
        """Whether a whole global batch remains after ``epoch_position`` samples of the epoch."""
        return self.dataset_size - epoch_position >= self.global_batch_size

    def describe(self) -> str:
        return (f"global batch {self.global_batch_size} = {self.batch_size} x {self.config.accumulation} "
                f"accumulation x {self.world.size} workers; {self.steps_per_epoch} steps/epoch")
