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
from typing import Dict, Tuple

import torch

from hvdtrain.config.train import ADASUM_STRATEGIES
from hvdtrain.config.train import STRATEGIES as CONFIGURED
from hvdtrain.distributed.startup import World
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


def build_strategy(name: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: World,
                   accumulation: int, fp16_allreduce: bool, reduction: str = "average",
                   ps_servers: int = 1) -> Strategy:
    """``reduction``: how ddp combines the gradients (average, adasum); the sharded strategies
    reduce-scatter an average, which Adasum has no form of (TrainConfig refuses it with the reason)."""
    cls = strategy_class(name)
    if name == "ps" and reduction == "average":  # ps_servers: the parameter server's ranks 0..ps_servers-1
        return cls(model, optimizer, world, accumulation, fp16_allreduce, servers=ps_servers)
    if reduction == "average":
        return cls(model, optimizer, world, accumulation, fp16_allreduce)
    if name not in ADASUM_STRATEGIES:
        raise ValueError(f"reduction={reduction} works only with strategy {' or '.join(ADASUM_STRATEGIES)}, "
                         f"not {name}")
    return cls(model, optimizer, world, accumulation, fp16_allreduce, reduction=reduction)
