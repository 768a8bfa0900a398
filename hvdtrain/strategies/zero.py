"""ZeRO stages 1 and 2 on Horovod: each rank keeps the optimizer state of 1/N of the parameters.

The optimizer's parameters are packed into flat buckets; rank r owns slice r of every bucket and
steps only those. Backward: a bucket whose gradients are all there starts its reduce-scatter at once
(overlapping the rest of backward); stage 1 keeps a full gradient buffer per bucket and reduces once
per step, stage 2 reduces every micro-batch into a shard-sized buffer. Step: the own slices are
updated, then every bucket is gathered back in place. Missing gradients count as zeros; a parameter
no rank used this step is put back after the step with its optimizer state (unused_parameters), as
torch skips it. fp16_allreduce moves
the reduce-scatter in fp16; the gathered parameters stay full precision.
"""
from __future__ import annotations

from typing import Any, ClassVar, Dict, List, Optional, Sequence, Set

import torch

import horovod.torch as hvd

from hvdtrain.distributed.world import World
from hvdtrain.strategies.optimizers import repoint_optimizer
from hvdtrain.strategies.sharding import flat_buckets as fb
from hvdtrain.strategies.sharding.sliced import ShardedStrategy
from hvdtrain.strategies.unused_parameters import GradientUse, start_agreement, step_skipping


class ZeroStrategy(ShardedStrategy):
    """ZeRO stage 1 (sharded optimizer state) or 2 (and sharded gradients); see the module text.

    Clear gradients with ``zero_grad()``; the model's parameters' .grad are views into the
    buckets (stage 1) or absent between steps (stage 2). Parameters not in the optimizer, or
    frozen when the strategy is built, are left alone. Under Horovod elastic the buckets are cut
    anew for every new world, and the state comes back from the newest checkpoint.

    Args:
        model: the model; its parameters are handled as the strategy says.
        optimizer: the user's optimizer over them.
        world: this rank's World (its data-parallel group).
        accumulation: micro-batches per optimizer step.
        fp16_allreduce: compress gradients to fp16 for their exchange.
        bucket_bytes: the largest flat bucket, in bytes.
    """

    stage: ClassVar[int]

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: World,
                 accumulation: int, fp16_allreduce: bool, bucket_bytes: int = 25 * 2**20) -> None:
        self.check_optimizer(optimizer)  # before any collective: the same verdict on every rank
        if accumulation < 1 or bucket_bytes < 1:
            raise ValueError(f"accumulation ({accumulation}) and bucket_bytes ({bucket_bytes}) must be >= 1")
        super().__init__(model, optimizer, world, accumulation, fp16_allreduce)
        # The user's optimizer names the parameters and their groups: a new world's buckets are cut from it.
        self._user_optimizer, self._bucket_bytes = optimizer, bucket_bytes
        self.buckets = fb.bucket_parameters(model, optimizer, bucket_bytes, world.rank, world.size,
                                            whole=self._kept_whole(optimizer))
        self._attach_gradient_buffers(fp16_allreduce)
        self._take_optimizer(optimizer)
        self._begin_step_bookkeeping()

    def _begin_step_bookkeeping(self) -> None:
        """Nothing in flight or pending, and the hooks on the current buckets' parameters."""
        self._in_flight: Dict[str, Any] = {}  # collective name -> Horovod handle
        self._backwards = 0  # backward passes since the last synchronize
        self._communicate = False  # whether this micro-batch's backward reduce-scatters
        self._unreduced = False  # gradients produced since the last reduction
        self._hooks = self._register_hooks()
        self._use = GradientUse([param for bucket in self.buckets for param in bucket.params])

    def follow_world(self, world: World) -> None:
        """Horovod elastic formed a new world: the buckets are cut for its ranks (each parameter
        keeps its value), the optimizer steps the new slices and its state is dropped (other workers
        held most of it, a lost one took its part along): the elastic sync loads the newest
        checkpoint into them. Handles of collectives the old world did not finish are dropped."""
        super().follow_world(world)
        self.close()
        for param in self.model.parameters():
            param.grad = None  # views of the old buckets' gradient buffers
        self.buckets = fb.bucket_parameters(self.model, self._user_optimizer, self._bucket_bytes, world.rank,
                                            world.size, whole=self._kept_whole(self._user_optimizer))
        self._attach_gradient_buffers(self.fp16_allreduce)
        repoint_optimizer(self.optimizer, [[b.shard for b in self.buckets if b.group == group]
                                           for group in range(len(self.optimizer.param_groups))])
        self._carried_state = None
        self._begin_step_bookkeeping()

    # Construction: everything a step needs is laid out once, here.

    def _kept_whole(self, optimizer: torch.optim.Optimizer) -> Set[int]:
        """ids of the optimizer's parameters left out of the buckets, whole on this rank: none here (a
        subclass that reduces and steps some itself names them: zero_experts.py's expert shares)."""
        return set()

    def _attach_gradient_buffers(self, fp16_allreduce: bool) -> None:
        for bucket in self.buckets:
            bucket.fp16_wire = fp16_allreduce and bucket.dtype in (torch.float32, torch.float64)
            if bucket.fp16_wire:
                bucket.grad_name += ".fp16"  # another dtype on the wire: another collective
            if self.stage == 1:
                fb.attach_gradient_views(bucket, torch.zeros_like(bucket.flat_param))
                bucket.shard_grad = bucket.own_slice(bucket.flat_grad)
            else:
                bucket.shard_grad = torch.zeros_like(bucket.shard)
            bucket.shard.grad = bucket.shard_grad

    def _register_hooks(self) -> List[Any]:
        hooks = []
        for bucket in self.buckets:
            for index, param in enumerate(bucket.params):
                hooks.append(param.register_post_accumulate_grad_hook(
                    lambda _, bucket=bucket, index=index: self._on_gradient_ready(bucket, index)))
        return hooks

    def close(self) -> None:
        """Remove the hooks on the model's parameters (before building another strategy on it)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._use.close()

    # Backward and the gradients' reduce-scatter.

    def backward(self, loss: torch.Tensor) -> None:
        self._begin_micro_batch()
        loss.backward()

    def _begin_micro_batch(self) -> None:
        if self._backwards == self.accumulation:
            raise RuntimeError(
                f"backward() ran {self.accumulation + 1} times since the last synchronize(), with "
                f"accumulation={self.accumulation}: call synchronize(), step() and zero_grad() "
                f"after every {self.accumulation} backward passes")
        if self.stage == 2 and self._unreduced:
            self._finish_reductions()  # the previous micro-batch's, overlapped with this forward
        elif self.stage == 1 and self._backwards == 0:
            self._reattach_cleared_gradients()
        self._backwards += 1
        self._communicate = self.stage == 2 or self._backwards == self.accumulation
        self._unreduced = True
        for bucket in self.buckets:
            bucket.arrived = 0

    def _reattach_cleared_gradients(self) -> None:
        """model.zero_grad() sets .grad to None, which would detach them from the buckets."""
        for bucket in self.buckets:
            if any(param.grad is None for param in bucket.params):
                bucket.flat_grad.zero_()
                fb.attach_gradient_views(bucket, bucket.flat_grad)

    def _on_gradient_ready(self, bucket: fb.FlatBucket, index: int) -> None:
        if self.stage == 2:
            fb.take_gradient(bucket, index)  # stage 1 accumulates into its buffer's views in place
        bucket.arrived += 1
        if self._communicate and bucket.arrived == len(bucket.params) and not bucket.started:
            self._start_reduction(bucket)
            if self.stage == 2:
                self._finish_completed_reductions()  # free full-size gradients early

    def _start_reduction(self, bucket: fb.FlatBucket) -> None:
        full = bucket.flat_grad if self.stage == 1 else fb.complete_gradients(bucket)  # missing ones count as zeros
        grad = full.half() if bucket.fp16_wire else full
        self._in_flight[bucket.grad_name] = hvd.reducescatter_async(
            grad, name=bucket.grad_name, op=hvd.Average)
        bucket.started = True
        self._unreduced = True

    def _finish_reduction(self, bucket: fb.FlatBucket) -> None:
        mine = self._wait(bucket.grad_name)  # this rank's slice, averaged over ranks
        if self.stage == 1:
            bucket.shard_grad.copy_(mine)
            bucket.shard.grad = bucket.shard_grad  # in case optimizer.zero_grad() set it to None
        else:
            fb.accumulate_shard_gradient(bucket, mine)  # over micro-batches
            fb.release_gradients(bucket)

    def _finish_completed_reductions(self) -> None:
        for bucket in self.buckets:
            handle = self._in_flight.get(bucket.grad_name)
            if handle is not None and hvd.poll(handle):
                self._finish_reduction(bucket)

    def _finish_reductions(self) -> None:
        for bucket in self.buckets:
            if not bucket.started:
                self._start_reduction(bucket)  # missing gradients count as zeros
        for bucket in self.buckets:
            if bucket.grad_name in self._in_flight:
                self._finish_reduction(bucket)
            bucket.started = False
        self._unreduced = False

    def synchronize(self) -> None:
        if self._unreduced:
            self._finish_reductions()
        if self.stage == 2:
            for bucket in self.buckets:
                fb.settle_shard_gradient(bucket)
        self._backwards = 0
        self._communicate = False

    # The update, and the parameters gathered back.

    def step(self) -> None:
        # Started before the reductions' waits, so that Horovod can carry it alongside them.
        agreement = start_agreement(self._use.used_here(), name=f"zero.used.{len(self._use.params)}",
                                    device=self.world.device)
        self.synchronize()  # nothing left to do when the caller already synchronized
        step_skipping(self.optimizer, self.buckets, self._use, agreement)
        self._gather_parameters()
        self._carried_state = None

    def owned_parameters_changed(self) -> None:
        self._gather_parameters()

    def _gather_parameters(self) -> None:
        """Every rank's updated slices into every rank's buckets, in place (see gather_in_place)."""
        started = []
        for bucket in self.buckets:  # all started before any is waited on
            handles = gather_in_place(bucket, bucket.flat_param)
            self._in_flight.update(handles)
            started += handles
        for name in started:
            self._wait(name)

    def zero_grad(self) -> None:
        self.synchronize()  # a reduction in flight must still finish on every rank
        for bucket in self.buckets:
            if self.stage == 1:
                bucket.flat_grad.zero_()
                bucket.shard.grad = bucket.shard_grad
            else:
                bucket.shard.grad = None  # the next reduce-scatter's output becomes it (accumulate_shard_gradient)
        self._use.reset()  # also when the step was skipped (a non-finite gradient)

    # Collectives' bookkeeping (pending_communication is read from the watchdog's thread).

    def _start_gather(self, name: str, tensor: torch.Tensor) -> None:
        self._in_flight[name] = hvd.allgather_async(tensor.detach(), name=name)

    def _wait(self, name: str) -> torch.Tensor:
        result = hvd.synchronize(self._in_flight[name])
        del self._in_flight[name]
        return result

    def pending_communication(self) -> List[str]:
        return [name for name, handle in dict(self._in_flight).items() if not _finished(handle)]

    # The full state (broadcast_from_root, state_dict, load_state_dict): sharding/sliced.py.

    def _gather_optimizer_state(self) -> Dict[str, Any]:
        """The user's optimizer's state_dict, assembled from every rank's shards (collective)."""
        shard_states = [self.optimizer.state.get(bucket.shard, {}) for bucket in self.buckets]
        per_element = [[key for key, value in shard.items() if fb.is_elementwise(value)]
                       for shard in shard_states]
        for bucket, shard, keys in zip(self.buckets, shard_states, per_element):
            for key in keys:  # all started before any is waited on
                self._start_gather(bucket.name(f"state.{key}"), shard[key])
        gathered = [{key: self._wait(bucket.name(f"state.{key}")) for key in keys}
                    for bucket, keys in zip(self.buckets, per_element)]
        return fb.full_state_dict(self.buckets, self._group_indices, self.optimizer.param_groups,
                                  shard_states, gathered)

    def _after_shard_load(self) -> None:
        """Every rank's own slices into every rank's buckets: the full parameters everywhere."""
        handles = [hvd.allgather_async(bucket.shard.detach(), name=bucket.name("load")) for bucket in self.buckets]
        for bucket, handle in zip(self.buckets, handles):
            bucket.flat_param.copy_(hvd.synchronize(handle))


def gather_in_place(bucket: fb.FlatBucket, flat: torch.Tensor, process_set: Any = None,
                    ranks: Optional[Sequence[int]] = None) -> Dict[str, Any]:
    """Start an all-gather of ``flat``'s slices into ``flat`` itself: one in-place broadcast per
    slice, from the rank that owns it (which must already hold its slice there). Returns the
    handles by collective name (``bucket.param_name`` + "." + the owner's rank).

    Horovod's allgather has no output argument: it returns a new full-size tensor, first-touched
    page by page, then copied into the buffer, every step (glibc maps blocks this large afresh each
    time). The broadcasts move the same bytes (each rank receives the N - 1 other slices) with
    neither: `hvdtrain bench strategies` measured the difference (docs/benchmarks.md, Strategies).

    Args:
        bucket: the bucket whose slices are gathered.
        flat: its full-size buffer, holding this rank's slice already.
        process_set: the ranks that share the bucket (None: every rank).
        ranks: their global ranks, in slice order (None: slice i is rank i's).
    """
    handles = {}
    where = {} if process_set is None else {"process_set": process_set}
    for owner in range(bucket.world_size):
        name = f"{bucket.param_name}.{owner}"
        root = owner if ranks is None else ranks[owner]
        handles[name] = hvd.broadcast_async_(bucket.slice_of(flat, owner), root_rank=root, name=name, **where)
    return handles


def _finished(handle: Any) -> bool:
    try:
        return hvd.poll(handle)
    except (ValueError, RuntimeError):  # waited for and cleared by the training thread meanwhile
        return True


class Zero1Strategy(ZeroStrategy):
    """ZeRO stage 1: optimizer state sharded; full gradients, reduce-scattered once per step."""

    name = "zero1"
    stage = 1


class Zero2Strategy(ZeroStrategy):
    """ZeRO stage 2: optimizer state and gradients sharded; every micro-batch reduce-scatters."""

    name = "zero2"
    stage = 2
