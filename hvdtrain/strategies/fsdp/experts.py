"""fsdp with expert parallelism (train.strategy=fsdp, train.expert_parallel=E): every fused experts
module split over expert groups of E consecutive ranks (hvdtrain.parallel.experts), everything else
sharded by fsdp over every rank as without experts.

All but fsdp's own part is hvdtrain.strategies.sharded_experts (shared with zero1/zero2 x E): the
shares stay out of fsdp's units' flat buffers, whole on their rank (1/E of the experts), which no
gather or free touches, while the rest is 1/N per rank as fsdp keeps it. One optimizer steps the
units' shards, then the shares; the experts' gradients are reduced once per step in synchronize();
a full checkpoint holds fsdp's gathered state with the experts gathered whole over the expert group,
a sharded one each rank's slices of the units' buffers and the first expert group's experts
(hvdtrain.strategies.expert_shards).
"""
from __future__ import annotations

from typing import Any, Dict

import torch

from hvdtrain.distributed.world import World
from hvdtrain.strategies.fsdp.strategy import FSDPStrategy
from hvdtrain.strategies.sharded_experts import ExpertsBesideShards


class ExpertParallelFSDPStrategy(ExpertsBesideShards, FSDPStrategy):
    """fsdp whose fused experts are dealt out over expert groups of ``experts`` ranks, outside its units.

    Args:
        model: the whole model; its experts modules are split here, the rest sharded by fsdp.
        optimizer: the user's optimizer over it.
        world: this rank's World (every rank is a data-parallel rank).
        accumulation: micro-batches per optimizer step.
        fp16_allreduce: compress the units' gradients to fp16 for their exchange.
        experts: E, ranks per expert group.
        overlap: what runs ahead of the compute, as fsdp's (train.fsdp_overlap).
        topology: the run's Topology, which holds the expert groups' process sets (None: one of the strategy's
            own, closed by close_groups).
    """

    name = "expert_parallel_fsdp"
    _collective_prefix = "ep.fsdp"

    @classmethod
    def from_config(cls, config: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: World,
                    **context: Any) -> "ExpertParallelFSDPStrategy":
        """Built from the settings: train.expert_parallel besides fsdp's.

        Args:
            config: the run's settings (TrainConfig).
            model: the model.
            optimizer: its optimizer.
            world: this rank's World.
            context: what set-up knows besides: the topology, whose expert groups these are (the model comes
                whole, no mesh, no plan).
        """
        return cls(model, optimizer, world, config.accumulation, config.fp16_allreduce, experts=config.expert_parallel,
                   overlap=config.fsdp_overlap, topology=context.get("topology"))

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: World,
                 accumulation: int, fp16_allreduce: bool, experts: int = 2, overlap: str = "auto",
                 topology: Any = None) -> None:
        self.check_optimizer(optimizer)  # local, before any collective: the same verdict on every rank
        self._split_experts(model, optimizer, world, experts, topology)
        super().__init__(model, optimizer, world, accumulation, fp16_allreduce, overlap=overlap)
        # Every rank holds rank 0's values already (broadcast while whole): nothing left to spread.
        self._initial_params, self._initial_pending, self._carried_state = [], False, None

    @property
    def _sharding(self) -> str:
        return "fsdp"

    def _whole_model_state(self) -> Dict[str, torch.Tensor]:
        return self._gathered_model_state()

    def _close_micro_batch(self) -> None:
        super()._close_micro_batch()
        self._experts_owed = True  # as fsdp's reduce-scatters: once per micro-batch on every rank

    def synchronize(self) -> None:
        if self._open:  # a backward whose end the engine did not report: its experts are owed too
            self._close_micro_batch()
        super().synchronize()
