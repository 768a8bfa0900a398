"""The strategies by name: which class each registered name builds, and what a launch refuses.

What each can do is declared once, in hvdtrain.common.capabilities (each class holds its record as
``Strategy.capabilities``); the settings' checks read it there when a TrainConfig is created, a
launch's (``launch_refusal``) here. Importing this module is light: a class is imported when it is
built.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Callable, Dict, Optional

from hvdtrain.common.capabilities import (DECLARED, ELASTIC, EXPERT_PARALLEL, EXPERT_PARALLEL_FSDP,
                                          EXPERT_PARALLEL_ZERO, MODEL_PARALLEL, STRATEGY_NAMES, supporting)
from hvdtrain.config.strategy_checks import either

if TYPE_CHECKING:
    import torch

    from hvdtrain.config.train import TrainConfig
    from hvdtrain.distributed.world import World
    from hvdtrain.parallel.mesh import Mesh
    from hvdtrain.parallel.topology import Topology
    from hvdtrain.parallel.model_plan import ModelPlan
    from hvdtrain.strategies.base import Strategy
    from hvdtrain.strategies.deferred_init import DeferredInit

# registered name -> "module:class": the strategies a user names (train.strategy), and the
# model-parallel layout, chosen by the mesh (train.tensor_parallel x pipeline_parallel > 1) over one of them.
STRATEGIES: Dict[str, str] = {
    "ddp": "hvdtrain.strategies.ddp:DDPStrategy",
    "zero1": "hvdtrain.strategies.zero:Zero1Strategy",
    "zero2": "hvdtrain.strategies.zero:Zero2Strategy",
    "fsdp": "hvdtrain.strategies.fsdp.strategy:FSDPStrategy",
    "hsdp": "hvdtrain.strategies.fsdp.hybrid:HSDPStrategy",
    "ps": "hvdtrain.strategies.ps:PSStrategy",
    MODEL_PARALLEL: "hvdtrain.strategies.model_parallel.strategy:ModelParallelStrategy",
    EXPERT_PARALLEL: "hvdtrain.strategies.experts:ExpertParallelStrategy",
    EXPERT_PARALLEL_FSDP: "hvdtrain.strategies.fsdp.experts:ExpertParallelFSDPStrategy",
    EXPERT_PARALLEL_ZERO: "hvdtrain.strategies.zero_experts:ExpertParallelZeroStrategy",
}


def _load(path: str) -> type:
    module, cls = path.split(":")
    return getattr(importlib.import_module(module), cls)


def strategy_class(name: str) -> type:
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}: choose one of {', '.join(STRATEGY_NAMES)}")
    return _load(STRATEGIES[name])


def chosen_name(config: "TrainConfig") -> str:
    """The registered name of the strategy ``config`` runs: the model-parallel layout over a mesh,
    expert parallelism (over ddp, fsdp, zero1 or zero2) when train.expert_parallel > 1."""
    if config.model_parallel:
        return MODEL_PARALLEL
    if config.expert_parallel > 1:
        if config.strategy == "fsdp":
            return EXPERT_PARALLEL_FSDP
        return EXPERT_PARALLEL_ZERO if config.strategy in ("zero1", "zero2") else EXPERT_PARALLEL
    return config.strategy


def launch_refusal(config: "TrainConfig", world: "World", elastic: bool) -> Optional[str]:
    """Why the configured strategy cannot run in this launch, or None; decided alike on every rank,
    before any collective, instead of failing or hanging in the first step."""
    if elastic:
        capabilities = DECLARED[chosen_name(config)]
        if not capabilities.supports(ELASTIC):
            layout = chosen_name(config) != config.strategy
            what = ("train.tensor_parallel / pipeline_parallel do not" if config.model_parallel
                    else f"train.expert_parallel={config.expert_parallel} does not" if layout
                    else f"train.strategy={config.strategy} does not")
            also = "" if layout else f"use {either(supporting(ELASTIC))} under elastic, or "
            return (f"{what} support Horovod elastic ({capabilities.refuses[ELASTIC]}): {also}launch without "
                    f"--min-np/--max-np")
        if capabilities.elastic_from_checkpoint and not config.checkpoint_dir:
            return (f"train.strategy={config.strategy} under Horovod elastic continues from the newest checkpoint "
                    "after a world change (a lost worker takes its shard of the optimizer state along): set "
                    "train.checkpoint_dir, on storage every host reads")
    if chosen_name(config) == "hsdp":
        from hvdtrain.distributed import collectives
        from hvdtrain.strategies.fsdp.hybrid import refusal

        homogeneous = bool(config.hsdp_shard_size) or collectives.homogeneous()
        return refusal(config.hsdp_shard_size, world.size, world.local_size, homogeneous)
    if config.reduction == "adasum":
        from hvdtrain.distributed import collectives
        from hvdtrain.strategies.reduction import adasum_refusal

        return adasum_refusal(world.size, world.local_size, world.cross_size, collectives.mpi_enabled(),
                              world.device.type == "cuda" and collectives.nccl_built(), collectives.homogeneous())
    return None


def build_strategy(config: "TrainConfig", model: "torch.nn.Module", optimizer: "torch.optim.Optimizer",
                   world: "World", mesh: "Optional[Mesh]" = None, plan: "Optional[ModelPlan]" = None,
                   loss_fn: Optional[Callable] = None, deferred: "Optional[DeferredInit]" = None,
                   topology: "Optional[Topology]" = None) -> "Strategy":
    """The strategy the settings ask for; with a model-parallel mesh, config.strategy over each
    data-parallel group of split replicas. Each class reads its own settings.

    Args:
        config: the run's settings.
        model: the model.
        optimizer: its optimizer.
        world: this rank's World.
        mesh: a model-parallel mesh, or None.
        plan: how to split the replicas over ``mesh``.
        loss_fn: a pipeline's last stage's loss function.
        deferred: the model was built on the meta device; a strategy that initializes by shard (its capabilities'
            ``initializes_by_shard``) takes it, the others get the model made whole first.
        topology: the run's Topology, which owns every process set: a strategy with groups of its own (hsdp's
            shard groups, the expert groups) asks it for them (None: such a strategy makes a topology of its own).
    """
    cls = strategy_class(MODEL_PARALLEL if mesh is not None else chosen_name(config))
    if deferred is not None and not cls.capabilities.initializes_by_shard:
        deferred.make_whole()
        deferred = None
    return cls.from_config(config, model, optimizer, world, mesh=mesh, plan=plan, loss_fn=loss_fn,
                           deferred=deferred, topology=topology)
