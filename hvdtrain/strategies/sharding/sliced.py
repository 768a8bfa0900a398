"""What the strategies that step slices of flat buckets share (zero1, zero2, fsdp, ps): the user's
optimizer rebuilt over the slices, its state kept in them, the full state (one process's) gathered
from them, and, where every rank owns its 1/N, each rank's own part for a sharded checkpoint."""
from __future__ import annotations

from abc import abstractmethod
from typing import Any, Dict, List, Optional

import torch

import horovod.torch as hvd

from hvdtrain.distributed import collectives
from hvdtrain.strategies.base import Strategy, optimizer_state_tensors, storage_bytes
from hvdtrain.strategies.optimizers import check_elementwise, optimizer_like
from hvdtrain.strategies.sharding import flat_buckets as fb
from hvdtrain.strategies.sharding import shard_state

# ZeRO's words when an optimizer cannot step slices (ps says its own).
NOT_SLICEABLE = ("ZeRO cannot shard {name}", "it steps the optimizer on flat slices that cut across parameters",
                 "Use --train.strategy=ddp with {name}.")


class SlicedStateStrategy(Strategy):
    """A strategy whose optimizer steps slices of ``buckets``; the model's state_dict reads and writes
    the buckets in place. A subclass makes the buckets, then calls ``_take_optimizer``."""

    buckets: List[fb.FlatBucket]

    def _take_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """The user's optimizer over the slices, with its state put into them. Rank 0's state as it
        was built is what broadcast_from_root spreads, until a step or a load makes it stale."""
        self._group_indices = fb.indices_by_group(optimizer)
        self.optimizer = optimizer_like(optimizer, [[b.shard for b in self.buckets if b.group == g]
                                                    for g in range(len(optimizer.param_groups))])
        self._carried_state: Optional[Dict[str, Any]] = optimizer.state_dict()
        self._load_optimizer_state(self._carried_state)

    @abstractmethod
    def _gather_optimizer_state(self) -> Dict[str, Any]:
        """The user's optimizer's state_dict, whole on every rank (a collective)."""

    def _load_optimizer_state(self, full: Dict[str, Any]) -> None:
        """Keep this rank's slices of a full optimizer state_dict (local: every rank has it all)."""
        self.optimizer.load_state_dict(fb.shard_state_dict(self.buckets, self._group_indices, full))

    def broadcast_from_root(self) -> None:
        hvd.broadcast_parameters(self.model.state_dict(), root_rank=0)  # in place: into the buckets
        full = self._carried_state if self._carried_state is not None else self._gather_optimizer_state()
        self._load_optimizer_state(collectives.broadcast_state(full, root_rank=0, name=f"{self.name}.optimizer"))
        self._carried_state = None

    def state_dict(self) -> Dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self._gather_optimizer_state()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])  # copies into the buckets in place
        self._load_optimizer_state(state["optimizer"])
        self._carried_state = None

    def owned_gradients(self) -> List[torch.Tensor]:
        return [bucket.shard_grad for bucket in self.buckets]

    def memory_bytes(self) -> Dict[str, int]:
        params = list(self.model.parameters())
        shards = [bucket.shard for bucket in self.buckets]
        grads = [p.grad for p in params + shards] + [b.shard_grad for b in self.buckets]
        return {"parameters": storage_bytes(params + shards), "gradients": storage_bytes(grads),
                "optimizer_state": storage_bytes(optimizer_state_tensors(self.optimizer))}


class ShardedStrategy(SlicedStateStrategy):
    """Every rank owns slice r of every bucket (zero1, zero2, fsdp): its own part is a sharded
    checkpoint's file (hvdtrain.strategies.sharding.shard_state), written and read with no collective."""

    @staticmethod
    def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
        check_elementwise(optimizer, *NOT_SLICEABLE)

    def owned_parameters(self) -> List[torch.Tensor]:
        # The slices the optimizer steps; fsdp's forward gathers from them, zero's buckets are
        # gathered from them after each step (owned_parameters_changed).
        return [bucket.shard for bucket in self.buckets]

    def shard_state_dict(self) -> Dict[str, Any]:
        return shard_state.shard_state_dict(self.model, self.buckets, self.optimizer, self._group_indices)

    def shard_layout(self) -> Dict[str, Any]:
        """Where every element of this rank's part belongs (the ``layout`` of its shard_state_dict)."""
        return shard_state.layout(self.model, self.buckets, self._group_indices)

    def check_shard_state_dict(self, state: Dict[str, Any]) -> None:
        shard_state.check_shard(self.model, self.buckets, self._group_indices, state)

    def load_shard_state_dict(self, state: Dict[str, Any]) -> None:
        shard_state.load_shard_state_dict(self.model, self.buckets, self.optimizer, self._group_indices, state)
        self._carried_state = None
        self._after_shard_load()

    def read_part(self, source: Any) -> Dict[str, Any]:
        """This rank's part in its own layout, read from ``source``: from a sharded or mesh checkpoint
        of any layout only the elements of its slices, from a weights directory its slices of the
        parameters (its optimizer's state kept), from a full checkpoint (every rank holds all of it
        already) the whole state, of which the load keeps its slices. Local: no collective."""
        held = source.held_state()
        if held is not None:
            return {"full": held}
        if source.param_groups() is None:
            return shard_state.part_from_weights(self.shard_state_dict(), source)
        rank, size = (self.buckets[0].rank, self.buckets[0].world_size) if self.buckets else (self.world.rank,
                                                                                               self.world.size)
        return shard_state.part_from(source, self.shard_layout(), rank, size,
                                     unmanaged=shard_state.unmanaged_state(self.model, self.buckets))

    def load_part(self, part: Dict[str, Any]) -> None:
        if "full" in part:
            self.load_state_dict(part["full"])
        else:
            self.load_shard_state_dict(part)

    def _after_shard_load(self) -> None:
        """What the rank's own slices need once loaded (a collective, when the model holds more)."""
