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

from typing import Any, List, Optional, Tuple

from hvdtrain.common.errors import LayoutError
from hvdtrain.distributed import startup
from hvdtrain.parallel.mesh import acquire_process_set, release_process_set


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
    one when it is the whole world). ``build`` and ``close`` are collectives over the world.

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
        self._held: Optional[Tuple[int, ...]] = ranks if len(ranks) < world_size else None

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

    @classmethod
    def build(cls, world_size: int, rank: int, size: int, tensor: int = 1) -> "SequenceGroup":
        """Every rank makes every group's process set, in the same order; refused alike on every rank.

        Args:
            world_size: ranks in the world.
            rank: this rank.
            size: S, ranks per sequence group.
            tensor: T, ranks per tensor group (the mesh's innermost axis).
        """
        groups = group_ranks(world_size, size, tensor)
        if size < world_size and not startup.dynamic_process_sets_enabled():
            raise ValueError(startup.dynamic_process_sets_conflict())
        sets = {ranks: acquire_process_set(ranks, world_size) for ranks in groups}
        mine = next(ranks for ranks in groups if rank in ranks)
        return cls(mine, rank, sets[mine], world_size, tensor)

    def close(self) -> None:
        """Remove the groups' process sets (a collective: every rank, in the same order)."""
        if self._held is not None:
            for ranks in group_ranks(self.world_size, self.size, self.tensor):
                release_process_set(ranks)
            self._held = None

    def __repr__(self) -> str:
        return f"SequenceGroup(ranks={self.ranks}, index={self.index})"
