"""fsdp with expert parallelism (train.strategy=fsdp, train.expert_parallel=E): every fused experts
module split over expert groups of E consecutive ranks (hvdtrain.parallel.experts), everything else
sharded by fsdp over every rank as without experts.

Set-up, on every rank alike and in this order: rank 0's whole model and optimizer state broadcast
while every rank holds the whole model; each experts module replaced by this rank's share (as the
ddp variant does, hvdtrain.strategies.experts.split_model_experts); then fsdp's units built over the
rest. The shares stay out of the units' flat buffers: a rank holds its share whole (1/E of the
experts), which no gather or free touches, while the rest is 1/N per rank as fsdp keeps it.

One optimizer of the user's class steps both, so the learning-rate schedule drives both: in each
parameter group the flat shards, then the expert shares. The experts' gradients are reduced once per
step in synchronize(): averaged over the replica group (the ranks holding the same experts) and
divided by E, as the ddp variant does, which gives one process's gradient. Clipping counts every
element once over the world: each rank its shards, the first expert group the experts.

A full checkpoint holds fsdp's gathered state with the experts gathered whole over the expert group
(so a run resumes at any E, E=1 ddp included, and exports), each rank cutting its share back on
load. A sharded one gathers nothing: each rank writes the ranges of the parameters its slices of the
units' buffers hold, and the first expert group the experts, each once (hvdtrain.strategies.expert_shards),
in a mesh's layout; a rank reads back from every rank's file only its slices and its experts, at this
layout or any other, and any strategy reads it through the checkpoint's sources.
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, Set, Tuple

import torch

import horovod.torch as hvd

from hvdtrain.common.capabilities import ELASTIC
from hvdtrain.distributed.world import World
from hvdtrain.parallel import experts as ep
from hvdtrain.strategies import clipping, expert_shards
from hvdtrain.strategies.experts import ExpertParallelStrategy, split_model_experts
from hvdtrain.strategies.fsdp.strategy import FSDPStrategy
from hvdtrain.strategies.optimizers import optimizer_like
from hvdtrain.strategies.sharding import flat_buckets as fb
from hvdtrain.strategies.sharding import shard_state


class ExpertParallelFSDPStrategy(FSDPStrategy):
    """fsdp whose fused experts are dealt out over expert groups of ``experts`` ranks, outside its units.

    Args:
        model: the whole model; its experts modules are split here, the rest sharded by fsdp.
        optimizer: the user's optimizer over it.
        world: this rank's World (every rank is a data-parallel rank).
        accumulation: micro-batches per optimizer step.
        fp16_allreduce: compress the units' gradients to fp16 for their exchange.
        experts: E, ranks per expert group.
        overlap: what runs ahead of the compute, as fsdp's (train.fsdp_overlap).
    """

    name = "expert_parallel_fsdp"

    @classmethod
    def from_config(cls, config: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: World,
                    **context: Any) -> "ExpertParallelFSDPStrategy":
        """Built from the settings: train.expert_parallel besides fsdp's.

        Args:
            config: the run's settings (TrainConfig).
            model: the model.
            optimizer: its optimizer.
            world: this rank's World.
            context: what set-up knows besides (unused: the model comes whole, no mesh, no plan).
        """
        return cls(model, optimizer, world, config.accumulation, config.fp16_allreduce, experts=config.expert_parallel,
                   overlap=config.fsdp_overlap)

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: World,
                 accumulation: int, fp16_allreduce: bool, experts: int = 2, overlap: str = "auto") -> None:
        self.check_optimizer(optimizer)  # local, before any collective: the same verdict on every rank
        self.groups = split_model_experts(model, optimizer, world, experts)
        self.experts = experts
        # The shares' ids, for _kept_whole (called by fsdp's set-up before this one's ends).
        self._shares = [share for _, share in ep.expert_parameters(model)]
        self._expert_names = {name for name, _ in ep.expert_parameters(model)}
        super().__init__(model, optimizer, world, accumulation, fp16_allreduce, overlap=overlap)
        # Every rank holds rank 0's values already (broadcast while whole): nothing left to spread.
        self._initial_params, self._initial_pending, self._carried_state = [], False, None
        self._experts_owed = False  # a micro-batch closed since the experts' gradients were last reduced

    @property
    def label(self) -> str:
        return f"fsdp x experts {self.experts}"

    def _kept_whole(self, optimizer: torch.optim.Optimizer) -> Set[int]:
        return {id(share) for share in self._shares}

    # --- one optimizer: the shards, then the expert shares, in each parameter group --------------

    def _take_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self._group_indices = fb.indices_by_group(optimizer)
        held = {id(share) for share in self._shares}
        # Per parameter group: (the user's index, share) of its experts.
        self._group_experts = [[(index, p) for index, p in zip(indices, group["params"]) if id(p) in held]
                               for indices, group in zip(self._group_indices, optimizer.param_groups)]
        self.optimizer = optimizer_like(optimizer, [[b.shard for b in self.buckets if b.group == g] +
                                                    [share for _, share in self._group_experts[g]]
                                                    for g in range(len(optimizer.param_groups))])
        self._carried_state = None
        # The user's state, its experts' entries already cut to the shares (split_model_experts): kept as they are.
        self._load_optimizer_state(optimizer.state_dict())

    def _load_optimizer_state(self, full: Dict[str, Any]) -> None:
        """This rank's slices of a full optimizer state_dict: fsdp's of its buckets, the experts' cut
        to the shares."""
        own = fb.shard_state_dict(self.buckets, self._group_indices, full)
        saved_index = {mine: theirs for saved, indices in zip(full["param_groups"], self._group_indices)
                       for mine, theirs in zip(indices, saved["params"])}
        cut = {index: ep.cut_state(saved, share) for experts in self._group_experts for index, share in experts
               if (saved := full["state"].get(saved_index[index]))}
        self.optimizer.load_state_dict(self._with_experts_state(own, cut))

    def _with_experts_state(self, own: Dict[str, Any], experts_state: Dict[int, Dict[str, Any]]) -> Dict[str, Any]:
        """The shard optimizer's state_dict: the buckets' (``own``, fsdp's) and the shares' (by the
        user's index), the shares labelled past the buckets' indices, in the optimizer's order."""
        groups = [{**group, "params": list(group["params"])} for group in own["param_groups"]]
        state = dict(own["state"])
        for group, experts in zip(groups, self._group_experts):
            for index, _ in experts:
                label = len(self.buckets) + index
                group["params"].append(label)
                if experts_state.get(index):
                    state[label] = experts_state[index]
        return {"state": state, "param_groups": groups}

    def _gather_optimizer_state(self) -> Dict[str, Any]:
        full = super()._gather_optimizer_state()
        state = dict(full["state"])
        for experts in self._group_experts:
            for index, share in experts:
                held = self.optimizer.state.get(share)
                if held:
                    state[index] = ep.gather_state(held, share, self.groups.expert, f"ep.fsdp.optimizer.{index}")
        return {**full, "state": dict(sorted(state.items()))}

    # --- the experts' gradients: reduced over their replica group once per step ------------------

    def _close_micro_batch(self) -> None:
        super()._close_micro_batch()
        self._experts_owed = True  # as fsdp's reduce-scatters: once per micro-batch on every rank

    def synchronize(self) -> None:
        if self._open:
            self._close_micro_batch()
        started = self._start_expert_reductions() if self._experts_owed else []
        super().synchronize()  # fsdp's reduce-scatters finish while the experts' all-reduces run
        for handle in started:
            hvd.synchronize(handle)

    def _start_expert_reductions(self) -> List[Any]:
        self._experts_owed = False
        handles = []
        for name, share in ep.expert_parameters(self.model):
            if not share.requires_grad:  # frozen: no gradient, as Horovod leaves it under ddp
                continue
            if share.grad is None:  # as Horovod does: another rank of the replica group may have one
                share.grad = torch.zeros_like(share)
            handle = ep.average_over_replicas_async(share.grad, self.groups, f"ep.fsdp.grad.{name}")
            if handle is not None:
                handles.append(handle)
        return handles

    def zero_grad(self) -> None:
        super().zero_grad()
        for share in self._shares:
            share.grad = None

    def owned_gradients(self) -> List[torch.Tensor]:
        return super().owned_gradients() + [share.grad for share in self._shares if share.grad is not None]

    def owned_parameters(self) -> List[torch.Tensor]:
        return super().owned_parameters() + list(self._shares)

    def clip_grad_norm_(self, max_norm: float) -> float:
        # Every element counted once over the world: each rank its own shards, the experts (equal over
        # a replica group after synchronize) by the first expert group.
        shards = super().owned_gradients()
        experts = [share.grad for share in self._shares if share.grad is not None]
        counted = shards + (experts if self.world.rank < self.experts else [])
        return clipping.clip_sharded(shards + experts, max_norm, name="expert_parallel_fsdp.grad_norm",
                                     counted=counted)

    # --- the whole state: fsdp's gathered, the experts gathered over the expert group ------------

    def broadcast_from_root(self) -> None:
        """Done at set-up, while the model was whole: the experts now differ by rank."""

    def state_dict(self) -> Dict[str, Any]:
        model = self._gathered_model_state()
        for name in sorted(self._expert_names):
            model[name] = ep.gather_whole(model[name], self.groups.expert, f"ep.fsdp.state.{name}")
        return {"model": model, "optimizer": self._gather_optimizer_state()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        model = dict(state["model"])
        for name, share in ep.expert_parameters(self.model):
            if name in model:
                model[name] = share.expert_shard.take(model[name])
        super().load_state_dict({**state, "model": model})

    def read_part(self, source: Any) -> Any:
        """What this rank keeps of ``source`` (local: no collective). A sharded checkpoint of any
        layout (this one's, ddp x E's, plain fsdp's, a mesh's): this rank's slices of the units'
        buffers, read as fsdp reads them, and its experts with their optimizer state, each whole
        tensor's shape and dtype checked before any of it is read. A full checkpoint (every rank holds
        it all) or weights alone: the whole state, checked against the whole model (the ddp variant's)."""
        if source.held_state() is not None or source.param_groups() is None:
            return ExpertParallelStrategy.read_part(self, source)
        experts = ep.expert_parameters(self.model)
        for name, share in experts:
            source.check_tensor(source.first_held([name]), ep.whole_shape(share), share.dtype)
        rest = {name: tensor for name, tensor in shard_state.unmanaged_state(self.model, self.buckets).items()
                if name not in self._expert_names}
        flat = shard_state.part_from(source, self.shard_layout(), *self._shard_place(self.world), unmanaged=rest)
        shares = {name: source.read_slice(source.first_held([name]), share.expert_shard) for name, share in experts}
        index_of = {id(share): index for group in self._group_experts for index, share in group}
        states = {}
        for name, share in experts:
            if id(share) in index_of:
                saved = source.optimizer_state_of(index_of[id(share)], source.first_held([name])) or {}
                _check_whole_state(name, saved, ep.whole_shape(share))
                states[index_of[id(share)]] = ep.cut_state(saved, share)
        return {"flat": flat, "experts": shares, "experts_state": states}

    def load_part(self, part: Any) -> None:
        if "flat" in part:  # this rank's slices and experts (read_part from a sharded checkpoint)
            flat = part["flat"]
            optimizer = self._with_experts_state(flat["optimizer"], part["experts_state"])
            shard_state.load_shard_state_dict(self.model, self.buckets, self.optimizer, self._group_indices,
                                              {**flat, "optimizer": optimizer})
            with torch.no_grad():
                for name, share in ep.expert_parameters(self.model):
                    share.copy_(part["experts"][name])
            self._carried_state = None
            self._after_shard_load()
            return
        if part["optimizer"] is None:  # weights only: the optimizer's own state kept
            part = {"model": part["model"], "optimizer": self._gather_optimizer_state()}
        self.load_state_dict(part)

    def full_tensors(self) -> Iterator[Tuple[str, torch.Tensor]]:
        for name, value in super().full_tensors():
            if name in self._expert_names:
                yield name, ep.gather_whole(value, self.groups.expert, f"ep.fsdp.export.{name}")
            else:
                yield name, value

    def shard_state_dict(self) -> Dict[str, Any]:
        """This rank's part of a sharded checkpoint: its slices of the units' buffers, its experts if
        it is in the first expert group, the rest on rank 0 (local: nothing gathered)."""
        return expert_shards.fsdp_shard_part(self.model, self.buckets, self.optimizer,
                                             self._user_optimizer.param_groups, self.world.rank, self.world.size,
                                             self.experts)

    def check_shard_state_dict(self, state: Dict[str, Any]) -> None:
        raise NotImplementedError(self._read_from_every_file())

    def load_shard_state_dict(self, state: Dict[str, Any]) -> None:
        raise NotImplementedError(self._read_from_every_file())

    def _read_from_every_file(self) -> str:
        return (f"fsdp x expert_parallel={self.experts} reads a sharded checkpoint from every rank's file (its "
                f"capabilities' loads: every part), through load_from, never one rank's file alone")

    def follow_world(self, world: World) -> None:
        raise RuntimeError(f"fsdp x expert_parallel={self.experts} cannot follow a new world: "
                           f"{self.capabilities.refuses[ELASTIC]}; launch without --min-np/--max-np")

    def close_groups(self) -> None:
        """Remove the expert groups' process sets (a collective: every rank calls it)."""
        self.groups.close()


def _check_whole_state(name: str, state: Dict[str, Any], whole: torch.Size) -> None:
    """ValueError unless every per-element entry of an expert's saved optimizer state has the whole
    expert's shape (a checkpoint of another model's experts is refused by name, never cut wrong)."""
    for key, value in state.items():
        if fb.is_elementwise(value) and value.shape != whole:
            raise ValueError(f"the optimizer's {key} of {name} has shape {list(value.shape)}, this model's "
                             f"{list(whole)}: it belongs to another model (resuming: start from a fresh "
                             f"checkpoint_dir)")
