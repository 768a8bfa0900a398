"""Which ranks form a sequence group, and what the data sees.

Without tensor parallelism a sequence group is S consecutive ranks (one host's, where the
all-to-all is cheapest): rank r is index r mod S of group r // S. The groups read the data as
D = N / S data-parallel workers: every rank of a group reads worker r // S's shard. For gradients
the group's ranks are data-parallel ranks like any other (they hold the same parameters, each the
gradient of its tokens' share of the loss), so the strategy (ddp, zero, fsdp) reduces over the
whole world unchanged.

With tensor parallelism (T ranks per tensor group, innermost in the mesh: rank = d·T + t), the
sequence is the inner part of the mesh's data axis: a group is the S ranks of one tensor index t
and S consecutive data coordinates d (stride T), so the ranks of a tensor group hold the same tokens,
and the mesh's data group (every d of one t) reduces the sequence ranks' partial gradients with the
data-parallel ones, unchanged. The data sees D = N / (S·T) workers: worker d // S.
"""
from __future__ import annotations

from typing import Any, List, Tuple

from hvdtrain.common.errors import LayoutError


def check_divides(world_size: int, size: int, tensor: int = 1) -> None:
    """LayoutError unless ``size`` ranks per sequence group, times ``tensor`` per tensor group, divide the world."""
    if world_size % (size * tensor):
        within = f" x tensor_parallel={tensor}" if tensor > 1 else ""
        raise LayoutError(f"train.sequence_parallel={size}{within} = {size * tensor} ranks per sequence group's "
                          f"replica does not divide the {world_size} workers: run a multiple of {size * tensor} "
                          f"workers, or choose a sequence_parallel{within} dividing {world_size}")


def group_ranks(world_size: int, size: int, tensor: int = 1) -> List[Tuple[int, ...]]:
    """Every sequence group, each its ranks in increasing order, in one order every rank computes alike.

    Args:
        world_size: ranks in the world.
        size: S, ranks per sequence group.
        tensor: T, ranks per tensor group (innermost in the mesh).
    """
    check_divides(world_size, size, tensor)
    block = size * tensor  # S data coordinates of every tensor index
    return [tuple(first + t + i * tensor for i in range(size))
            for first in range(0, world_size, block) for t in range(tensor)]


class SequenceGroup:
    """This rank's sequence group: its ranks, this rank's index in it, its process set (the global
    one when it is the whole world). A view: its topology (hvdtrain.parallel.topology) makes and
    removes every group's process set.

    Args:
        ranks: the group's ranks, in order.
        rank: this rank.
        process_set: the group's Horovod process set.
        world_size: ranks in the world.
        tensor: T, ranks per tensor group (1: no tensor parallelism).
    """

    def __init__(self, ranks: Tuple[int, ...], rank: int, process_set: Any, world_size: int, tensor: int = 1) -> None:
        self.ranks, self.index, self.process_set = ranks, ranks.index(rank), process_set
        self.world_size, self.tensor = world_size, tensor

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def data_index(self) -> int:
        """Which data-parallel worker this group reads as."""
        return self.ranks[0] // (self.size * self.tensor)

    @property
    def data_workers(self) -> int:
        """How many data-parallel workers the data is sharded over: one per group of every tensor index."""
        return self.world_size // (self.size * self.tensor)

    def __repr__(self) -> str:
        return f"SequenceGroup(ranks={self.ranks}, index={self.index})"
