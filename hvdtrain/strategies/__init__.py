"""Training strategies, chosen by ``train.strategy``: how the model's state is spread over the ranks.

    ddp    every rank holds everything; gradients all-reduced (Horovod's DistributedOptimizer)
    zero1  optimizer state sharded: gradients reduce-scattered, each rank steps its 1/N, all-gather
    zero2  as zero1, and each rank keeps only its 1/N of the gradients
    fsdp   as zero2, and each rank keeps only its 1/N of the parameters: each block's are gathered
           for its forward and backward and freed after (ZeRO-3, fully sharded data parallel)
    ps     a parameter server: ranks 0..K-1 each hold a slice's optimizer state; every rank sends
           them its gradients and receives the stepped weights (hvd.alltoall with splits)
"""
from __future__ import annotations

import importlib
from typing import Callable, Dict, Optional, Tuple

import torch

from hvdtrain.config.train import ADASUM_STRATEGIES, TrainConfig
from hvdtrain.config.train import STRATEGIES as CONFIGURED
from hvdtrain.distributed.startup import World
from hvdtrain.parallel.mesh import Mesh
from hvdtrain.parallel.model_plan import ModelPlan
from hvdtrain.strategies.base import Strategy

# name -> (module, class); imported when chosen, so a run pays only for its own strategy.
STRATEGIES: Dict[str, Tuple[str, str]] = {
    "ddp": ("hvdtrain.strategies.ddp", "DDPStrategy"),
    "zero1": ("hvdtrain.strategies.zero", "Zero1Strategy"),
    "zero2": ("hvdtrain.strategies.zero", "Zero2Strategy"),
    "fsdp": ("hvdtrain.strategies.fsdp.strategy", "FSDPStrategy"),
    "ps": ("hvdtrain.strategies.ps", "PSStrategy"),
}
STRATEGY_NAMES = tuple(STRATEGIES)
if STRATEGY_NAMES != CONFIGURED:  # a developer's mistake: fail at import, not in a user's run
    raise ImportError(f"hvdtrain.config.train.STRATEGIES {CONFIGURED} must list the strategies here: {STRATEGY_NAMES}")
# Horovod elastic re-forms the world mid-run; a sharded state would have to be re-cut with it.
ELASTIC_STRATEGIES = ("ddp",)


def strategy_class(name: str) -> type:
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}: choose one of {', '.join(STRATEGY_NAMES)}")
    module, cls = STRATEGIES[name]
    return getattr(importlib.import_module(module), cls)


def build_strategy(config: TrainConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: World,
                   mesh: Optional[Mesh] = None, plan: Optional[ModelPlan] = None,
                   loss_fn: Optional[Callable] = None) -> Strategy:
    """The strategy ``config`` asks for, over ``model`` and ``optimizer``. With a model-parallel
    ``mesh`` it is config.strategy over each data-parallel group of split replicas (``plan`` says
    how to split; ``loss_fn`` is a pipeline's last stage's)."""
    if mesh is not None:
        from hvdtrain.strategies.model_parallel import ModelParallelStrategy

        return ModelParallelStrategy(model, optimizer, world, config.accumulation, config.fp16_allreduce, mesh,
                                     plan or ModelPlan(), loss_fn, data_parallel=config.strategy,
                                     micro_batches=config.micro_batches, schedule=config.pipeline_schedule)
    name, reduction = config.strategy, config.reduction
    cls = strategy_class(name)
    if name == "ps" and reduction == "average":  # ps_servers: the parameter server's ranks 0..ps_servers-1
        return cls(model, optimizer, world, config.accumulation, config.fp16_allreduce, servers=config.ps_servers)
    if reduction == "average":
        return cls(model, optimizer, world, config.accumulation, config.fp16_allreduce)
    if name not in ADASUM_STRATEGIES:
        raise ValueError(f"reduction={reduction} works only with strategy {' or '.join(ADASUM_STRATEGIES)}, "
                         f"not {name}")
    return cls(model, optimizer, world, config.accumulation, config.fp16_allreduce, reduction=reduction)


def launch_refusal(config: TrainConfig, world: World, elastic: bool) -> Optional[str]:
    """Why the configured strategy cannot run in this launch, or None; decided alike on every rank,
    before any collective, instead of failing or hanging in the first step."""
    if elastic and config.model_parallel:
        return ("train.tensor_parallel / pipeline_parallel do not support Horovod elastic (a lost worker takes a "
                "part of a model replica with it, and the mesh is fixed at start): launch without --min-np/--max-np")
    if elastic and config.strategy not in ELASTIC_STRATEGIES:
        return (f"train.strategy={config.strategy} does not support Horovod elastic (its state is cut into one "
                f"shard per worker, and elastic changes the worker count mid-run): use "
                f"{' or '.join(ELASTIC_STRATEGIES)} under elastic, or launch without --min-np/--max-np")
    if config.reduction == "adasum":
        from hvdtrain.distributed import startup as dist
        from hvdtrain.strategies.reduction import adasum_refusal

        return adasum_refusal(world.size, world.local_size, world.cross_size, dist.mpi_enabled(),
                              world.device.type == "cuda" and dist.nccl_built(), dist.homogeneous())
    return None
