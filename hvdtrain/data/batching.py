"""What follows from the data-parallel world and the global batch: this rank's loaders over its
shards, the global batch and the steps per epoch. Built at start, and again when Horovod elastic
re-forms the world (the global batch then follows the world, and so do the shards).

A training set that is a stream (hvdtrain.data.streaming) ends its epoch when the stream runs
out (``exhausted``, set by the loop), not at a count; its steps per epoch are known only when it
has a len(). Without one the run lasts train.epochs passes over it (or train.max_steps), and what
needs its length is refused by name: a warm-up in epochs, a schedule that decays to the run's end."""
from __future__ import annotations

from typing import Any, Callable, List, Optional

import torch
from torch.utils.data import DataLoader, Dataset

from hvdtrain.config.train import TrainConfig
from hvdtrain.data.sharding import LoaderFactory, ShardedSampler, sharded_loader
from hvdtrain.data.streaming import StreamShards, is_stream, stream_length
from hvdtrain.distributed.world import World


def pins_memory(setting: str, device: torch.device) -> bool:
    """train.pin_memory for a rank on ``device``: auto pins for a GPU only; true on a CPU is refused
    (pinned memory speeds host-to-GPU copies, and a CPU device makes none)."""
    if setting == "true" and device.type != "cuda":
        raise ValueError(f"train.pin_memory=true pins the batches for copies to a GPU, and this rank's device is "
                         f"{device.type}: set train.pin_memory=auto (pins only on a GPU) or false")
    return device.type == "cuda" if setting == "auto" else setting == "true"


class Batching:
    """This rank's view of the data for one world: loaders over its shards, whole global batches.

    Args:
        config: the run's settings (seed, loader workers, pinning, prefetch).
        world: the data-parallel view of the world: this rank's shard and the global batch.
        batch_size: samples per worker per micro-batch.
        train_dataset: the training set (map-style, or a stream).
        val_dataset: the validation set, or None.
        collate_fn: makes a batch of samples (None: torch's default).
        loader_factory: your own DataLoader over hvdtrain's sampler (sharding.own_loader).
    """

    def __init__(self, config: TrainConfig, world: World, batch_size: int, train_dataset: Dataset,
                 val_dataset: Optional[Dataset], collate_fn: Optional[Callable[[List[Any]], Any]] = None,
                 loader_factory: Optional[LoaderFactory] = None) -> None:
        self.config, self.collate_fn, self.loader_factory = config, collate_fn, loader_factory
        self.train_dataset, self.val_dataset = train_dataset, val_dataset
        self.streaming = is_stream(train_dataset)
        if loader_factory is not None and (self.streaming or (val_dataset is not None and is_stream(val_dataset))):
            raise ValueError("loader_factory builds loaders over hvdtrain's sampler, and a stream has none (its shards "
                             "are the dataset hvdtrain reads): pass collate_fn, and train.num_workers and "
                             "train.prefetch_factor, instead")
        if loader_factory is not None and collate_fn is not None:
            raise ValueError("give the loader its collate_fn in your loader_factory, not both (the factory's "
                             "DataLoader is used as it is)")
        # None: a stream without len() (its epochs end when it runs out; it may never).
        self.dataset_size: Optional[int] = (stream_length(train_dataset) if self.streaming
                                            else len(train_dataset))  # type: ignore[arg-type]
        self.exhausted = False  # a stream ran out in the current epoch (the loop sets it)
        self.rebuild(world, batch_size)

    def release_workers(self) -> None:
        """End the loaders' worker processes now (they persist between epochs; a later epoch starts
        new ones). Left to the garbage collector, a loader freed with the Trainer around it may be
        shut down after its own queues are: each worker then waits out torch's 5 s status interval
        before it is killed (10 s at the end of every run with 2 workers, measured)."""
        for loader in (getattr(self, "train_loader", None), getattr(self, "val_loader", None)):
            if loader is not None and getattr(loader, "_iterator", None) is not None:
                loader._iterator = None  # its __del__ stops the workers while the queues are still open

    def rebuild(self, world: World, batch_size: int) -> None:
        """Shards, loaders and steps for ``world`` (the data-parallel view) and this batch per worker."""
        config = self.config
        self.release_workers()  # the previous world's
        self.world, self.batch_size = world, batch_size
        self.train_loader: DataLoader = sharded_loader(
            self.train_dataset, batch_size, world.rank, world.size, config.seed,
            global_batch=self.global_batch_size, **self._loading(),
        )
        self.val_loader: Optional[DataLoader] = None
        if self.val_dataset is not None:
            self.val_loader = self.evaluation_loader(self.val_dataset)
        # Whole global batches only: every step is B x accumulation full micro-batches per rank.
        self.steps_per_epoch: Optional[int] = (None if self.dataset_size is None
                                               else self.dataset_size // self.global_batch_size)
        if config.warmup_steps is not None:
            self.warmup_steps = config.warmup_steps
        elif self.steps_per_epoch is None and config.warmup_epochs:
            raise ValueError(f"train.warmup_epochs={config.warmup_epochs:g} needs the steps of an epoch, and this "
                             f"stream has no len(): count the warm-up in steps (train.warmup_steps=N), or give the "
                             f"stream a __len__")
        else:
            self.warmup_steps = round(config.warmup_epochs * (self.steps_per_epoch or 0))
        # The run's last step, where a decaying LR schedule ends: the epochs', or max_steps if sooner;
        # None for a stream without len() and no max_steps (it ends when its passes do).
        self.total_steps = self.steps_for(config.max_steps)
        if self.total_steps is None and config.lr_schedule != "constant":
            raise ValueError(f"train.lr_schedule={config.lr_schedule} decays to the run's last step, and this stream "
                             f"({type(self.train_dataset).__name__}) has no len() to count it by: set train.max_steps "
                             f"(where the decay ends), give the stream a __len__, or use lr_schedule=constant")

    def _loading(self, collate_fn: Optional[Callable[[List[Any]], Any]] = None) -> dict:
        """How every loader of this run loads: the workers, pinning, prefetch, and the run's collate_fn or
        loader_factory; given another ``collate_fn``, that one with hvdtrain's loader."""
        config, own = self.config, collate_fn is None
        return {"num_workers": config.num_workers, "pin_memory": pins_memory(config.pin_memory, self.world.device),
                "collate_fn": self.collate_fn if own else collate_fn, "prefetch_factor": config.prefetch_factor,
                "loader_factory": self.loader_factory if own else None}

    def evaluation_loader(self, dataset: Dataset, batch_size: Optional[int] = None,
                          collate_fn: Optional[Callable[[List[Any]], Any]] = None) -> DataLoader:
        """``dataset`` cut into one shard per data-parallel rank, in order, each sample once: the
        validation set's loader, and any other set's (Session.loader). Batches of ``batch_size``, else
        train.eval_batch_size, else the training batch; the run's collate_fn (or loader_factory)
        unless another ``collate_fn`` is given."""
        size = batch_size or self.config.eval_batch_size or self.batch_size
        return sharded_loader(dataset, size, self.world.rank, self.world.size, self.config.seed,
                              **self._loading(collate_fn))

    def steps_for(self, limit: Optional[int]) -> Optional[int]:
        """The run's steps: the epochs' (when known), or ``limit`` if sooner; None when neither is
        known (a stream without len(), no limit)."""
        if self.steps_per_epoch is None:
            return limit
        every_epoch = self.config.epochs * self.steps_per_epoch
        return every_epoch if limit is None else min(limit, every_epoch)

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.config.accumulation * self.world.size

    @property
    def sampler(self) -> "ShardedSampler | StreamShards":
        """What the loop calls set_epoch(epoch, start) on: the sampler, or a stream's shards."""
        if self.streaming:
            return self.train_loader.dataset  # type: ignore[return-value]
        return self.train_loader.sampler  # type: ignore[return-value]

    def has_steps_left(self, epoch_position: int) -> bool:
        """Whether a whole global batch remains after ``epoch_position`` samples of the epoch (a
        stream: whether it has not run out yet)."""
        if self.streaming:
            return not self.exhausted
        return self.dataset_size - epoch_position >= self.global_batch_size

    def epoch_progress(self, epoch: int, epoch_position: int) -> float:
        """Epochs done, with the fraction of the current one when the dataset's size is known."""
        if not self.dataset_size:
            return float(epoch)
        return epoch + epoch_position / self.dataset_size

    def describe(self) -> str:
        return (f"global batch {self.global_batch_size} = {self.batch_size} x {self.config.accumulation} "
                f"accumulation x {self.world.size} workers; "
                + (f"{self.steps_per_epoch} steps/epoch" if self.steps_per_epoch is not None
                   else "a stream without len(): epochs end when it runs out"))
