"""Training strategies, chosen by ``train.strategy``: how the model's state is spread over the ranks.

    ddp    every rank holds everything; gradients all-reduced (Horovod's DistributedOptimizer)
    zero1  optimizer state sharded: gradients reduce-scattered, each rank steps its 1/N, all-gather
    zero2  as zero1, and each rank keeps only its 1/N of the gradients
    fsdp   as zero2, and each rank keeps only its 1/N of the parameters, each block's gathered while
           it computes (ZeRO-3)
    ps     a parameter server: ranks 0..K-1 hold the optimizer state, a slice each
    (over a model-parallel mesh: ddp or zero1 over each data-parallel group, model_parallel/)

registry.py maps their names to classes (what each can do: hvdtrain.common.capabilities); base.py is
the interface the loop calls;
sharding/ holds what the sharded strategies share, fsdp/ ZeRO-3's units and communication, model_parallel/
the mesh's strategy and its slice-by-slice initialization.
May import common/, config/, distributed/, parallel/ and components/. The interface (base.Strategy)
is public for those who write a strategy; the rest is internal.
"""
from hvdtrain.strategies.registry import STRATEGY_NAMES, build_strategy, launch_refusal, strategy_class

__all__ = ["STRATEGY_NAMES", "build_strategy", "launch_refusal", "strategy_class"]
