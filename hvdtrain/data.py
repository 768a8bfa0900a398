"""Sharding a dataset across ranks.

Why not torch's DistributedSampler: hvdtrain needs a global sample order that is a function of
(seed, epoch) alone, so that global batch k holds the same samples at any number of workers
(the equivalence of N workers x batch B with one process x batch N*B rests on it, and so does
resuming on another world size), and a start position inside an epoch for exact resume.
"""
from __future__ import annotations

import math
from typing import Iterator, List

import torch
from torch.utils.data import DataLoader, Dataset, Sampler


class ShardedSampler(Sampler[int]):
    """This rank's share of one per-epoch permutation of the whole dataset.

    The permutation is padded (wrapping around) to a multiple of the world size, so every
    rank gets the same number of samples and takes the same number of steps: ranks that
    step a different number of times deadlock in the gradient all-reduce.
    Rank r takes positions r, r + size, r + 2*size, ... so batch k of every rank together
    is exactly positions [k*B*size, (k+1)*B*size) of the global order.
    """

    def __init__(
        self,
        dataset_size: int,
        rank: int,
        world_size: int,
        seed: int = 0,
        shuffle: bool = True,
        pad: bool = True,
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
        self.shuffle = shuffle
        self.pad = pad
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch's permutation; the Trainer calls it, users need not."""
        self.epoch = epoch

    def global_order(self) -> List[int]:
        """The epoch's order of all samples, the same on every rank and at every world size."""
        if not self.shuffle:
            return list(range(self.dataset_size))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.dataset_size, generator=generator).tolist()

    def _padded_size(self) -> int:
        if self.pad:
            return math.ceil(self.dataset_size / self.world_size) * self.world_size
        return self.dataset_size

    def __iter__(self) -> Iterator[int]:
        order = self.global_order()
        total = self._padded_size()
        if total > len(order):
            order = (order * math.ceil(total / len(order)))[:total]
        return iter(order[self.rank : total : self.world_size])

    def __len__(self) -> int:
        total = self._padded_size()
        return len(range(self.rank, total, self.world_size))


def sharded_loader(
    dataset: Dataset,
    batch_size: int,
    rank: int,
    world_size: int,
    seed: int,
    train: bool,
    num_workers: int = 0,
    pin_memory: bool = False,
) -> DataLoader:
    """A DataLoader over this rank's shard.

    Training shards are shuffled per epoch and padded to equal length (equal step counts).
    Evaluation shards are in order and not padded, so every sample counts exactly once in
    metrics summed across ranks.
    """
    sampler = ShardedSampler(
        len(dataset), rank, world_size, seed=seed, shuffle=train, pad=train  # type: ignore[arg-type]
    )
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
    )
