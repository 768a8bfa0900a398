"""Experts beside the shards: what fsdp x E (hvdtrain.strategies.fsdp.experts) and zero1/zero2 x E
(hvdtrain.strategies.zero_experts) share. Every fused experts module is split over expert groups of E
consecutive ranks (hvdtrain.parallel.experts), everything else is sharded over every rank by the
strategy the mixin is combined with (fsdp's units, ZeRO's flat buckets) as without experts.

Set-up, on every rank alike and in this order: rank 0's whole model and optimizer state broadcast
while every rank holds the whole model; each experts module replaced by this rank's share (as the
ddp variant does, hvdtrain.strategies.experts.split_model_experts); then the sharded strategy's flat
buffers cut from the rest. The shares stay out of the flat buffers (a buffer's slices would cut them
across ranks that hold other experts): a rank holds its share whole (1/E of the experts), with its
gradient and optimizer state, which no gather or free touches, while the rest is 1/N per rank.

One optimizer of the user's class steps both, so the learning-rate schedule drives both: in each
parameter group the flat slices, then the expert shares. The experts' gradients accumulate in their
.grad over a step's micro-batches and are reduced once per step in synchronize(), while the sharded
strategy's reduce-scatters finish: averaged over the replica group (the ranks holding the same
experts) and divided by E, as the ddp variant does, which gives one process's gradient. Clipping
counts every element once over the world: each rank its slices, the first expert group the experts.

A full checkpoint holds the sharded strategy's gathered state with the experts gathered whole over
the expert group (so a run resumes at any E, E=1 included, under any strategy, and exports), each
rank cutting its share back on load. A sharded one gathers nothing: each rank writes the ranges of
the parameters its slices of the flat buffers hold, and the first expert group the experts, each once
(hvdtrain.strategies.expert_shards, in a mesh's layout, alike under fsdp and zero); a rank reads back
from every rank's file only its slices and its experts, at this layout or any other, and any strategy
reads it through the checkpoint's sources.

What differs between the two is a few hooks (ExpertsBesideShards): _sharding (the name in the label
and the refusals), _collective_prefix (of the experts' collectives' names, part of the cross-rank
protocol: each strategy keeps its own), _whole_model_state (how
the whole model state is gathered), _shard_place (this rank's slice) and each strategy's own
micro-batch hook, which sets _experts_owed.
"""
from __future__ import annotations

from typing import Any, ClassVar, Dict, Iterator, List, Set, Tuple

import torch

import horovod.torch as hvd

from hvdtrain.common.capabilities import ELASTIC
from hvdtrain.distributed.world import World
from hvdtrain.parallel import experts as ep
from hvdtrain.strategies import clipping, expert_shards
from hvdtrain.strategies.experts import ExpertParallelStrategy, split_model_experts
from hvdtrain.strategies.optimizers import optimizer_like
from hvdtrain.strategies.sharding import flat_buckets as fb
from hvdtrain.strategies.sharding import shard_state


class ExpertsBesideShards:
    """Mixin, first among the bases of a sharded strategy (fsdp's, ZeRO's) whose fused experts are
    dealt out over expert groups of ``experts`` ranks, outside its flat buffers.

    A subclass calls _split_experts before the sharded strategy's constructor, sets the class
    attributes below, defines _sharding, _whole_model_state and _shard_place, and sets ``_experts_owed``
    once per micro-batch on every rank alike (in the sharded strategy's micro-batch hook).
    """

    # The prefix of the experts' collectives' names: "ep.fsdp", "ep.zero" (part of the cross-rank protocol).
    _collective_prefix: ClassVar[str]

    def _split_experts(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: World,
                       experts: int, topology: Any) -> None:
        """Each experts module of ``model`` cut to this rank's share (a collective: rank 0's whole
        state broadcast first), before the sharded strategy's set-up, which calls _kept_whole."""
        self.groups = split_model_experts(model, optimizer, world, experts, topology)
        self.experts = experts
        # The shares, for _kept_whole and _take_optimizer (called by the sharded set-up before the subclass's ends).
        self._shares = [share for _, share in ep.expert_parameters(model)]
        self._expert_names = {name for name, _ in ep.expert_parameters(model)}
        self._experts_owed = False  # a micro-batch ran since the experts' gradients were last reduced

    @property
    def _sharding(self) -> str:
        """The sharded strategy's name in the label and the refusals: fsdp, zero1, zero2."""
        raise NotImplementedError

    def _whole_model_state(self) -> Dict[str, torch.Tensor]:
        """The model's state_dict, gathered whole but for the experts (each rank's share)."""
        raise NotImplementedError

    @property
    def label(self) -> str:
        return f"{self._sharding} x experts {self.experts}"

    def _kept_whole(self, optimizer: torch.optim.Optimizer) -> Set[int]:
        return {id(share) for share in self._shares}

    # --- one optimizer: the slices, then the expert shares, in each parameter group ---------------

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
        """This rank's slices of a full optimizer state_dict: the sharded strategy's of its buckets,
        the experts' cut to the shares."""
        own = fb.shard_state_dict(self.buckets, self._group_indices, full)
        saved_index = {mine: theirs for saved, indices in zip(full["param_groups"], self._group_indices)
                       for mine, theirs in zip(indices, saved["params"])}
        cut = {index: ep.cut_state(saved, share) for experts in self._group_experts for index, share in experts
               if (saved := full["state"].get(saved_index[index]))}
        self.optimizer.load_state_dict(self._with_experts_state(own, cut))

    def _with_experts_state(self, own: Dict[str, Any], experts_state: Dict[int, Dict[str, Any]]) -> Dict[str, Any]:
        """The shard optimizer's state_dict: the buckets' (``own``, the sharded strategy's) and the
        shares' (by the user's index), the shares labelled past the buckets' indices, in the
        optimizer's order."""
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
                    state[index] = ep.gather_state(held, share, self.groups.expert,
                                                   f"{self._collective_prefix}.optimizer.{index}")
        return {**full, "state": dict(sorted(state.items()))}

    # --- the experts' gradients: reduced over their replica group once per step ------------------

    def synchronize(self) -> None:
        started = self._start_expert_reductions() if self._experts_owed else []
        super().synchronize()  # the sharded strategy's reduce-scatters finish while the experts' all-reduces run
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
            handle = ep.average_over_replicas_async(share.grad, self.groups, f"{self._collective_prefix}.grad.{name}")
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
        # Every element counted once over the world: each rank its own slices, the experts (equal over
        # a replica group after synchronize) by the first expert group.
        slices = super().owned_gradients()
        experts = [share.grad for share in self._shares if share.grad is not None]
        counted = slices + (experts if self.world.rank < self.experts else [])
        return clipping.clip_sharded(slices + experts, max_norm, name=f"{self.name}.grad_norm", counted=counted)

    # --- the whole state: the sharded strategy's gathered, the experts gathered over the expert group

    def broadcast_from_root(self) -> None:
        """Done at set-up, while the model was whole: the experts now differ by rank."""

    def state_dict(self) -> Dict[str, Any]:
        model = self._whole_model_state()
        for name in sorted(self._expert_names):
            model[name] = ep.gather_whole(model[name], self.groups.expert, f"{self._collective_prefix}.state.{name}")
        return {"model": model, "optimizer": self._gather_optimizer_state()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        model = dict(state["model"])
        for name, share in ep.expert_parameters(self.model):
            if name in model:
                model[name] = share.expert_shard.take(model[name])
        super().load_state_dict({**state, "model": model})

    def read_part(self, source: Any) -> Any:
        """What this rank keeps of ``source`` (local: no collective). A sharded checkpoint of any
        layout (this one's, fsdp x E's, zero x E's, ddp x E's, plain fsdp's or zero's, a mesh's): this
        rank's slices of the flat buffers, read as the sharded strategy reads them, and its experts
        with their optimizer state, each whole tensor's shape and dtype checked before any of it is
        read. A full checkpoint (every rank holds it all) or weights alone: the whole state, checked
        against the whole model (the ddp variant's)."""
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
            self._after_shard_load()  # zero: every rank's slices into every rank's buckets; fsdp: nothing to spread
            return
        if part["optimizer"] is None:  # weights only: the optimizer's own state kept
            part = {"model": part["model"], "optimizer": self._gather_optimizer_state()}
        self.load_state_dict(part)

    def full_tensors(self) -> Iterator[Tuple[str, torch.Tensor]]:
        for name, value in super().full_tensors():
            if name in self._expert_names:
                yield name, ep.gather_whole(value, self.groups.expert, f"{self._collective_prefix}.export.{name}")
            else:
                yield name, value

    def shard_state_dict(self) -> Dict[str, Any]:
        """This rank's part of a sharded checkpoint: its slices of the flat buffers, its experts if it
        is in the first expert group, the rest on rank 0 (local: nothing gathered). One layout under
        fsdp and zero (flat buffers alike: each rank the ranges of the parameters its slices cut)."""
        return expert_shards.fsdp_shard_part(self.model, self.buckets, self.optimizer,
                                             self._user_optimizer.param_groups, self.world.rank, self.world.size,
                                             self.experts)

    def check_shard_state_dict(self, state: Dict[str, Any]) -> None:
        raise NotImplementedError(self._read_from_every_file())

    def load_shard_state_dict(self, state: Dict[str, Any]) -> None:
        raise NotImplementedError(self._read_from_every_file())

    def _read_from_every_file(self) -> str:
        return (f"{self._sharding} x expert_parallel={self.experts} reads a sharded checkpoint from every rank's "
                f"file (its capabilities' loads: every part), through load_from, never one rank's file alone")

    def follow_world(self, world: World) -> None:
        raise RuntimeError(f"{self._sharding} x expert_parallel={self.experts} cannot follow a new world: "
                           f"{self.capabilities.refuses[ELASTIC]}; launch without --min-np/--max-np")

    def close_groups(self) -> None:
        """Remove the expert groups' process sets if this strategy's own topology holds them (a collective:
        every rank calls it); the run's topology closes its own."""
        self.groups.close()


def _check_whole_state(name: str, state: Dict[str, Any], whole: torch.Size) -> None:
    """ValueError unless every per-element entry of an expert's saved optimizer state has the whole
    expert's shape (a checkpoint of another model's experts is refused by name, never cut wrong)."""
    for key, value in state.items():
        if fb.is_elementwise(value) and value.shape != whole:
            raise ValueError(f"the optimizer's {key} of {name} has shape {list(value.shape)}, this model's "
                             f"{list(whole)}: it belongs to another model (resuming: start from a fresh "
                             f"checkpoint_dir)")
