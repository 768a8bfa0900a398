"""FSDP's collectives: a unit's parameters all-gathered into its full buffers, its gradients
reduce-scattered into the shard gradients, and the bookkeeping of what is in flight.

Every collective is named after its buffer ("fsdp.grad.3.1024"; a gather is one broadcast per
slice, "fsdp.param.3.1024.R" from rank R): the same on every rank, and unique while in flight,
since a buffer has at most one gather and one reduce-scatter started.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch

import horovod.torch as hvd

from hvdtrain.strategies.sharding import flat_buckets as fb
from hvdtrain.strategies.fsdp import units as fu
from hvdtrain.strategies.sharding import storage
from hvdtrain.strategies.zero import gather_in_place


class UnitCommunication:
    """The collectives of fsdp's buffers, and the bookkeeping of what is in flight.

    Args:
        buckets: every unit's buffers, in the order their reductions are finished.
        process_set: the ranks that share the buffers (None: every rank; hsdp: its shard group).
        ranks: their global ranks, in slice order (None: slice i is rank i's).
        reductions_behind: reduce-scatters (0 or 1) left running once start_reduction returns.
    """

    def __init__(self, buckets: Sequence[fu.ShardedBucket], process_set: Any = None,
                 ranks: Optional[Sequence[int]] = None, reductions_behind: int = 1) -> None:
        if reductions_behind not in (0, 1):
            raise ValueError(f"reductions_behind must be 0 or 1, got {reductions_behind!r}")
        self.buckets = list(buckets)
        self.process_set, self.ranks = process_set, ranks
        self.reductions_behind = reductions_behind
        self._where = {} if process_set is None else {"process_set": process_set}
        self.in_flight: Dict[str, Any] = {}  # collective name -> Horovod handle

    # A unit's full parameters: FREE -> GATHERING (gathers started) -> GATHERED -> FREE.

    def start_gather(self, unit: fu.FSDPUnit) -> None:
        """The full buffers get their storage now, the own slice copied in, and the other slices
        arrive in place (zero.gather_in_place: no full-size temporary, no copy after)."""
        if unit.state != fu.FREE:
            return
        with torch.no_grad():  # into the one storage the parameters and autograd's tensors view
            for bucket in unit.buckets:
                storage.allocate_storage(bucket.flat_param)
                bucket.own_slice(bucket.flat_param).copy_(bucket.shard)
                for name, handle in gather_in_place(bucket, bucket.flat_param, self.process_set, self.ranks).items():
                    self.start(name, handle)
        unit.state = fu.GATHERING

    def ensure_gathered(self, unit: fu.FSDPUnit) -> None:
        self.start_gather(unit)
        if unit.state != fu.GATHERING:
            return
        self._wait_gathers(unit)
        unit.state = fu.GATHERED

    def free(self, unit: fu.FSDPUnit) -> None:
        if unit.state == fu.FREE:
            return
        if unit.state == fu.GATHERING:
            self._wait_gathers(unit)  # started on every rank: it must finish on every rank
        for bucket in unit.buckets:
            storage.release_storage(bucket.flat_param)
        unit.state = fu.FREE

    def _wait_gathers(self, unit: fu.FSDPUnit) -> None:
        for bucket in unit.buckets:
            for owner in range(bucket.world_size):
                self.wait(f"{bucket.param_name}.{owner}")

    def gathered_parameter_values(self, units: Sequence[fu.FSDPUnit]) -> Dict[int, torch.Tensor]:
        """id(parameter) -> a copy of its full value, gathered unit by unit (the next unit's
        all-gather overlapping this one's copies); a unit gathered before (mid-step) stays so."""
        was_free = {unit: unit.state == fu.FREE for unit in units}
        values: Dict[int, torch.Tensor] = {}
        for position, unit in enumerate(units):
            self.ensure_gathered(unit)
            if position + 1 < len(units):
                self.start_gather(units[position + 1])
            values.update((id(p), p.detach().clone()) for bucket in unit.buckets for p in bucket.params)
            if was_free[unit]:
                self.free(unit)
        return values

    # A buffer's gradients: averaged over the ranks, this rank's slice added to its shard gradient.

    def start_reduction(self, bucket: fu.ShardedBucket) -> None:
        """Reduce-scatter what the buffer's full gradient holds (zeros if it got none), then let
        go of the parameters' .grad: the next micro-batch starts a new full gradient. The earlier
        reductions finish first, so that one full gradient at most waits on the wire: without the
        bound, a slow wire lets every unit's full gradient pile up."""
        self.finish_reductions()
        grad = fb.complete_gradients(bucket)  # missing gradients count as zeros
        bucket.reducing = grad.half() if bucket.fp16_wire else grad  # alive until reduced
        fb.release_gradients(bucket)
        self.start(bucket.grad_name, hvd.reducescatter_async(bucket.reducing, name=bucket.grad_name, op=hvd.Average,
                                                            **self._where))
        bucket.started = True
        if not self.reductions_behind:
            self.finish_reduction(bucket)

    def finish_reduction(self, bucket: fu.ShardedBucket) -> None:
        fb.accumulate_shard_gradient(bucket, self.wait(bucket.grad_name))  # over micro-batches
        bucket.reducing = None

    def finish_completed_reductions(self) -> None:
        """Those already done, so that their full gradients go early (no waiting)."""
        for bucket in self.buckets:
            handle = self.in_flight.get(bucket.grad_name)
            if handle is not None and hvd.poll(handle):
                self.finish_reduction(bucket)

    def finish_reductions(self) -> None:
        for bucket in self.buckets:
            if bucket.grad_name in self.in_flight:
                self.finish_reduction(bucket)

    # Optimizer state, for a checkpoint.

    def gather_states(self, per_bucket: Sequence[Dict[str, torch.Tensor]]) -> List[Dict[str, torch.Tensor]]:
        """Each bucket's per-element state tensors (its shard's slices), all-gathered to full size."""
        for bucket, state in zip(self.buckets, per_bucket):
            for key, value in state.items():  # all started before any is waited on
                name = bucket.name(f"state.{key}")
                self.start(name, hvd.allgather_async(value.detach(), name=name, **self._where))
        return [{key: self.wait(bucket.name(f"state.{key}")) for key in state}
                for bucket, state in zip(self.buckets, per_bucket)]

    # Bookkeeping (pending is read from the watchdog's thread).

    def start(self, name: str, handle: Any) -> None:
        self.in_flight[name] = handle

    def wait(self, name: str) -> torch.Tensor:
        result = hvd.synchronize(self.in_flight[name])
        del self.in_flight[name]
        return result

    def pending(self) -> List[str]:
        return [name for name, handle in dict(self.in_flight).items() if not _finished(handle)]


def _finished(handle: Any) -> bool:
    try:
        return hvd.poll(handle)
    except (ValueError, RuntimeError):  # waited for and cleared by the training thread meanwhile
        return True
