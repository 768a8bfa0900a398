"""Sharding a dataset across ranks.

Why not torch's DistributedSampler: hvdtrain needs a global sample order that is a function of
(seed, epoch) alone, so that global batch k holds the same samples at any number of workers
(the equivalence of N workers x batch B with one process x batch N*B rests on it, and so does
resuming on another world size), and a start position inside an epoch for exact resume.

The epoch's permutation: up to LISTED_ORDER_LIMIT samples torch.randperm's (one int per sample,
kept while the epoch runs); beyond it a keyed Feistel permutation computed position by position
(FeistelOrder), so a shard of a billion samples takes no more memory than one of a thousand. Which
one depends on the dataset's size alone: every rank and every world size draws the same order.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, List, Optional

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

LISTED_ORDER_LIMIT = 2 ** 24  # 16.8M samples: a 128 MiB index tensor; above, FeistelOrder
CHUNK = 2 ** 16  # positions permuted at a time by FeistelOrder
_MASK32 = 0xFFFFFFFF


class FeistelOrder:
    """A permutation of range(size) keyed by ``key``, computed for any positions on demand (O(1)
    memory): a 4-round Feistel network over the smallest even number of bits that covers size,
    and cycle walking (a position mapped outside range(size) is mapped again, under 4 times on
    average) to stay inside. Each round function is murmur3's 32-bit finalizer."""

    ROUNDS = 4

    def __init__(self, size: int, key: int) -> None:
        self.size = size
        self.half_bits = max(1, ((size - 1).bit_length() + 1) // 2)
        generator = torch.Generator().manual_seed(key)
        self.keys = torch.randint(0, 2 ** 32, (self.ROUNDS,), generator=generator, dtype=torch.int64).tolist()

    def __call__(self, positions: torch.Tensor) -> torch.Tensor:
        values = positions.to(torch.int64)
        outside = torch.ones_like(values, dtype=torch.bool)
        while bool(outside.any()):
            values = torch.where(outside, self._encrypt(values), values)
            outside = values >= self.size
        return values

    def _encrypt(self, values: torch.Tensor) -> torch.Tensor:
        half_mask = (1 << self.half_bits) - 1
        left, right = values >> self.half_bits, values & half_mask
        for key in self.keys:
            left, right = right, left ^ (_mix32(right ^ key) & half_mask)
        return (left << self.half_bits) | right


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's fmix32 on int64 tensors holding 32-bit values (products wrap; the mask keeps 32 bits)."""
    h = h & _MASK32
    h = ((h ^ (h >> 16)) * 0x85EBCA6B) & _MASK32
    h = ((h ^ (h >> 13)) * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


class ShardedSampler(Sampler[int]):
    """This rank's share of one per-epoch permutation of the whole dataset.

    Rank r takes positions r, r + size, r + 2*size, ... so batch k of every rank together is
    exactly positions [k*B*size, (k+1)*B*size) of the global order.

    For training, give a global batch: an epoch is then the whole global batches that fit, and
    the last partial one is left out (a different sample each epoch, as the order changes). Every
    rank takes the same number of full steps (ranks that step a different number of times
    deadlock in the gradient all-reduce), and every step holds the same samples at any world
    size: padding would repeat samples, and which ones would depend on the world size.
    Without it (evaluation), every sample is taken exactly once and shards may differ by one.

    Args:
        dataset_size: samples in the whole dataset.
        rank: this rank's index among the data-parallel ranks.
        world_size: data-parallel ranks.
        seed: with the epoch, keys the permutation.
        shuffle: False: the dataset's order.
        global_batch: samples per optimizer step, every rank's together (training); None for evaluation.
    """

    def __init__(
        self,
        dataset_size: int,
        rank: int,
        world_size: int,
        seed: int = 0,
        shuffle: bool = True,
        global_batch: Optional[int] = None,
    ) -> None:
        if dataset_size <= 0:
            raise ValueError(f"cannot shard an empty dataset (size {dataset_size})")
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside the world of size {world_size}")
        self.dataset_size = dataset_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        if global_batch is not None:
            if global_batch < 1 or global_batch % world_size:
                raise ValueError(f"global_batch {global_batch} must be a positive multiple of the world size {world_size}")
            if global_batch > dataset_size:
                raise ValueError(f"the dataset has {dataset_size} samples, fewer than one global batch of "
                                 f"{global_batch}: lower the batch size or use fewer workers")
        self.shuffle = shuffle
        self.global_batch = global_batch
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Choose the epoch's permutation, and how many samples of it were already consumed
        (a resumed epoch, or one continued by a resized elastic job). The Trainer calls this."""
        if not 0 <= start <= self.dataset_size:
            raise ValueError(f"start {start} is outside the epoch's {self.dataset_size} samples")
        self.epoch = epoch
        self.start = start

    def end(self) -> int:
        """Where this epoch's shards stop: after the last whole global batch from ``start``."""
        if self.global_batch is None:
            return self.dataset_size
        return self.start + (self.dataset_size - self.start) // self.global_batch * self.global_batch

    def __iter__(self) -> Iterator[int]:
        positions = range(self.start + self.rank, self.end(), self.world_size)
        return (index for chunk in self._chunks(positions) for index in chunk)

    def _chunks(self, positions: range) -> Iterator[List[int]]:
        """The samples at ``positions`` of the epoch's order, a chunk at a time."""
        if not self.shuffle:
            yield from (list(positions[i:i + CHUNK]) for i in range(0, len(positions), CHUNK))
            return
        if self.dataset_size <= LISTED_ORDER_LIMIT:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.dataset_size, generator=generator)
            yield order[positions.start:positions.stop:positions.step].tolist()
            return
        permute = FeistelOrder(self.dataset_size, key=self.seed + self.epoch)
        for i in range(0, len(positions), CHUNK):
            part = positions[i:i + CHUNK]
            yield permute(torch.arange(part.start, part.stop, part.step)).tolist()

    def __len__(self) -> int:
        return len(range(self.start + self.rank, self.end(), self.world_size))


def sharded_loader(
    dataset: Dataset,
    batch_size: int,
    rank: int,
    world_size: int,
    seed: int,
    global_batch: Optional[int] = None,
    num_workers: int = 0,
    pin_memory: bool = False,
    collate_fn: Optional[Callable[[List[Any]], Any]] = None,
    prefetch_factor: Optional[int] = None,
    loader_factory: Optional[LoaderFactory] = None,
) -> DataLoader:
    """A DataLoader over this rank's shard.

    Training: shuffled per epoch, whole global batches only. Evaluation: in order, every sample exactly
    once across ranks, so metrics summed across ranks count each sample once. A stream (an
    IterableDataset, a Hugging Face streaming dataset, a function that opens one per epoch) is sharded
    by hvdtrain.data.streaming instead, with the same meaning of global_batch.

    Args:
        dataset: a map-style dataset.
        batch_size: samples per worker per micro-batch.
        rank: this rank's index among the data-parallel ranks.
        world_size: data-parallel ranks.
        seed: with the epoch, keys the permutation.
        global_batch: samples per optimizer step, every rank's together (training: shuffled, whole global batches only);
            None for evaluation.
        num_workers: the DataLoader's worker processes.
        pin_memory: pin the batches in page-locked memory (GPUs).
        collate_fn: makes a batch of samples (None: torch's default, which stacks them; a padding collate keeps each
            batch only as long as its longest sample).
        prefetch_factor: batches each loader worker loads ahead (None: torch's default).
        loader_factory: ``loader_factory(dataset, sampler, batch_size)``: your own DataLoader over hvdtrain's sampler
            (own_loader: the other arguments are then yours to give it).
    """
    from hvdtrain.data.streaming import is_stream, stream_loader  # (streaming imports nothing of this module)
    if is_stream(dataset):
        return stream_loader(dataset, batch_size, rank, world_size, seed, global_batch=global_batch,
                             num_workers=num_workers, pin_memory=pin_memory, collate_fn=collate_fn,
                             prefetch_factor=prefetch_factor)
    sampler = ShardedSampler(
        len(dataset), rank, world_size, seed=seed,  # type: ignore[arg-type]
        shuffle=global_batch is not None, global_batch=global_batch,
    )
    if loader_factory is not None:
        return own_loader(loader_factory, dataset, sampler, batch_size, seed + rank)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
        collate_fn=collate_fn,
        prefetch_factor=prefetch_factor,
        # Its own generator: otherwise starting each epoch's iterator draws from the global torch
        # RNG (for worker seeds), and a resumed run's dropout masks would shift by one draw.
        generator=torch.Generator().manual_seed(seed + rank),
    )


LoaderFactory = Callable[[Dataset, ShardedSampler, int], DataLoader]


def own_loader(factory: LoaderFactory, dataset: Dataset, sampler: ShardedSampler, batch_size: int,
               seed: int) -> DataLoader:
    """The factory's loader, checked: a loader that does not read through this
    rank's sampler would give every rank the whole data (or another order), and one that drops or
    regroups samples would break the global batches; each is refused with what to change.

    Args:
        factory: ``factory(dataset, sampler, batch_size)`` -> a DataLoader.
        dataset: the dataset.
        sampler: this rank's sampler, which the loader must read through.
        batch_size: samples per worker per micro-batch.
        seed: the sampler's seed, to check the loader's order against.
    """
    loader = factory(dataset, sampler, batch_size)
    if not isinstance(loader, DataLoader):
        raise TypeError(f"loader_factory must return a torch DataLoader, got {type(loader).__name__}")
    batches = loader.batch_sampler
    problems = []
    if loader.dataset is not dataset:
        problems.append("it reads another dataset than the one it is given")
    if getattr(batches, "sampler", None) is not sampler:
        problems.append("it does not read through the sampler it is given (pass sampler=sampler, no shuffle)")
    if getattr(batches, "batch_size", None) != batch_size:
        problems.append(f"its batch size is {getattr(batches, 'batch_size', None)}, not the {batch_size} it is given")
    if getattr(batches, "drop_last", False):
        problems.append("it drops the last batch (the sampler already keeps whole global batches only: drop_last=False)")
    if problems:
        raise ValueError("loader_factory(dataset, sampler, batch_size) must return DataLoader(dataset, "
                         "batch_size=batch_size, sampler=sampler, ...your other arguments): " + "; ".join(problems))
    if loader.generator is None:
        # Each epoch's iterator draws its workers' base seed from this generator, else from torch's
        # global one: a resumed run's random stream (dropout) would then differ by those draws.
        loader.generator = torch.Generator().manual_seed(seed)
    return loader
