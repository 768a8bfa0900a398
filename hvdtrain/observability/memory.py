"""What each rank holds: bytes in parameters, gradients and optimizer state (counted from the
tensors' storages by the strategy), the process's peak resident memory and, on a GPU, the peak
memory torch's allocator handed out and reserved (what a GPU user reads), once per start.

Taken after the first optimizer step, before its gradients are cleared: the moment a rank
holds the most of all three (the optimizer state exists from the first step on).
"""
from __future__ import annotations

import resource
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from hvdtrain.distributed import collectives
from hvdtrain.distributed.devices import device_peaks
from hvdtrain.common.units import format_bytes
from hvdtrain.observability.run_directory import RunDirectory
from hvdtrain.strategies.base import Strategy

if TYPE_CHECKING:
    from hvdtrain.parallel.topology import Topology


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class MemoryReport:
    """Gathers every rank's counts once (a collective: every rank calls it at the same step).

    Under Horovod elastic a worker that joins later takes its first step when the others are
    long past theirs: there each rank reports only its own counts, in its own log (no collective).
    """

    def __init__(self, strategy: Strategy, topology: "Topology", gather: bool = True) -> None:
        self.strategy, self.topology, self.gather = strategy, topology, gather
        self.per_rank: Optional[List[Dict[str, Any]]] = None

    def after_first_step(self, run_dir: Optional[RunDirectory], step: int) -> None:
        if self.per_rank is not None:
            return
        counted = self.strategy.memory_bytes()
        mine = {**counted, "total": sum(counted.values()), "peak_rss": peak_rss_bytes(),
                **device_peaks(self.topology.world.device)}
        self.per_rank = collectives.allgather_object(mine, name="trainer.memory") if self.gather else [mine]
        world = self.topology.world
        if self.gather and not world.is_root:
            return
        first = 0 if self.gather else world.rank
        lines = [f"rank {rank}: " + ", ".join(f"{key} {format_bytes(value)}" for key, value in held.items())
                 for rank, held in enumerate(self.per_rank, start=first)]
        self.topology.log.info(f"memory held per rank ({self.strategy.label}, counted from tensor storages; "
                               f"peak RSS of the process; on a GPU, torch's peak allocated and reserved):\n  " + "\n  ".join(lines))
        if run_dir is not None:
            run_dir.record("memory", {"step": step, "strategy": self.strategy.label, "per_rank": self.per_rank})
