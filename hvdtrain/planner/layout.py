"""What the planner chooses among: the setup it plans for (model, batch, memory, workers, network),
the layouts that run on it (a strategy over D data groups of a model split T x P), and the estimate
of one layout (every figure MODELLED). Expert parallelism (E) splits a mixture-of-experts model's
routed experts over E of the data-parallel ranks: unlike S, it adds no rank."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional

from hvdtrain.common.capabilities import STRATEGY_NAMES
from hvdtrain.common.layout_rules import EXPERT, PIPELINE, SEQUENCE, TENSOR, combines, strategies_with
from hvdtrain.common.units import MiB
from hvdtrain.planner.model_shape import ModelShape
from hvdtrain.planner.network import CALIBRATION, NETWORKS, Calibration, Network

STRATEGIES = STRATEGY_NAMES
PRECISIONS = {"fp32": 4, "bf16": 2}          # bytes of a parameter, a gradient and an activation
OPTIMIZERS = {"adam": 2, "sgd": 1}           # fp32 state tensors per parameter (sgd: with momentum)
# The strategies that hold the rest of the model under expert parallelism, and those a sequence group's
# ranks reduce under (hvdtrain.common.layout_rules; TrainConfig refuses the others).
EXPERT_STRATEGIES = strategies_with(EXPERT)
SEQUENCE_STRATEGIES = strategies_with(SEQUENCE)
# Assumed, not measured: what one device achieves on a transformer's matrix products (set --flops).
DEFAULT_FLOPS = 50e12
# Assumed, not measured: bytes per second a device's optimizer update streams (set --update-bandwidth;
# ``hvdtrain bench plan`` measures it on its host).
DEFAULT_UPDATE_BANDWIDTH = 1e12


@dataclass(frozen=True)
class Setup:
    shape: ModelShape
    batch: int                      # global batch, samples per step
    memory: float                   # bytes per worker
    workers: int
    network: str = "25gbe"
    optimizer: str = "adam"
    precision: str = "fp32"
    flops: float = DEFAULT_FLOPS
    micro_batches: Optional[int] = None
    gpus_per_node: int = 1
    intra: str = "pcie3"
    ps_servers: int = 1
    fusion_bytes: float = 128 * MiB
    # Measured in place of the presets (``hvdtrain bench plan`` calibrates both on one host): ``link``
    # carries every group (one node: bandwidth and per-step latency as measured); ``calibration`` the
    # overlap and jitter (CPU: communication hides nothing behind backward, overlap 0).
    link: Optional[Network] = None
    calibration: Calibration = CALIBRATION
    update_bandwidth: float = DEFAULT_UPDATE_BANDWIDTH
    # train.fsdp_overlap as resolved on the ranks: full on GPUs (what plans are for), gathers on CPUs.
    fsdp_overlap: str = "full"

    def __post_init__(self) -> None:
        if (self.batch < 1 or self.workers < 1 or self.memory <= 0 or self.flops <= 0 or self.gpus_per_node < 1
                or self.update_bandwidth <= 0):
            raise ValueError("batch, workers, gpus per node, memory, flops and update bandwidth must be > 0")
        if self.network not in NETWORKS or self.intra not in NETWORKS:
            raise ValueError(f"unknown network: choose from {', '.join(NETWORKS)}")
        if self.optimizer not in OPTIMIZERS or self.precision not in PRECISIONS:
            raise ValueError(f"optimizer: {', '.join(OPTIMIZERS)}; precision: {', '.join(PRECISIONS)}")
        if self.fsdp_overlap not in FSDP_UNITS_HELD:
            raise ValueError(f"fsdp overlap: {', '.join(FSDP_UNITS_HELD)}, got {self.fsdp_overlap!r}")
        if not 1 <= self.ps_servers <= self.workers:
            raise ValueError(f"ps servers must be between 1 and the {self.workers} workers")


# Units' full size an fsdp rank holds at most besides its shards, by train.fsdp_overlap (strategies/fsdp/strategy.py):
# full: in backward the unit computing, its gradient, the one prefetched and the one being reduce-scattered;
# gathers: all but the last; forward and none: the unit computing and its gradient.
FSDP_UNITS_HELD = {"full": 4, "gathers": 3, "forward": 2, "none": 2}


@dataclass(frozen=True)
class Layout:
    strategy: str
    tensor: int
    pipeline: int
    data: int                       # data-parallel groups: each its own batch
    micro_batches: int = 1
    sequence: int = 1               # ranks per data group sharing its batch, each 1/S of every sequence
    experts: int = 1                # data-parallel ranks sharing every MoE layer's routed experts, 1/E each
    shard: int = 0                  # hsdp: K, ranks per shard group (one node's); the others 0

    def __post_init__(self) -> None:
        if (self.strategy == "hsdp") != (self.shard > 1) or (self.shard > 1 and self.sharing % self.shard):
            raise ValueError(f"{self.name}: hsdp, and only hsdp, has shard groups: K > 1 ranks dividing the "
                             f"{self.sharing} data ranks")

    @property
    def name(self) -> str:
        micro = f" M={self.micro_batches}" if self.pipeline > 1 else ""
        sequence = f" S={self.sequence}" if self.sequence > 1 else ""
        experts = f" E={self.experts}" if self.experts > 1 else ""
        shard = f" K={self.shard}" if self.shard else ""
        return f"{self.strategy} T={self.tensor} P={self.pipeline} D={self.data}{sequence}{experts}{shard}{micro}"

    @property
    def ranks(self) -> int:
        return self.data * self.sequence * self.tensor * self.pipeline

    @property
    def sharing(self) -> int:
        """Ranks over which the strategy reduces and shards (a sequence group's ranks are data-parallel ranks)."""
        return self.data * self.sequence


def _divisors(n: int) -> List[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def default_micro_batches(replica_batch: int, pipeline: int) -> int:
    """The most micro-batches, up to 4P, that divide a replica's batch (1 without a pipeline)."""
    if pipeline == 1:
        return 1
    return max(m for m in range(1, min(4 * pipeline, replica_batch) + 1) if replica_batch % m == 0)


def layouts(setup: Setup, workers: Optional[int] = None) -> List[Layout]:
    """Every layout hvdtrain runs on ``workers``: T divides the heads, P at most the layers + 2, the
    data replicas share the global batch evenly, and the micro-batches divide a replica's batch; and
    sequence parallelism, S dividing the sequence and the heads (each tensor rank's, inside T), under
    each strategy that serves it;
    and for a mixture of experts, expert parallelism, E dividing the experts and the data ranks."""
    n, shape = setup.workers if workers is None else workers, setup.shape
    kv_heads = shape.kv_heads or shape.heads
    found = []
    # The tensor plan splits query and key/value heads alike: T divides both.
    for tensor in (t for t in _divisors(n) if shape.heads % t == 0 and kv_heads % t == 0):
        for pipeline in (p for p in _divisors(n // tensor) if p <= shape.layers + 2):
            data = n // (tensor * pipeline)
            if setup.batch % data:
                continue
            replica = setup.batch // data
            micro = setup.micro_batches or default_micro_batches(replica, pipeline)
            if pipeline > 1 and replica % micro:
                continue
            if tensor * pipeline == 1:
                strategies = [s for s in STRATEGIES if s != "hsdp"] if n > 1 else ["ddp"]
            else:  # over a mesh, what its data groups combine with (ddp's replicas alone without several)
                mesh = [d for d, size in ((TENSOR, tensor), (PIPELINE, pipeline)) if size > 1]
                strategies = [s for s in strategies_with(*mesh) if s != "hsdp"] if data > 1 else ["ddp"]
            found += [Layout(s, tensor, pipeline, data, micro if pipeline > 1 else 1) for s in strategies]
            # hsdp: fsdp within each node, ddp across; between fsdp over every rank (K = n) and ddp (K = 1).
            if tensor * pipeline == 1 and 1 < setup.gpus_per_node < n and n % setup.gpus_per_node == 0:
                found.append(Layout("hsdp", 1, 1, data, shard=setup.gpus_per_node))
    # Sequence parallelism, alone or inside tensor groups (no pipeline split): S divides the sequence
    # and each tensor rank's heads. Over a mesh the data group (D x S ranks) is ddp's or ZeRO-1's.
    tensors = [t for t in _divisors(n) if shape.heads % t == 0 and kv_heads % t == 0]
    for tensor in (t for t in tensors if t == 1 or combines(SEQUENCE, TENSOR)):
        own_kv = kv_heads // tensor  # split over S, or replicated onto it (hvdtrain.parallel.sequence.attention)
        for sequence in (s for s in _divisors(n // tensor)
                         if s > 1 and (shape.heads // tensor) % s == 0 and shape.seq_len % s == 0
                         and (own_kv % s == 0 or s % own_kv == 0)):
            data = n // (tensor * sequence)
            if setup.batch % data == 0:
                strategies = strategies_with(SEQUENCE, *([TENSOR] if tensor > 1 else []))
                found += [Layout(s, tensor, 1, data, sequence=sequence) for s in strategies]
    # Expert parallelism (no tensor, pipeline or sequence split with it: layout_rules): E of the n data ranks.
    if shape.experts and setup.batch % n == 0:
        for experts in (e for e in _divisors(n) if e > 1 and shape.experts % e == 0):
            found += [Layout(s, 1, 1, n, experts=experts) for s in EXPERT_STRATEGIES]
    return found


@dataclass(frozen=True)
class Estimate:
    """One layout, every figure modelled. Memory is the busiest rank's."""

    layout: Layout
    parameters: float
    gradients: float
    optimizer_state: float
    activations: float
    gathered: float
    total: float
    compute_s: float = 0.0
    bubble_s: float = 0.0
    update_s: float = 0.0
    comm_s: float = 0.0
    step_s: float = 0.0
    samples_per_s: float = 0.0

    @property
    def states(self) -> float:
        """Parameters + gradients + optimizer state: what the strategies count."""
        return self.parameters + self.gradients + self.optimizer_state
