"""Which ranks form a sequence group, and what the data sees.

A sequence group is S consecutive ranks (one host's, where the all-to-all is cheapest): rank r is
index r mod S of group r // S. The groups read the data as D = N / S data-parallel workers: every
rank of a group reads worker r // S's shard. For gradients the group's ranks are data-parallel
ranks like any other (they hold the same parameters, each the gradient of its tokens' share of the
loss), so the strategy (ddp, zero, fsdp) reduces over the whole world unchanged.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

from hvdtrain.common.errors import LayoutError
from hvdtrain.distributed import startup
from hvdtrain.parallel.mesh import acquire_process_set, release_process_set


def check_divides(world_size: int, size: int) -> None:
    """LayoutError unless ``size`` ranks per sequence group divide the world."""
    if world_size % size:
        raise LayoutError(f"train.sequence_parallel={size} ranks per sequence group does not divide the "
                          f"{world_size} workers: run a multiple of {size} workers, or choose a sequence_parallel "
                          f"dividing {world_size}")


class SequenceGroup:
    """This rank's sequence group: its ranks, this rank's index in it, its process set (the global
    one when it is the whole world). ``build`` and ``close`` are collectives over the world.

    Args:
        ranks: the group's ranks, in order.
        rank: this rank.
        process_set: the group's Horovod process set.
        world_size: ranks in the world.
    """

    def __init__(self, ranks: Tuple[int, ...], rank: int, process_set: Any, world_size: int) -> None:
        self.ranks, self.index, self.process_set = ranks, ranks.index(rank), process_set
        self.world_size = world_size
        self._held: Optional[Tuple[int, ...]] = ranks if len(ranks) < world_size else None

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def data_index(self) -> int:
        """Which data-parallel worker this group reads as."""
        return self.ranks[0] // self.size

    @classmethod
    def build(cls, world_size: int, rank: int, size: int) -> "SequenceGroup":
        """Every rank makes every group's process set, in the same order; refused alike on every rank."""
        check_divides(world_size, size)
        groups = [tuple(range(first, first + size)) for first in range(0, world_size, size)]
        if size < world_size and not startup.dynamic_process_sets_enabled():
            raise ValueError(startup.dynamic_process_sets_conflict())
        sets = {ranks: acquire_process_set(ranks, world_size) for ranks in groups}
        mine = groups[rank // size]
        return cls(mine, rank, sets[mine], world_size)

    def close(self) -> None:
        """Remove the groups' process sets (a collective: every rank, in the same order)."""
        if self._held is not None:
            for first in range(0, self.world_size, self.size):
                release_process_set(tuple(range(first, first + self.size)))
            self._held = None

    def __repr__(self) -> str:
        return f"SequenceGroup(ranks={self.ranks}, index={self.index})"
