"""Fully sharded data parallelism (ZeRO stage 3, PyTorch FSDP's scheme) on Horovod.

Each rank keeps 1/N of every parameter, gradient and optimizer state: its slices of the units' flat
buffers (units.py). A unit's full parameters exist only while it computes: gathered before its
forward (the next one's gather already started), freed after, gathered again for its backward,
whose gradients are reduce-scattered (averaged, each rank adding its slice) before everything full
is freed; the root unit stays gathered from the model's forward to the end of its backward. The step
updates the shards only. Between steps a rank holds 16 Psi / N bytes for fp32 Adam, plus padding.

How much runs ahead is train.fsdp_overlap (OVERLAPS); each step down holds less during backward,
besides the 16 Psi / N bytes (fp32 Adam) of the shards. ``full``: the next unit's gather is started
while this one computes, in forward and in backward, and a unit's reduce-scatter runs while the units
before it compute their backward, one at a time: up to 4 units (the unit computing, its growing
gradient, the one fetched and the one being reduce-scattered). ``gathers``: the same gathers, each
reduce-scatter waited for at once: 3 units. ``forward``: only forward's gathers run ahead; backward
gathers a unit as it starts: 2 units, the least backward can hold (a unit's full parameters and its
full gradient). ``none``: nothing ahead. ``auto`` is ``full`` on a GPU, where the collectives run
beside the compute, and ``gathers`` on a CPU, whose collectives run on the cores that compute: a
reduce-scatter running behind backward hides little there and holds a unit more (`hvdtrain bench
strategies --fsdp-overlap` measures each).

The gathers are collectives, so every forward is one: every rank runs it, with the same units in
the same order, evaluation included. Read the model through ``state_dict()``, or make it whole with
``unshard_model()``. Not supported: a unit's parameters used outside its forward, activation
checkpointing around a unit. Parameters outside the optimizer, or frozen, stay whole on every rank.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

import torch

import horovod.torch as hvd

from hvdtrain.distributed import collectives
from hvdtrain.distributed.world import World
from hvdtrain.strategies.base import distinct_state, optimizer_state_tensors, storage_bytes
from hvdtrain.strategies.deferred_init import DeferredInit
from hvdtrain.strategies.fsdp import units as fu
from hvdtrain.strategies.fsdp.communication import UnitCommunication
from hvdtrain.strategies.fsdp.initialization import initialize_by_unit
from hvdtrain.strategies.optimizers import repoint_optimizer
from hvdtrain.strategies.sharding import flat_buckets as fb
from hvdtrain.strategies.sharding.sliced import ShardedStrategy
from hvdtrain.strategies.unused_parameters import GradientUse, start_agreement, step_skipping

OVERLAPS = ("auto", "full", "gathers", "forward", "none")  # train.fsdp_overlap (the module docstring says what each holds)


def resolve_overlap(setting: str, device: torch.device) -> str:
    """train.fsdp_overlap for this rank's device: auto is full on a GPU, gathers on a CPU."""
    if setting not in OVERLAPS:
        raise ValueError(f"train.fsdp_overlap={setting!r}: choose one of {', '.join(OVERLAPS)}")
    if setting != "auto":
        return setting
    return "full" if device.type == "cuda" else "gathers"


class FSDPStrategy(ShardedStrategy):
    """ZeRO stage 3: parameters, gradients and optimizer state sharded, gathered unit by unit.

    Args:
        model: the model; its parameters are handled as the strategy says.
        optimizer: the user's optimizer over them.
        world: this rank's World (its data-parallel group).
        accumulation: micro-batches per optimizer step.
        fp16_allreduce: compress gradients to fp16 for their exchange.
        wrap_policy: ``wrap_policy(module) -> bool`` picks the units (None: the model's blocks, see
            fsdp_units.default_wrap_policy).
        overlap: what runs ahead of the compute (OVERLAPS; auto: by the device, resolve_overlap).
        deferred: the model was built on the meta device: each rank gives values to its shards only, one unit in memory
            at a time (initialization.py).
    """

    name = "fsdp"

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: World,
                 accumulation: int, fp16_allreduce: bool, wrap_policy: Optional[fu.WrapPolicy] = None,
                 overlap: str = "auto", deferred: Optional[DeferredInit] = None) -> None:
        self.check_optimizer(optimizer)  # local: the same verdict on every rank
        if accumulation < 1:
            raise ValueError(f"accumulation ({accumulation}) must be >= 1")
        super().__init__(model, optimizer, world, accumulation, fp16_allreduce)
        self.overlap = resolve_overlap(overlap, world.device)  # local: every rank of a run has one kind of device
        self.overlap_note = f"fsdp_overlap {self.overlap}" + (f" (auto, on {world.device.type})" if overlap == "auto" else "")
        # The user's optimizer and the policy name the parameters and the units: a new world's are cut from them.
        self._user_optimizer, self._wrap_policy = optimizer, wrap_policy or fu.default_wrap_policy(model)
        # Rank 0's parameters as the user built them: what broadcast_from_root spreads, until a
        # step or a load makes them stale (only rank 0 keeps them). A deferred model's values are
        # computed alike on every rank: nothing to spread.
        self.root, self.units, self._initial_params = fu.build_units(
            model, optimizer, self._wrap_policy, *self._shard_place(world),
            keep_initial=world.rank == 0 and deferred is None, with_values=deferred is None,
            whole=self._kept_whole(optimizer))
        self._initial_pending = deferred is None
        if deferred is not None:
            initialize_by_unit(deferred, self.root, self.units)
        self._adopt_units()
        self._take_optimizer(optimizer)
        self._begin_step_bookkeeping()

    @classmethod
    def from_config(cls, config: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: World,
                    **context: Any) -> "FSDPStrategy":
        """Built from the settings; ``context``'s deferred initialization, if any, is taken.

        Args:
            config: the run's settings (TrainConfig).
            model: the model.
            optimizer: its optimizer.
            world: this rank's World.
            context: what set-up knows besides: mesh, plan, loss_fn, deferred.
        """
        return cls(model, optimizer, world, config.accumulation, config.fp16_allreduce,
                   overlap=config.fsdp_overlap, deferred=context.get("deferred"))

    def _kept_whole(self, optimizer: torch.optim.Optimizer) -> Set[int]:
        """ids of the optimizer's parameters left out of the units, whole on this rank: none here (a
        subclass that reduces and steps some itself names them)."""
        return set()

    def _shard_place(self, world: World) -> Tuple[int, int]:
        """(this rank's slice, slices per buffer): every rank's of the world here (hsdp: its shard group's)."""
        return world.rank, world.size

    def _communication(self) -> UnitCommunication:
        """The buffers' collectives: over every rank here (hsdp: over the shard group)."""
        return UnitCommunication(self.buckets, reductions_behind=self._reductions_behind)

    @property
    def _reductions_behind(self) -> int:
        """Reduce-scatters left running while backward goes on: one under full overlap, else none."""
        return 1 if self.overlap == "full" else 0

    @property
    def _prefetch_in_backward(self) -> bool:
        return self.overlap in ("full", "gathers")

    def _adopt_units(self) -> None:
        self.buckets = [bucket for unit in self.all_units for bucket in unit.buckets]
        self._managed = {id(p) for bucket in self.buckets for p in bucket.params}
        self._set_gradient_wire(self.fp16_allreduce)
        self.comm = self._communication()

    def _begin_step_bookkeeping(self) -> None:
        """No unit order known yet, nothing open, and the hooks on the current units."""
        self._recording: Optional[List[fu.FSDPUnit]] = None  # the first forward's unit order
        self._next_forward: Dict[fu.FSDPUnit, fu.FSDPUnit] = {}
        self._next_backward: Dict[fu.FSDPUnit, fu.FSDPUnit] = {}
        self._last_forward: Optional[fu.FSDPUnit] = None  # where backward starts
        self._order_known = False
        self._open = False  # gradients arrived since the last micro-batch was closed
        self._callback_queued = False
        self._backwards = 0
        self._hooks = self._register_hooks()
        self._use = GradientUse([param for bucket in self.buckets for param in bucket.params])

    def follow_world(self, world: World) -> None:
        """Horovod elastic formed a new world: the units' buffers are cut for its ranks, the shards
        start at zero, the optimizer steps them with its state dropped (a lost worker took its part
        of both along): the elastic sync loads the newest checkpoint into them."""
        super().follow_world(world)
        self.close()
        for param in self.model.parameters():
            param.grad = None
        self.root, self.units, _ = fu.build_units(self.model, self._user_optimizer, self._wrap_policy,
                                                  *self._shard_place(world), keep_initial=False, with_values=False,
                                                  whole=self._kept_whole(self._user_optimizer))
        self._initial_params, self._initial_pending = [], False
        self._adopt_units()
        repoint_optimizer(self.optimizer, [[b.shard for b in self.buckets if b.group == group]
                                           for group in range(len(self.optimizer.param_groups))])
        self._carried_state = None
        self._begin_step_bookkeeping()

    @property
    def all_units(self) -> List[fu.FSDPUnit]:
        return [self.root] + self.units

    def _set_gradient_wire(self, fp16_allreduce: bool) -> None:
        for bucket in self.buckets:
            bucket.fp16_wire = fp16_allreduce and bucket.dtype in (torch.float32, torch.float64)
            if bucket.fp16_wire:
                bucket.grad_name += ".fp16"  # another dtype on the wire: another collective

    def _register_hooks(self) -> List[Any]:
        # Ours run first before a forward (a user's pre-hook may read the parameters).
        hooks = [self.model.register_forward_pre_hook(self._before_model_forward, prepend=True),
                 self.model.register_forward_hook(self._after_model_forward)]
        for unit in self.units:
            hooks.append(unit.module.register_forward_pre_hook(
                lambda module, args, unit=unit: self._before_unit_forward(unit), prepend=True))
            hooks.append(unit.module.register_forward_hook(
                lambda module, args, output, unit=unit: self._after_unit_forward(unit, output)))
        for unit in self.all_units:
            for bucket in unit.buckets:
                for index, param in enumerate(bucket.params):
                    hooks.append(param.register_post_accumulate_grad_hook(
                        lambda param, unit=unit, bucket=bucket, index=index: self._on_gradient_ready(unit, bucket, index)))
        return hooks

    def close(self) -> None:
        """Remove the hooks on the model; its parameters keep no memory: see unshard_model()."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._use.close()

    def whole_model(self) -> None:
        self.unshard_model()

    def unshard_model(self) -> None:
        """The model whole on every rank, with the trained values, each parameter in a storage of
        its own, and the hooks removed (collective): for using the model alone after training
        (rank 0 sampling from it, say) or building another strategy on it. This one is done."""
        self.synchronize()
        for unit in self.all_units:
            self.comm.ensure_gathered(unit)
            for bucket in unit.buckets:
                for param in bucket.params:
                    param.data = param.data.clone()
            self.comm.free(unit)
        self.close()

    def full_tensors(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """Unit by unit: each gathered, its parameters handed out, freed again, so that no rank holds
        more than one unit whole; buffers and parameters outside the optimizer are whole already."""
        self.synchronize()
        named = list(distinct_state(self.model))
        first_names = {id(value): name for name, value in named}
        in_units = {id(p) for unit in self.all_units for bucket in unit.buckets for p in bucket.params}
        for name, value in named:
            if id(value) not in in_units:
                yield name, value.detach()
        for unit in self.all_units:
            was_free = unit.state == fu.FREE
            self.comm.ensure_gathered(unit)
            for bucket in unit.buckets:
                for param in bucket.params:
                    if id(param) in first_names:
                        yield first_names[id(param)], param.detach()
            if was_free:
                self.comm.free(unit)

    # Forward: gather before a unit computes, free after.

    def _before_model_forward(self, module: torch.nn.Module, args: Any) -> None:
        if not self._order_known:
            self._recording = []
        self.comm.ensure_gathered(self.root)

    def _after_model_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._recording is not None:
            self._learn_order(self._recording)
        waiting = [t for t in _tensors(output) if t.requires_grad] if torch.is_grad_enabled() else []
        for unit in self.units:
            if not (waiting and unit is self._last_forward and unit.state == fu.GATHERED):
                self.comm.free(unit)  # prefetched but not run this time, or kept for a backward that never comes
        for tensor in waiting:
            tensor.register_hook(self._on_backward_start)
        if not waiting:  # no backward will come through this forward (evaluation)
            self.comm.free(self.root)

    def _learn_order(self, order: List[fu.FSDPUnit]) -> None:
        """Prefetch follows the first forward's order of units, and backward runs it in reverse."""
        self._next_forward = dict(zip(order, order[1:]))
        self._next_backward = dict(zip(order[1:], order))
        self._last_forward = order[-1] if order else None
        self._recording, self._order_known = None, True

    def _before_unit_forward(self, unit: fu.FSDPUnit) -> None:
        if self._recording is not None and unit not in self._recording:
            self._recording.append(unit)
        self.comm.ensure_gathered(unit)
        if self.overlap != "none" and unit in self._next_forward:
            self.comm.start_gather(self._next_forward[unit])

    def _after_unit_forward(self, unit: fu.FSDPUnit, output: Any) -> None:
        # The forward's last unit is the backward's first: it stays gathered (as PyTorch FSDP keeps
        # its root), and backward starts without waiting for a gather. The others are freed;
        # autograd's saved views see the storage again once backward re-gathers.
        if not (torch.is_grad_enabled() and unit is self._last_forward):
            self.comm.free(unit)
        if torch.is_grad_enabled():
            for tensor in _tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(lambda grad, unit=unit: self._before_unit_backward(unit))

    # Backward: gather again, reduce-scatter the gradients, free.

    def backward(self, loss: torch.Tensor) -> None:
        if self._backwards == self.accumulation:
            raise RuntimeError(
                f"backward() ran {self.accumulation + 1} times since the last synchronize(), with "
                f"accumulation={self.accumulation}: call synchronize(), step() and zero_grad() "
                f"after every {self.accumulation} backward passes")
        self._backwards += 1
        loss.backward()

    def _on_backward_start(self, grad: torch.Tensor) -> None:
        if not self._callback_queued:
            # The autograd engine calls it once this backward is over (PyTorch DDP and FSDP do
            # the same): the one place that sees the end of every backward, however it was called.
            torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)
            self._callback_queued = True
        self.comm.ensure_gathered(self.root)  # freed meanwhile by an evaluation forward, say
        # The root's backward (the head, the loss) runs first: time to fetch the unit after the last.
        following = self._next_backward.get(self._last_forward)
        if self._prefetch_in_backward and following is not None and not following.reduction_started:
            self.comm.start_gather(following)

    def _before_unit_backward(self, unit: fu.FSDPUnit) -> None:
        if unit.reduction_started:
            return  # the late hook of an output that bypassed the unit's parameters
        self.comm.ensure_gathered(unit)
        previous = self._next_backward.get(unit)
        if self._prefetch_in_backward and previous is not None and not previous.reduction_started:
            self.comm.start_gather(previous)

    def _on_gradient_ready(self, unit: fu.FSDPUnit, bucket: fu.ShardedBucket, index: int) -> None:
        fb.take_gradient(bucket, index)  # into the bucket's full gradient, made at its first one
        self._open = True
        bucket.arrived += 1
        if bucket.arrived == len(bucket.params) and not bucket.started:
            self.comm.start_reduction(bucket)
            if unit.reduction_started:
                self.comm.free(unit)
            self.comm.finish_completed_reductions()

    def _after_backward(self) -> None:
        self._callback_queued = False
        self._close_micro_batch()

    def _close_micro_batch(self) -> None:
        """Every buffer reduce-scattered once this micro-batch, on every rank; nothing gathered."""
        for bucket in self.buckets:
            if not bucket.started:
                self.comm.start_reduction(bucket)  # missing gradients count as zeros
        for unit in self.all_units:
            self.comm.free(unit)
        for bucket in self.buckets:
            bucket.started, bucket.arrived = False, 0
        self._open = False
        self.comm.finish_completed_reductions()

    # The step.

    def synchronize(self) -> None:
        if self._open:  # a backward whose end the engine did not report
            self._close_micro_batch()
        self.comm.finish_reductions()
        for bucket in self.buckets:
            fb.settle_shard_gradient(bucket)
        for unit in self.all_units:
            self.comm.free(unit)  # the root of a forward that no backward followed
        self._backwards = 0

    def step(self) -> None:
        # Started before the reductions' waits, so that Horovod can carry it alongside them.
        agreement = start_agreement(self._use.used_here(), name=f"fsdp.used.{len(self._use.params)}",
                                    device=self.world.device)
        self.synchronize()  # nothing left to do when the caller already synchronized
        step_skipping(self.optimizer, self.buckets, self._use, agreement)  # a parameter no rank used: skipped
        self._carried_state = None
        self._initial_params, self._initial_pending = [], False

    def zero_grad(self) -> None:
        self.synchronize()  # a reduction in flight must still finish on every rank
        for bucket in self.buckets:
            bucket.shard.grad = None  # the next reduce-scatter's output becomes it (accumulate_shard_gradient)
        self._use.reset()  # also when the step was skipped (a non-finite gradient)

    def pending_communication(self) -> List[str]:
        return self.comm.pending()

    # Full state: the same as one process's, whatever the strategy that reads it.

    def broadcast_from_root(self) -> None:
        """Rank 0's parameters, buffers and optimizer state on every rank. Once a step or a load has
        happened, the shards already form one model on every rank: only buffers and state move."""
        hvd.broadcast_parameters({name: tensor.detach() for name, tensor in self._unmanaged_state().items()},
                                 root_rank=0)
        if self._initial_pending:
            self._broadcast_initial_parameters()
        full = self._carried_state if self._carried_state is not None else self._gather_optimizer_state()
        self._load_optimizer_state(collectives.broadcast_state(full, root_rank=0, name="fsdp.optimizer"))
        self._carried_state = None

    def _broadcast_initial_parameters(self) -> None:
        """One buffer at a time, so that a rank holds at most one buffer's full size extra."""
        for bucket in self.buckets:
            full = self._initial_params[bucket.index] if self.world.rank == 0 else \
                bucket.shard.new_empty(bucket.padded_numel)
            hvd.broadcast_(full, root_rank=0, name=bucket.name("initial"))
            with torch.no_grad():
                bucket.shard.copy_(bucket.own_slice(full))
        self._initial_params, self._initial_pending = [], False

    def state_dict(self) -> Dict[str, Any]:
        return {"model": self._gathered_model_state(), "optimizer": self._gather_optimizer_state()}

    def _gathered_model_state(self) -> Dict[str, torch.Tensor]:
        values = self.comm.gathered_parameter_values([unit for unit in self.all_units if unit.buckets])
        return {name: values.get(id(tensor), tensor.detach())  # buffers as they are
                for name, tensor in self.model.state_dict(keep_vars=True).items()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Each rank keeps its slices of the full state (local: every rank holds all of it)."""
        fu.load_shards(self.model, self.buckets, state["model"])
        self.model.load_state_dict({name: state["model"][name] for name in self._unmanaged_state()}, strict=False)
        self._load_optimizer_state(state["optimizer"])
        self._carried_state = None
        self._initial_params, self._initial_pending = [], False

    def _unmanaged_state(self) -> Dict[str, torch.Tensor]:
        """Buffers, and parameters the optimizer does not train: whole on every rank."""
        return {name: tensor for name, tensor in self.model.state_dict(keep_vars=True).items()
                if id(tensor) not in self._managed}

    def _gather_optimizer_state(self) -> Dict[str, Any]:
        """The user's optimizer's state_dict, assembled from every rank's shards (collective)."""
        shard_states = [self.optimizer.state.get(bucket.shard, {}) for bucket in self.buckets]
        gathered = self.comm.gather_states([{key: value for key, value in shard.items() if fb.is_elementwise(value)}
                                            for shard in shard_states])
        return fb.full_state_dict(self.buckets, self._group_indices, self.optimizer.param_groups,
                                  shard_states, gathered)

    def _after_shard_load(self) -> None:
        self._initial_params, self._initial_pending = [], False

    # What this rank holds.

    def memory_bytes(self) -> Dict[str, int]:
        """Counted from storages: a freed full buffer counts 0 bytes, a gathered one its full size."""
        params = list(self.model.parameters()) + [bucket.shard for bucket in self.buckets]
        grads = [p.grad for p in params] + [t for bucket in self.buckets
                                            for t in (bucket.shard_grad, bucket.flat_grad, bucket.reducing)]
        return {"parameters": storage_bytes(params + self._initial_params), "gradients": storage_bytes(grads),
                "optimizer_state": storage_bytes(optimizer_state_tensors(self.optimizer))}

    def largest_unit_bytes(self) -> int:
        """The full size of the largest unit (the root included): what ZeRO-3 adds to 16 Psi / N
        while that unit computes."""
        return max((unit.full_bytes for unit in self.all_units), default=0)


def _tensors(output: Any) -> List[torch.Tensor]:
    """The tensors in a module's output (a tensor, or tuples, lists and dicts of them)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _tensors(item)]
    if isinstance(output, Mapping):
        return [t for item in output.values() for t in _tensors(item)]
    return []
