"""A parameter server: ranks 0..K-1 (train.ps_servers) also serve, each holding the averaged gradient
and the optimizer state of one slice of every flat bucket; every rank is a worker.

Every rank computes its shard's gradient as under ddp (the same data and result, to the last bit);
synchronize sends server s its slice s, which the server averages; step has each server update its
slice and send it to every other rank. Both moves are ``hvd.alltoall`` with explicit splits: point to
point in collective form (a chunk goes to its server and nowhere else), on MPI, Gloo and NCCL alike.
``traffic()`` counts the bytes each rank sent and received in the last step: a worker moves 2 Psi, a
server (N - 1) x its slice each way, where a ring all-reduce moves 2 (N - 1) / N x Psi per rank. A
measured baseline, not a fast path: no overlap with backward. Missing gradients count as zeros.
"""
from __future__ import annotations

from typing import Any, Dict, List

import torch

import horovod.torch as hvd

from hvdtrain.distributed import collectives
from hvdtrain.distributed.world import World
from hvdtrain.strategies.optimizers import check_elementwise
from hvdtrain.common.capabilities import SHARDED_CHECKPOINTS
from hvdtrain.strategies.sharding import flat_buckets as fb
from hvdtrain.strategies.sharding.sliced import SlicedStateStrategy


def check_servers(servers: int, world_size: int) -> None:
    """Between 1 and the world size (a local check: the same verdict on every rank)."""
    if isinstance(servers, bool) or not isinstance(servers, int) or not 1 <= servers <= world_size:
        raise ValueError(f"ps_servers must be a whole number from 1 to the world size ({world_size}): the "
                         f"servers are ranks 0..ps_servers-1, got {servers!r}")


class PSStrategy(SlicedStateStrategy):
    """A parameter server on ranks 0..servers-1 (see the module's text). The model's parameters
    become views of flat buckets; parameters not in the optimizer, or frozen, are left alone.

    Args:
        model: the model; its parameters are handled as the strategy says.
        optimizer: the user's optimizer over them.
        world: this rank's World (its data-parallel group).
        accumulation: micro-batches per optimizer step.
        fp16_allreduce: compress gradients to fp16 for their exchange.
        servers: ranks 0..servers-1 also serve (train.ps_servers).
        bucket_bytes: the size of a flat bucket, in bytes.
    """

    name = "ps"

    @classmethod
    def from_config(cls, config, model, optimizer, world, **context) -> "PSStrategy":
        """Built from the settings: train.ps_servers besides the common ones.

        Args:
            config: the run's settings (TrainConfig).
            model: the model.
            optimizer: its optimizer.
            world: this rank's World.
            context: what set-up knows besides: mesh, plan, loss_fn, deferred.
        """
        return cls(model, optimizer, world, config.accumulation, config.fp16_allreduce, servers=config.ps_servers)

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: World,
                 accumulation: int, fp16_allreduce: bool, servers: int = 1,
                 bucket_bytes: int = 25 * 2**20) -> None:
        check_servers(servers, world.size)  # before any collective: the same verdict on every rank
        check_elementwise(optimizer, "strategy=ps cannot serve {name}",
                          "each server steps a flat slice of the parameters that cuts across tensors",
                          "Use --train.strategy=ddp with {name}")
        super().__init__(model, optimizer, world, accumulation, fp16_allreduce)
        self.servers = servers
        self.serving = world.rank < servers
        # world_size=K: every bucket is padded to a multiple of K and cut into K slices.
        self.buckets = fb.bucket_parameters(model, optimizer, bucket_bytes, world.rank if self.serving else 0,
                                            servers)
        for bucket in self.buckets:
            if not self.serving:  # a worker only: it owns no slice, and its optimizer holds nothing
                bucket.shard = torch.nn.Parameter(bucket.flat_param[:0])
            bucket.shard_grad = torch.zeros_like(bucket.shard)
            bucket.shard.grad = bucket.shard_grad
        # Every rank's optimizer carries the groups' live hyperparameters (the LR schedule); only
        # the servers' has slices to step and state beyond scalars (Adam's step count).
        self._take_optimizer(optimizer)
        self._in_flight: Dict[str, Any] = {}  # collective name -> Horovod handle
        self._counting = {"sent": 0, "received": 0}  # this step's, so far
        self._last_step = {"sent": 0, "received": 0}
        self._gradients_sent = False

    # Counted traffic.

    def _alltoall(self, name: str, tensor: torch.Tensor, splits: List[int]) -> None:
        """Start an all-to-all of a flat tensor; the bytes it sends to other ranks are counted here."""
        others = sum(count for rank, count in enumerate(splits) if rank != self.world.rank)
        self._counting["sent"] += others * tensor.element_size()
        self._in_flight[name] = hvd.alltoall_async(tensor, splits=torch.tensor(splits, dtype=torch.int32),
                                                   name=name)

    def _receive(self, name: str) -> tuple:
        """Wait for an all-to-all; count the bytes received from other ranks from its received splits."""
        output, received = hvd.synchronize(self._in_flight.pop(name))
        received = [int(count) for count in received]
        others = sum(count for rank, count in enumerate(received) if rank != self.world.rank)
        self._counting["received"] += others * output.element_size()
        return output, received

    def traffic(self) -> Dict[str, int]:
        """Bytes this rank sent to and received from other ranks in the last step's all-to-alls."""
        return dict(self._last_step)

    # Gradients to the servers.

    def synchronize(self) -> None:
        if self._gradients_sent:
            return
        self._counting = {"sent": 0, "received": 0}
        size, slices = self.world.size, [[b.shard_numel] * self.servers for b in self.buckets]
        for bucket, split in zip(self.buckets, slices):  # all started before any is waited on
            flat = self._flat_gradient(bucket)
            self._alltoall(f"ps.grad.{bucket.index}", flat.half() if self._fp16_wire(bucket) else flat,
                           split + [0] * (size - self.servers))
        for bucket in self.buckets:
            output, _ = self._receive(f"ps.grad.{bucket.index}")
            if self.serving:  # N chunks, one per worker (its own included): their average
                total = output.to(bucket.dtype).view(size, bucket.shard_numel).sum(dim=0)
                bucket.shard_grad.copy_(total.div_(size))
                bucket.shard.grad = bucket.shard_grad  # in case optimizer.zero_grad() set it to None
        self._gradients_sent = True

    def _fp16_wire(self, bucket: fb.FlatBucket) -> bool:
        return self.fp16_allreduce and bucket.dtype in (torch.float32, torch.float64)

    @staticmethod
    def _flat_gradient(bucket: fb.FlatBucket) -> torch.Tensor:
        """The bucket's local gradients back to back (zeros for padding and missing gradients)."""
        flat = torch.zeros_like(bucket.flat_param)
        for param, view in zip(bucket.params, bucket.views(flat)):
            if param.grad is not None:
                view.copy_(param.grad)
        return flat

    # The update at the servers, and the weights back to every worker.

    def step(self) -> None:
        self.synchronize()  # nothing left to do when the caller already synchronized
        # A worker's shards are empty: its step computes nothing, and keeps torch's LR scheduler
        # from warning that the optimizer never stepped.
        self.optimizer.step()
        size, rank = self.world.size, self.world.rank
        for bucket in self.buckets:  # all started before any is waited on
            if self.serving:  # its slice to every other rank
                mine = bucket.own_slice(bucket.flat_param).detach()
                outgoing = mine.repeat(size - 1)
                split = [0 if other == rank else bucket.shard_numel for other in range(size)]
            else:
                outgoing, split = bucket.flat_param[:0], [0] * size
            self._alltoall(f"ps.param.{bucket.index}", outgoing, split)
        for bucket in self.buckets:
            output, received = self._receive(f"ps.param.{bucket.index}")
            with torch.no_grad():
                offset = 0
                for server in range(self.servers):  # in rank order: server s's slice s
                    if received[server]:
                        bucket.slice_of(bucket.flat_param, server).copy_(output[offset:offset + received[server]])
                        offset += received[server]
        self._last_step = dict(self._counting)
        self._gradients_sent = False
        self._carried_state = None

    def zero_grad(self) -> None:
        for bucket in self.buckets:
            for param in bucket.params:
                param.grad = None
            bucket.shard_grad.zero_()
            bucket.shard.grad = bucket.shard_grad
        self._gradients_sent = False

    def owned_gradients(self) -> List[torch.Tensor]:
        return [bucket.shard_grad for bucket in self.buckets] if self.serving else []

    def pending_communication(self) -> List[str]:
        pending = []
        for name, handle in dict(self._in_flight).items():
            try:
                if not hvd.poll(handle):
                    pending.append(name)
            except (ValueError, RuntimeError):  # waited for meanwhile by the training thread
                pass
        return pending

    # The full state (broadcast_from_root, state_dict, load_state_dict): sharding/sliced.py.

    def _gather_optimizer_state(self) -> Dict[str, Any]:
        """The user's optimizer's state_dict, every rank holding all of it (collective): each server
        broadcasts its slices of the per-element state; the scalars (Adam's step) are server 0's."""
        own = [self.optimizer.state.get(bucket.shard, {}) for bucket in self.buckets]
        outline = [{key: (str(value.dtype) if fb.is_elementwise(value) else value) for key, value in state.items()}
                   for state in own]
        outline = collectives.broadcast_object(outline, root_rank=0, name="ps.state.outline")
        gathered: List[Dict[str, torch.Tensor]] = []
        started = []
        for bucket, state, shape in zip(self.buckets, own, outline):
            full = {}
            for key, value in shape.items():
                if not isinstance(value, str):
                    continue
                full[key] = torch.zeros(bucket.padded_numel, dtype=getattr(torch, value.replace("torch.", "")),
                                        device=bucket.device)
                if self.serving:
                    bucket.own_slice(full[key]).copy_(state[key])
                for server in range(self.servers):  # in place, each slice from its server
                    name = f"ps.state.{key}.{bucket.index}.{server}"
                    started.append(hvd.broadcast_async_(bucket.slice_of(full[key], server), root_rank=server,
                                                        name=name))
            gathered.append(full)
        for handle in started:
            hvd.synchronize(handle)
        # Server 0's scalars, in the optimizer's own key order.
        shard_states = [{key: full[key] if isinstance(value, str) else value for key, value in shape.items()}
                        for shape, full in zip(outline, gathered)]
        return fb.full_state_dict(self.buckets, self._group_indices, self.optimizer.param_groups,
                                  shard_states, gathered)

    def _load_optimizer_state(self, full: Dict[str, Any]) -> None:
        """A server keeps its slices of a full optimizer state_dict, a worker only the groups'
        hyperparameters (local: every rank has it all)."""
        if not self.serving:
            full = {"state": {}, "param_groups": full["param_groups"]}
        self.optimizer.load_state_dict(fb.shard_state_dict(self.buckets, self._group_indices, full))

    def _no_shards(self) -> str:
        return (f"strategy ps has no sharded checkpoint: {self.capabilities.refuses[SHARDED_CHECKPOINTS]}; "
                "use checkpoint_format=full")
