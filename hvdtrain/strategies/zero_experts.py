"""zero1 and zero2 with expert parallelism (train.strategy=zero1 or zero2, train.expert_parallel=E):
every fused experts module split over expert groups of E consecutive ranks (hvdtrain.parallel.experts),
everything else sharded by ZeRO over every rank as without experts.

All but ZeRO's own part is hvdtrain.strategies.sharded_experts (shared with fsdp x E): the shares stay
out of ZeRO's flat buckets (a bucket's slices would cut them across ranks that hold other experts),
whole on their rank (1/E of the experts) with their gradient and optimizer state, while the optimizer
state (and, under zero2, the gradients) of the rest is 1/N per rank as ZeRO keeps it. One optimizer
steps the bucket slices, then the shares; the experts' gradients accumulate in their .grad over a
step's micro-batches and are reduced once per step in synchronize(), while ZeRO's reduce-scatters
finish; a full checkpoint holds ZeRO's gathered state with the experts gathered whole over the expert
group, a sharded one each rank's slices of the buckets and the first expert group's experts, in fsdp x
E's layout (hvdtrain.strategies.expert_shards).
"""
from __future__ import annotations

from typing import Any, Dict, Tuple

import torch

from hvdtrain.distributed.world import World
from hvdtrain.strategies.sharded_experts import ExpertsBesideShards
from hvdtrain.strategies.zero import ZeroStrategy

# train.strategy -> ZeRO's stage.
STAGES = {"zero1": 1, "zero2": 2}


class ExpertParallelZeroStrategy(ExpertsBesideShards, ZeroStrategy):
    """zero1 or zero2 whose fused experts are dealt out over expert groups of ``experts`` ranks, outside
    its flat buckets.

    Args:
        model: the whole model; its experts modules are split here, the rest bucketed by ZeRO.
        optimizer: the user's optimizer over it.
        world: this rank's World (every rank is a data-parallel rank).
        accumulation: micro-batches per optimizer step.
        fp16_allreduce: compress the buckets' gradients to fp16 for their exchange.
        experts: E, ranks per expert group.
        stage: ZeRO's stage, 1 (sharded optimizer state) or 2 (and sharded gradients).
        bucket_bytes: the largest flat bucket, in bytes.
        topology: the run's Topology, asked for the expert groups (None: a topology of the groups' own).
    """

    name = "expert_parallel_zero"
    _collective_prefix = "ep.zero"

    @classmethod
    def from_config(cls, config: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: World,
                    **context: Any) -> "ExpertParallelZeroStrategy":
        """Built from the settings: train.expert_parallel and the stage train.strategy names.

        Args:
            config: the run's settings (TrainConfig).
            model: the model.
            optimizer: its optimizer.
            world: this rank's World.
            context: what set-up knows besides: the topology, whose expert groups these are (no mesh, no plan).
        """
        if config.strategy not in STAGES:
            raise ValueError(f"{cls.name} runs under train.strategy=zero1 or zero2, got {config.strategy}")
        return cls(model, optimizer, world, config.accumulation, config.fp16_allreduce, experts=config.expert_parallel,
                   stage=STAGES[config.strategy], topology=context.get("topology"))

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: World,
                 accumulation: int, fp16_allreduce: bool, experts: int = 2, stage: int = 1,
                 bucket_bytes: int = 25 * 2**20, topology: Any = None) -> None:
        # Local, before any collective: the same verdict on every rank.
        if stage not in (1, 2):
            raise ValueError(f"ZeRO stage {stage!r} under expert parallelism: 1 (zero1) or 2 (zero2)")
        if accumulation < 1 or bucket_bytes < 1:
            raise ValueError(f"accumulation ({accumulation}) and bucket_bytes ({bucket_bytes}) must be >= 1")
        self.check_optimizer(optimizer)
        self.stage = stage
        self._split_experts(model, optimizer, world, experts, topology)
        super().__init__(model, optimizer, world, accumulation, fp16_allreduce, bucket_bytes=bucket_bytes)
        # Every rank holds rank 0's values already (broadcast while whole): nothing left to spread.
        self._carried_state = None

    @property
    def _sharding(self) -> str:
        return f"zero{self.stage}"

    def _whole_model_state(self) -> Dict[str, torch.Tensor]:
        return self.model.state_dict()  # the buckets are whole on every rank

    def _shard_place(self, world: World) -> Tuple[int, int]:
        """(this rank's slice, slices per bucket): every rank's of the world."""
        return world.rank, world.size

    def _begin_micro_batch(self) -> None:
        super()._begin_micro_batch()
        self._experts_owed = True  # every rank runs the same backwards: it reduces alike
