"""What each strategy can and cannot do, declared in one table that imports nothing.

The settings' checks (``hvdtrain.config.strategy_checks``, run when a TrainConfig is created, on a
login node too), a launch's checks and the loop read a strategy's capabilities here; each strategy
class holds its record (``Strategy.capabilities``) and never declares them a second way. The mesh's
refusals (MESH) are hvdtrain.common.layout_rules' (which dimensions and strategies combine). Imports
nothing else, so that ``TrainConfig()`` imports neither torch nor Horovod.
"""
from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Dict, Mapping

from hvdtrain.common import layout_rules

# The capabilities a strategy may refuse.
ELASTIC = "elastic"  # Horovod elastic: the world may change mid-run
COMPILE = "compile"  # torch.compile of the model
ADASUM = "adasum"  # reduction=adasum
SHARDED_CHECKPOINTS = "sharded_checkpoints"  # checkpoint_format=sharded
MESH = "mesh"  # the data-parallel side of a tensor x pipeline mesh

# The model-parallel layout (train.tensor_parallel x pipeline_parallel > 1): registered beside the
# strategies a user names, chosen by the mesh rather than by train.strategy.
MODEL_PARALLEL = "model_parallel"
# Expert parallelism (train.expert_parallel > 1): ddp with each fused experts module split over
# expert groups, chosen by that setting over train.strategy=ddp.
EXPERT_PARALLEL = "expert_parallel"
# The same over train.strategy=fsdp (hvdtrain.strategies.fsdp.experts): the experts split alike, the
# rest sharded by fsdp.
EXPERT_PARALLEL_FSDP = "expert_parallel_fsdp"
# The same over train.strategy=zero1 or zero2 (hvdtrain.strategies.zero_experts): the experts split
# alike and left out of ZeRO's flat buckets, the rest sharded by ZeRO at the stage train.strategy names.
EXPERT_PARALLEL_ZERO = "expert_parallel_zero"

# What a strategy keeps of the state, which decides how a sharded checkpoint written at its own
# layout comes back: every rank the full state, each rank its own shard of flat buckets (its own
# file, read alone), or each rank what it holds of a mesh (read from every rank's file, as at any
# other layout). Any other source (a full checkpoint, another layout, pretrained weights) every
# strategy reads through Strategy.load_from.
FULL_STATE, OWN_SHARD, EVERY_PART = "full_state", "own_shard", "every_part"


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """One strategy's capabilities.

    Args:
        refuses: capability -> why this strategy cannot do it (the refusal's message quotes it).
        collective_forward: every forward is a collective (fsdp gathers each block; tensor-parallel
            layers all-reduce), so every rank runs the same number of forwards, evaluation included.
        elastic_from_checkpoint: under Horovod elastic, a world change continues from the newest
            checkpoint, not from the state committed in memory (a lost worker took its shard along).
        initializes_by_shard: a model built on the meta device gets its values shard by shard
            (never whole); the other strategies take it made whole first.
        shards_gradients: each rank holds only its slices of the gradients after synchronize, so a
            gradient norm or an inf/nan check is a collective.
        loads: how it takes a checkpoint's state back: FULL_STATE, OWN_SHARD or EVERY_PART.
    """
    refuses: Mapping[str, str] = dataclasses.field(default_factory=dict)
    collective_forward: bool = False
    elastic_from_checkpoint: bool = False
    initializes_by_shard: bool = False
    shards_gradients: bool = False
    loads: str = FULL_STATE

    def __post_init__(self) -> None:
        if self.loads not in (FULL_STATE, OWN_SHARD, EVERY_PART):
            raise ValueError(f"loads={self.loads!r}: one of {FULL_STATE}, {OWN_SHARD}, {EVERY_PART}")
        unknown = set(self.refuses) - {ELASTIC, COMPILE, ADASUM, SHARDED_CHECKPOINTS, MESH}
        if unknown:
            raise ValueError(f"unknown capabilities {sorted(unknown)}")
        object.__setattr__(self, "refuses", MappingProxyType(dict(self.refuses)))

    def supports(self, capability: str) -> bool:
        return capability not in self.refuses


_SHARDED_ADASUM = ("zero1, zero2 and fsdp reduce-scatter the gradients so that each rank receives only its slice, "
                   "and Adasum has no reduce-scatter form (it combines whole gradients pairwise, scaled by dot "
                   "products over each whole tensor)")


def _mesh(strategy: str) -> Dict[str, str]:
    """The MESH refusal of ``strategy``, as hvdtrain.common.layout_rules decides it (nothing when it combines)."""
    if layout_rules.combines(layout_rules.TENSOR, strategy):
        return {}
    return {MESH: layout_rules.reason(layout_rules.TENSOR, strategy)}


_ZERO = dict(refuses={ADASUM: _SHARDED_ADASUM, **_mesh("zero1")}, elastic_from_checkpoint=True, shards_gradients=True,
             loads=OWN_SHARD)

# Registered name -> capabilities, in the order the strategies are listed to a user.
DECLARED: Dict[str, Capabilities] = {
    "ddp": Capabilities(refuses={**_mesh("ddp"),
        SHARDED_CHECKPOINTS: "under ddp every rank holds the whole model and optimizer state, so there is "
                             "nothing to shard and rank 0 writes it alone"}),
    "zero1": Capabilities(**_ZERO),
    "zero2": Capabilities(**{**_ZERO, "refuses": {ADASUM: _SHARDED_ADASUM, **_mesh("zero2")}}),
    "fsdp": Capabilities(
        refuses={
            ADASUM: _SHARDED_ADASUM, **_mesh("fsdp"),
            COMPILE: "fsdp gathers each unit's parameters in hooks that run inside the forward, and torch.compile "
                     "cannot compile them: Dynamo cannot trace Horovod's collectives (a graph break at every unit), "
                     "and Inductor fails on the gathered buffer's storage resize (LoweringException: TODO: dynamic "
                     "shapes, torch 2.13)"},
        collective_forward=True, elastic_from_checkpoint=True, initializes_by_shard=True, shards_gradients=True,
        loads=OWN_SHARD),
    # fsdp within each shard group (a host's ranks), ddp across them (hvdtrain.strategies.fsdp.hybrid).
    "hsdp": Capabilities(
        refuses={
            ADASUM: _SHARDED_ADASUM, **_mesh("hsdp"),
            COMPILE: "hsdp gathers each unit's parameters in hooks inside the forward, as fsdp does, which "
                     "torch.compile cannot compile",
            ELASTIC: "its shard and replica groups are Horovod process sets fixed at start, and a lost worker takes "
                     "its host's shard along"},
        # Its sharded checkpoint has a mesh's layout: the first shard group's ranges of the units' buffers,
        # each element once, read from every rank's file (hvdtrain.strategies.fsdp.hybrid).
        collective_forward=True, initializes_by_shard=True, shards_gradients=True, loads=EVERY_PART),
    "ps": Capabilities(shards_gradients=True, refuses={
        ELASTIC: "the servers (ranks 0..ps_servers-1) hold the only copy of the optimizer state, and a lost server "
                 "takes its part along; continuing from the newest checkpoint, as zero1, zero2 and fsdp do, is not "
                 "built for ps",
        **_mesh("ps"),
        SHARDED_CHECKPOINTS: "the optimizer state lives on the servers only, which the per-rank sharded format "
                             "(every rank owns 1/N) does not describe",
        COMPILE: "ps is kept as a measured baseline, and torch.compile is not tested with it",
        ADASUM: "each server averages the gradients it receives, and Adasum (whole tensors combined pairwise by "
                "dot products) has no form on a slice"}),
    MODEL_PARALLEL: Capabilities(
        refuses={
            ELASTIC: "a lost worker takes a part of a model replica with it, and the mesh is fixed at start",
            ADASUM: "Adasum combines over the whole world, not over a data-parallel group",
            COMPILE: "Horovod's collectives inside the forward do not compile (a graph break at every "
                     "tensor-parallel layer)"},
        collective_forward=True, initializes_by_shard=True, shards_gradients=True, loads=EVERY_PART),
    EXPERT_PARALLEL: Capabilities(
        refuses={
            ELASTIC: "the expert groups are fixed at start, and a lost worker takes its experts with it",
            ADASUM: "Adasum combines over the whole world, and the experts' gradients are averaged over their "
                    "replica groups",
            COMPILE: "the experts' all-to-all inside the forward does not compile (Dynamo cannot trace Horovod's "
                     "collectives)",
            MESH: layout_rules.reason(layout_rules.EXPERT, layout_rules.TENSOR)},
        collective_forward=True, shards_gradients=True, loads=EVERY_PART),
}
# What the ddp variant refuses; its sharded checkpoint is a mesh's too (each rank's ranges of the units'
# buffers, the experts once), read from every rank's file though its class is fsdp's.
DECLARED[EXPERT_PARALLEL_FSDP] = Capabilities(
    refuses=DECLARED[EXPERT_PARALLEL].refuses, collective_forward=True, shards_gradients=True, loads=EVERY_PART)
# zero1/zero2 x E: the same, its sharded checkpoint in that layout too (each rank's ranges of ZeRO's buckets,
# the experts once).
DECLARED[EXPERT_PARALLEL_ZERO] = Capabilities(
    refuses=DECLARED[EXPERT_PARALLEL].refuses, collective_forward=True, shards_gradients=True, loads=EVERY_PART)
# The values of train.strategy (the model-parallel and expert-parallel layouts are chosen by their settings).
STRATEGY_NAMES = tuple(name for name in DECLARED
                       if name not in (MODEL_PARALLEL, EXPERT_PARALLEL, EXPERT_PARALLEL_FSDP, EXPERT_PARALLEL_ZERO))


def supporting(capability: str) -> list:
    """The strategies a user can name that support ``capability``, in the table's order."""
    return [name for name in STRATEGY_NAMES if DECLARED[name].supports(capability)]
