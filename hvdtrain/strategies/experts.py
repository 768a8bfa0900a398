"""ddp with expert parallelism (train.expert_parallel=E): every fused experts module split over
expert groups of E consecutive ranks (hvdtrain.parallel.experts), everything else replicated.

Set-up, on every rank alike: rank 0's whole model and optimizer state are broadcast while every rank
holds the whole model; each experts module is replaced by this rank's share (state_dict names
unchanged) and the optimizer steps the shares in the whole parameters' places (their state, if any,
cut alike). Horovod's DistributedOptimizer then averages every gradient as ddp does, except the
experts': theirs are averaged over the replica group (the ranks holding the same experts) and
divided by E, which gives one process's gradient (see the module's docstring of
hvdtrain.parallel.experts). Clipping counts every element once over the world.

Full checkpoints hold the experts gathered whole over the expert group (so a run resumes at any E,
E=1 included, and exports), each rank taking its share back on load. Sharded ones gather nothing:
each expert is written once, by its rank in the first expert group, the rest by rank 0, in a mesh's
layout (hvdtrain.strategies.expert_shards), read back at any E through the checkpoint's sources.
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, Tuple

import torch

from hvdtrain.distributed import collectives
from hvdtrain.distributed.world import World
from hvdtrain.parallel import experts as ep
from hvdtrain.strategies import clipping, expert_shards
from hvdtrain.strategies.base import distinct_state, tensor_names
from hvdtrain.strategies.ddp import DDPStrategy


class ExpertParallelStrategy(DDPStrategy):
    """ddp whose fused experts are dealt out over expert groups of ``experts`` ranks.

    Args:
        model: the whole model; its experts modules are split here.
        optimizer: the user's optimizer over it; its whole expert parameters are replaced by this rank's shares.
        world: this rank's World (every rank is a data-parallel rank).
        accumulation: micro-batches per optimizer step.
        fp16_allreduce: compress gradients to fp16 for their exchange.
        experts: E, ranks per expert group.
        topology: the run's Topology, which holds the expert groups' process sets (None: one of the strategy's
            own, closed by close_groups).
    """

    name = "expert_parallel"

    @classmethod
    def from_config(cls, config, model, optimizer, world, **context) -> "ExpertParallelStrategy":
        """Built from the settings: train.expert_parallel besides ddp's.

        Args:
            config: the run's settings (TrainConfig).
            model: the model.
            optimizer: its optimizer.
            world: this rank's World.
            context: what set-up knows besides: the topology, whose expert groups these are (no mesh, no plan).
        """
        return cls(model, optimizer, world, config.accumulation, config.fp16_allreduce, experts=config.expert_parallel,
                   topology=context.get("topology"))

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: World,
                 accumulation: int, fp16_allreduce: bool, experts: int = 2, topology: Any = None) -> None:
        self.groups = split_model_experts(model, optimizer, world, experts, topology)
        super().__init__(model, optimizer, world, accumulation, fp16_allreduce)
        self.experts = experts
        self._expert_names = {name for name, _ in ep.expert_parameters(model)}
        _reduce_experts_over_replicas(self.optimizer, {p for _, p in ep.expert_parameters(model)}, self.groups)

    @property
    def label(self) -> str:
        return f"ddp x experts {self.experts}"

    def broadcast_from_root(self) -> None:
        """Done at set-up, while the model was whole: the experts now differ by rank."""

    def clip_grad_norm_(self, max_norm: float) -> float:
        # Every element counted once over the world: replicated gradients by rank 0, the experts'
        # (equal over a replica group after synchronize) by the first expert group.
        gradients = self.owned_gradients()
        experts = [p.grad for _, p in ep.expert_parameters(self.model) if p.grad is not None]
        expert_ids = {id(g) for g in experts}
        counted = experts if self.world.rank < self.experts else []
        if self.world.rank == 0:
            counted = counted + [g for g in gradients if id(g) not in expert_ids]
        return clipping.clip_sharded(gradients, max_norm, name="expert_parallel.grad_norm", counted=counted)

    # --- the whole state: experts gathered over the expert group, shares taken back ----------------

    def state_dict(self) -> Dict[str, Any]:
        model = self.model.state_dict()
        for name in sorted(self._expert_names):
            model[name] = ep.gather_whole(model[name], self.groups.expert, f"ep.state.{name}")
        optimizer = self.optimizer.state_dict()
        optimizer["state"] = dict(optimizer["state"])
        for index, param in enumerate(self._optimizer_parameters()):
            state = optimizer["state"].get(index)
            if state is None or not hasattr(param, "expert_shard"):
                continue
            # A copy: torch's state_dict() holds the live state's own dicts.
            optimizer["state"][index] = ep.gather_state(state, param, self.groups.expert, f"ep.optimizer.{index}")
        return {"model": model, "optimizer": optimizer}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        model = dict(state["model"])
        for name, param in ep.expert_parameters(self.model):
            if name in model:
                model[name] = param.expert_shard.take(model[name])
        self.model.load_state_dict(model)
        optimizer = {**state["optimizer"], "state": dict(state["optimizer"]["state"])}
        for index, param in enumerate(self._optimizer_parameters()):
            saved = optimizer["state"].get(index)
            if saved is None or not hasattr(param, "expert_shard"):
                continue
            optimizer["state"][index] = ep.cut_state(saved, param)
        self.optimizer.load_state_dict(optimizer)

    def read_part(self, source: Any) -> Any:
        """The whole state (as ddp), every tensor checked against the whole model's shapes."""
        weights_only = source.param_groups() is None
        for names, value in tensor_names(self.model):
            source.check_tensor(source.first_held(names), ep.whole_shape(value), value.dtype, cast=weights_only)
        if weights_only:
            model: Dict[str, torch.Tensor] = {}
            for names, value in tensor_names(self.model):
                shape = ep.whole_shape(value)
                tensor = source.full_tensor(source.first_held(names)).reshape(shape).to(value.dtype)
                model.update((alias, tensor) for alias in names)
            return {"model": model, "optimizer": None}
        return source.full_state()

    def shard_state_dict(self) -> Dict[str, Any]:
        """This rank's part of a sharded checkpoint: its experts if it is in the first expert group, the
        replicated rest on rank 0 (local: nothing gathered). Read back through a source at any E."""
        return expert_shards.shard_part(self.model, self.optimizer, self.world.rank, self.world.size, self.experts)

    def full_tensors(self) -> Iterator[Tuple[str, torch.Tensor]]:
        for name, value in distinct_state(self.model):
            if hasattr(value, "expert_shard"):
                yield name, ep.gather_whole(value, self.groups.expert, f"ep.export.{name}")
            else:
                yield name, value.detach()

    def _optimizer_parameters(self) -> List[torch.Tensor]:
        """The parameters in the order of the optimizer state_dict's indices."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def close_groups(self) -> None:
        """Remove the expert groups' process sets if this strategy's own topology holds them (a collective: every
        rank calls it); the run's topology closes its own."""
        self.groups.close()


def split_model_experts(model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: World,
                        experts: int, topology: Any = None) -> ep.ExpertGroups:
    """The set-up every expert-parallel strategy starts with, on every rank alike: refused before any
    collective; rank 0's model and optimizer state broadcast while every rank holds the whole model;
    then each fused experts module replaced by this rank's share, which the optimizer steps in the
    whole parameter's place. Returns this rank's expert groups.

    Args:
        model: the whole model; its experts modules are split here.
        optimizer: the user's optimizer over it.
        world: this rank's World.
        experts: E, ranks per expert group.
        topology: the run's Topology, asked for the expert groups (None: a topology of the groups' own).
    """
    ep.check_world(world.size, experts)
    found = ep.fused_experts(model)
    if not found:
        raise ValueError(f"train.expert_parallel={experts}: {type(model).__name__} has no fused experts module "
                         f"(a module with num_experts and 3-D parameters, experts first, as transformers 5's "
                         f"mixture-of-experts families hold them): nothing to split; use expert_parallel=1")
    for path, module in found.items():
        ep.check_experts(path, module, experts)
    collectives.broadcast_model_and_optimizer(model, optimizer, root_rank=0)
    groups = ep.ExpertGroups.of(world, experts, topology)
    replace_experts(model, optimizer, groups)
    return groups


def replace_experts(model: torch.nn.Module, optimizer: torch.optim.Optimizer, groups: ep.ExpertGroups) -> None:
    """Each fused experts module of ``model`` replaced by this rank's share (state_dict names
    unchanged), which ``optimizer`` steps in the whole parameter's place (no collective)."""
    replaced: Dict[int, torch.nn.Parameter] = {}
    for path, module in ep.fused_experts(model).items():
        split = ep.split_experts(module, groups, path)
        parent, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent), child, split)
        for attribute, whole in module.named_parameters(recurse=False):
            replaced[id(whole)] = split._parameters[attribute]
    take_shares(optimizer, replaced)


def take_shares(optimizer: torch.optim.Optimizer, replaced: Dict[int, torch.nn.Parameter]) -> None:
    """The optimizer steps this rank's shares in place of the whole expert parameters; state it
    already holds for them (a resumed optimizer of the user's) is cut alike."""
    for group in optimizer.param_groups:
        for position, param in enumerate(group["params"]):
            share = replaced.get(id(param))
            if share is None:
                continue
            group["params"][position] = share
            state = optimizer.state.pop(param, None)
            if state:
                optimizer.state[share] = ep.cut_state(state, share)


def _reduce_experts_over_replicas(optimizer: Any, experts: set, groups: ep.ExpertGroups) -> None:
    """Horovod's DistributedOptimizer starts each gradient's all-reduce from its hooks and its
    synchronize(): for an expert parameter, the average over its replica group, divided by E."""
    plain = optimizer._allreduce_grad_async

    def reduce(param: torch.nn.Parameter) -> Tuple[Any, Any]:
        if param not in experts:
            return plain(param)
        if param.grad is None:  # as Horovod does: another rank of the group may have one
            param.grad = torch.zeros_like(param)
        compressed, context = optimizer._compression.compress(param.grad)
        handle = ep.average_over_replicas_async(compressed, groups, f"ep.grad.{optimizer._parameter_names.get(param)}")
        return (handle if handle is not None else lambda: compressed), context

    optimizer._allreduce_grad_async = reduce
