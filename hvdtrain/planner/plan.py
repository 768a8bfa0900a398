"""``hvdtrain plan``: which strategy and mesh for this model on this cluster. MODELLED, NOT MEASURED.

A layout is a strategy (ddp, zero1, zero2, fsdp, ps) over all workers, or ddp or zero1 over D data
groups of a model split T-way by tensor (Megatron) and P-way by pipeline (world = D x P x T, as
hvdtrain.parallel.mesh lays it out). For every layout that runs at this worker count:

Memory per rank, the largest over the ranks:
  * parameters, gradients, optimizer state: the ZeRO arithmetic (``sharded_state_bytes``) over the D
    data ranks, of the elements one rank holds: the whole model, or the largest pipeline stage's
    (hvdtrain's own ``split_layers``, balanced by parameter count) with each block's split matrices
    divided by T and the rest (LayerNorms, embeddings, row-parallel biases) whole, the tied token
    matrix on both ends of a pipeline. This part is what the strategies count from the tensors'
    storages, and tests/mpi/test_plan_memory.py checks it against them.
  * activations (an estimate, not counted anywhere): per block and sample, seq x d_model x
    (10 + 24/T + 5 heads seq / (d_model T)) bytes at 16 bits (Korthikanti et al. 2022, eq. 2 and 3,
    no recomputation, no sequence parallelism), scaled by the precision's width, for the micro-batches a
    stage holds under 1F1B (min(M, P - stage)), plus the logits and their gradient on the last stage.
  * fsdp: the largest unit (a block, or the root: embeddings and final norm) gathered while it computes.

Time per step: compute 6 x (elements a rank holds) x (tokens of its data replica) / device FLOP/s
(attention's seq^2 term left out), stretched by the pipeline bubble (M + P - 1) / M; the optimizer's
update, elementwise and bound by memory: the elements this rank updates (its share of the model;
/ D under zero1, zero2 and fsdp, which shard the update; a server's slice / K under ps) x the bytes
the update reads and writes per element (parameter, gradient and state: 28 for Adam, 20 for SGD
with momentum) / the device's update bandwidth; plus the
straggler and the communication of ``bench project`` (its presets, ring terms, latency and
calibration): ring all-reduce 2(D-1)/D of the gradients for ddp, reduce-scatter + all-gather (the
same bytes, the all-gather after the step) for zero1/zero2 (zero1 over a mesh: ddp's all-reduce,
then the parameters from their owners, an all-gather's bytes after the step), 1.5x that for fsdp (parameters gathered
again for backward), 2 N x slice through the busiest server for ps; per micro-batch 4 all-reduces
per block of micro-batch x seq x d_model in the tensor group and two point-to-point sends between
neighbouring stages. Gradient communication is hidden behind backward as ``bench project``
calibrated it; the rest is exposed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Dict, List, Optional, Sequence, Tuple

from hvdtrain.common.units import MiB
from hvdtrain.planner.network import (CALIBRATION, LABEL, NETWORKS, Calibration, Network, bytes_per_s,
                                      expected_max_normal, ring_bandwidth_s, ring_latency_s)

STRATEGIES = ("ddp", "zero1", "zero2", "fsdp", "ps")
PRECISIONS = {"fp32": 4, "bf16": 2}          # bytes of a parameter, a gradient and an activation
OPTIMIZERS = {"adam": 2, "sgd": 1}           # fp32 state tensors per parameter (sgd: with momentum)
# Assumed, not measured: what one device achieves on a transformer's matrix products (set --flops).
DEFAULT_FLOPS = 50e12
# Assumed, not measured: bytes per second a device's optimizer update streams (set --update-bandwidth;
# ``hvdtrain bench plan`` measures it on its host).
DEFAULT_UPDATE_BANDWIDTH = 1e12
# Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"):
# activation bytes per block = seq x batch x d_model x (10 + 24/T + 5 heads seq / (d_model T)), 16-bit.
ACTIVATION_FIXED, ACTIVATION_SPLIT, ACTIVATION_ATTENTION = 10, 24, 5


# ---- the ZeRO arithmetic -------------------------------------------------------------------------

def sharded_state_bytes(strategy: str, parameters: float, param_bytes: float, grad_bytes: float,
                        state_bytes: float, data_ranks: int, ps_servers: int = 1) -> Dict[str, float]:
    """What the busiest rank holds in parameters, gradients and optimizer state (Rajbhandari et al.
    2020): ``state_bytes`` per parameter of optimizer state (Adam in fp32: 8; mixed precision: 12,
    the fp32 master copy included). A parameter server also receives the summed gradients of its
    slice, and holds the optimizer state of its slice (1/``ps_servers`` of the parameters)."""
    p, g, k = parameters * param_bytes, parameters * grad_bytes, parameters * state_bytes
    n, servers = data_ranks, ps_servers
    shares = {"ddp": (p, g, k), "zero1": (p, g, k / n), "zero2": (p, g / n, k / n),
              "fsdp": (p / n, g / n, k / n), "ps": (p, g + g / servers, k / servers)}[strategy]
    return dict(zip(("parameters", "gradients", "optimizer_state"), shares))


def state_bytes_per_parameter(optimizer: str, precision: str) -> int:
    """fp32 optimizer state, plus an fp32 master copy when the parameters are 16-bit."""
    return 4 * OPTIMIZERS[optimizer] + (4 if PRECISIONS[precision] < 4 else 0)


# ---- the model -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class LayerCost:
    """One pipeline layer: elements split over the tensor group, and elements every tensor rank keeps
    whole (``tied`` of them the token matrix, shared by the first and the last layer)."""

    split: float
    replicated: float
    tied: float = 0.0
    block: bool = False

    def parameters(self) -> List["_Count"]:
        """What ``hvdtrain.parallel.pipeline.schedule.split_layers`` weighs a layer by."""
        return [_Count(self.split + self.replicated)]


@dataclass(frozen=True)
class _Count:
    elements: float

    def numel(self) -> float:
        return self.elements


@dataclass(frozen=True)
class ModelShape:
    """A GPT-style decoder as hvdtrain.examples.textlm builds it: token and position embeddings,
    pre-norm blocks (qkv, proj, 4x MLP, biases, two LayerNorms), a final LayerNorm, the output layer
    tied to the token embedding. ``params``, when given, replaces the count this shape gives; the
    blocks take up the difference."""

    layers: int
    d_model: int
    seq_len: int
    vocab: int
    heads: int
    params: Optional[float] = None

    def __post_init__(self) -> None:
        for name in ("layers", "d_model", "seq_len", "vocab", "heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"model {name} must be a whole number >= 1, got {value!r}")
        if self.d_model % self.heads:
            raise ValueError(f"d_model {self.d_model} must be a multiple of heads {self.heads}")
        if self.params is not None and self.params <= self._outside_blocks():
            raise ValueError(f"--params {self.params:.4g} leaves nothing for the blocks: the embeddings and "
                             f"final norm of this shape already hold {self._outside_blocks():.4g}")

    def _outside_blocks(self) -> int:
        return (self.vocab + self.seq_len) * self.d_model + 2 * self.d_model

    @property
    def shape_params(self) -> int:
        """V d + S d + L (12 d^2 + 13 d) + 2 d: the exact count of TinyTransformerLM (head tied)."""
        d = self.d_model
        return self._outside_blocks() + self.layers * (12 * d * d + 13 * d)

    @property
    def total(self) -> float:
        return self.shape_params if self.params is None else self.params

    def pipeline_layers(self) -> Tuple[LayerCost, ...]:
        """[embedding, each block, head], as textlm_parallel.pipeline_layers cuts the model. A block's
        qkv (weight and bias), proj weight, MLP weights and first bias split; its norms and the
        row-parallel biases (proj, second MLP linear) stay whole."""
        d, v = self.d_model, self.vocab
        split, replicated = 12 * d * d + 7 * d, 6 * d
        scale = (self.total - self._outside_blocks()) / (self.layers * (split + replicated))
        block = LayerCost(split * scale, replicated * scale, block=True)
        return (LayerCost(0, (v + self.seq_len) * d, tied=v * d), *([block] * self.layers),
                LayerCost(0, 2 * d + v * d, tied=v * d))


def textlm_shape(vocab: Optional[int] = None) -> ModelShape:
    """The example's TinyTransformerLM with its default config; the vocabulary from its corpus."""
    from hvdtrain.examples.textlm import TextLMModelConfig, load_corpus

    config = TextLMModelConfig()
    vocab = len(set(load_corpus())) if vocab is None else vocab
    return ModelShape(config.layers, config.d_model, config.seq_len, vocab, config.heads)


@lru_cache(maxsize=None)
def stage_layers(shape: ModelShape, pipeline: int) -> Tuple[Tuple[int, ...], ...]:
    """The layer indices of every stage: hvdtrain's own split (balanced by parameter count)."""
    from hvdtrain.parallel.pipeline.schedule import split_layers  # imports torch and Horovod

    return tuple(tuple(stage) for stage in split_layers(shape.pipeline_layers(), pipeline))


def stage_elements(shape: ModelShape, tensor: int, pipeline: int) -> List[float]:
    """The parameter elements one rank of each stage holds."""
    layers = shape.pipeline_layers()
    out = []
    for stage in stage_layers(shape, pipeline):
        held = [layers[i] for i in stage]
        both_ends = len(stage) and stage[0] == 0 and stage[-1] == len(layers) - 1
        tied_once = layers[0].tied if both_ends else 0.0  # one Parameter when a stage holds both ends
        out.append(sum(layer.split / tensor + layer.replicated for layer in held) - tied_once)
    return out


# ---- the cluster and the layouts ------------------------------------------------------------------

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

    def __post_init__(self) -> None:
        if (self.batch < 1 or self.workers < 1 or self.memory <= 0 or self.flops <= 0 or self.gpus_per_node < 1
                or self.update_bandwidth <= 0):
            raise ValueError("batch, workers, gpus per node, memory, flops and update bandwidth must be > 0")
        if self.network not in NETWORKS or self.intra not in NETWORKS:
            raise ValueError(f"unknown network: choose from {', '.join(NETWORKS)}")
        if self.optimizer not in OPTIMIZERS or self.precision not in PRECISIONS:
            raise ValueError(f"optimizer: {', '.join(OPTIMIZERS)}; precision: {', '.join(PRECISIONS)}")
        if not 1 <= self.ps_servers <= self.workers:
            raise ValueError(f"ps servers must be between 1 and the {self.workers} workers")


@dataclass(frozen=True)
class Layout:
    strategy: str
    tensor: int
    pipeline: int
    data: int
    micro_batches: int = 1

    @property
    def name(self) -> str:
        micro = f" M={self.micro_batches}" if self.pipeline > 1 else ""
        return f"{self.strategy} T={self.tensor} P={self.pipeline} D={self.data}{micro}"


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
    data replicas share the global batch evenly, and the micro-batches divide a replica's batch."""
    n, shape = setup.workers if workers is None else workers, setup.shape
    found = []
    for tensor in (t for t in _divisors(n) if shape.heads % t == 0):
        for pipeline in (p for p in _divisors(n // tensor) if p <= shape.layers + 2):
            data = n // (tensor * pipeline)
            if setup.batch % data:
                continue
            replica = setup.batch // data
            micro = setup.micro_batches or default_micro_batches(replica, pipeline)
            if pipeline > 1 and replica % micro:
                continue
            if tensor * pipeline == 1:
                strategies = STRATEGIES if n > 1 else ("ddp",)
            else:  # over a mesh: plain replicas, or ZeRO-1 over each data group when there are several
                strategies = ("ddp", "zero1") if data > 1 else ("ddp",)
            found += [Layout(s, tensor, pipeline, data, micro if pipeline > 1 else 1) for s in strategies]
    return found


# ---- the estimate ----------------------------------------------------------------------------------

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


def _activation_bytes(setup: Setup, layout: Layout, blocks: int, held: int, last: bool) -> float:
    s, d, heads = setup.shape.seq_len, setup.shape.d_model, setup.shape.heads
    width = PRECISIONS[setup.precision]
    micro = setup.batch / layout.data / layout.micro_batches
    per_block = s * micro * d * (ACTIVATION_FIXED + ACTIVATION_SPLIT / layout.tensor
                                 + ACTIVATION_ATTENTION * heads * s / (d * layout.tensor)) * width / 2
    logits = 2 * micro * s * setup.shape.vocab * width if last else 0.0  # logits and their gradient
    return blocks * held * per_block + logits


def memory(setup: Setup, layout: Layout) -> Estimate:
    """The busiest rank's modelled bytes (no time)."""
    shape, width = setup.shape, PRECISIONS[setup.precision]
    state = state_bytes_per_parameter(setup.optimizer, setup.precision)
    layers = shape.pipeline_layers()
    rows = []
    for index, (stage, elements) in enumerate(zip(stage_layers(shape, layout.pipeline),
                                                  stage_elements(shape, layout.tensor, layout.pipeline))):
        held = sharded_state_bytes(layout.strategy, elements, width, width, state, layout.data, setup.ps_servers)
        blocks = sum(layers[i].block for i in stage)
        in_flight = min(layout.micro_batches, layout.pipeline - index)
        activations = _activation_bytes(setup, layout, blocks, in_flight, index == layout.pipeline - 1)
        rows.append((held, activations))
    gathered = 0.0
    if layout.strategy == "fsdp":  # the largest unit whole while it computes: a block, or the root
        gathered = width * max(layers[1].split + layers[1].replicated, layers[0].replicated + 2 * shape.d_model)
    held, _ = max(rows, key=lambda row: sum(row[0].values()))
    total = max(sum(h.values()) + a for h, a in rows) + gathered
    return Estimate(layout, held["parameters"], held["gradients"], held["optimizer_state"],
                    max(a for _, a in rows), gathered, total)


def _group_link(setup: Setup, size: int, stride: int) -> Tuple[int, float, float, float]:
    """(nodes, bytes/s, network alpha, intra-node alpha) of a group of ``size`` ranks ``stride`` apart
    (ranks fill nodes in order, ``gpus_per_node`` each), by bench project's rules."""
    if setup.link is not None:  # one measured link, one node
        alpha = setup.link.alpha_us * 1e-6
        return 1, bytes_per_s(setup.link, setup.calibration), alpha, alpha
    network, intra = NETWORKS[setup.network], NETWORKS[setup.intra]
    if network.intra_node:
        nodes, intra = 1, network
    elif stride >= setup.gpus_per_node:
        nodes = size
    else:
        nodes = math.ceil(size / (setup.gpus_per_node // stride))
    hops = [intra] if nodes == 1 else [network] + ([intra] if setup.gpus_per_node > 1 else [])
    bandwidth = min(bytes_per_s(link, setup.calibration) for link in hops)
    return nodes, bandwidth, network.alpha_us * 1e-6, intra.alpha_us * 1e-6


def allreduce_s(setup: Setup, nbytes: float, size: int, stride: int, calls: int = 1) -> float:
    """``calls`` ring all-reduces of ``nbytes`` each over the group, fused up to the threshold."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    nodes, bandwidth, net_alpha, intra_alpha = _group_link(setup, size, stride)
    buffers = math.ceil(nbytes / setup.fusion_bytes)
    return calls * (ring_bandwidth_s(nbytes, size, bandwidth)
                    + buffers * ring_latency_s(size, nodes, net_alpha, intra_alpha))


def _gradient_comm_s(setup: Setup, layout: Layout, elements: float) -> Tuple[float, float]:
    """(hideable behind backward, exposed) seconds of the data-parallel exchange."""
    grads = elements * PRECISIONS[setup.precision]
    ring = allreduce_s(setup, grads, layout.data, layout.tensor * layout.pipeline)
    if layout.strategy == "ddp":
        return ring, 0.0
    if layout.strategy == "zero1" and layout.tensor * layout.pipeline > 1:
        return ring, ring / 2  # the gradients all-reduced whole, then each parameter from its owner
    if layout.strategy in ("zero1", "zero2"):  # reduce-scatter in backward, all-gather after the step
        return ring / 2, ring / 2
    if layout.strategy == "fsdp":  # per unit: all-gather forward, all-gather backward, reduce-scatter
        units = setup.shape.layers + 1
        per_unit = allreduce_s(setup, grads / units, layout.data, 1)
        return 1.5 * units * per_unit, 0.0
    # ps: the busiest server receives every worker's gradients of its slice and sends the weights back.
    nodes, bandwidth, net_alpha, intra_alpha = _group_link(setup, layout.data, 1)
    slice_bytes = grads / setup.ps_servers
    return 0.0, 2 * layout.data * slice_bytes / bandwidth + ring_latency_s(layout.data, nodes, net_alpha, intra_alpha)


def update_bytes_per_element(optimizer: str) -> int:
    """Bytes an elementwise update reads and writes per parameter element, fp32: the parameter (read
    and written), its gradient (read) and each state tensor (read and written)."""
    return 4 * (3 + 2 * OPTIMIZERS[optimizer])


def update_s(setup: Setup, layout: Layout, elements: float) -> float:
    """Seconds of the optimizer's update on the busiest rank, which holds ``elements`` of the model."""
    if layout.strategy in ("zero1", "zero2", "fsdp"):
        updated = elements / layout.data  # each rank updates its slice
    elif layout.strategy == "ps":
        updated = elements / setup.ps_servers  # a server updates its slice; workers none
    else:
        updated = elements
    return updated * update_bytes_per_element(setup.optimizer) / setup.update_bandwidth


def estimate(setup: Setup, layout: Layout) -> Estimate:
    """Memory and step time of one layout."""
    held = memory(setup, layout)
    shape, width = setup.shape, PRECISIONS[setup.precision]
    elements = max(stage_elements(shape, layout.tensor, layout.pipeline))
    blocks = max(sum(shape.pipeline_layers()[i].block for i in stage)
                 for stage in stage_layers(shape, layout.pipeline))
    replica_batch = setup.batch / layout.data
    ideal = 6 * elements * replica_batch * shape.seq_len / setup.flops
    m, p = layout.micro_batches, layout.pipeline
    bubble = ideal * (p - 1) / m
    compute = ideal + bubble
    activation = replica_batch / m * shape.seq_len * shape.d_model * width
    tensor_s = allreduce_s(setup, activation, layout.tensor, 1, calls=4 * blocks * m)
    pipe_s = 0.0
    if p > 1:
        nodes, bandwidth, net_alpha, intra_alpha = _group_link(setup, 2, layout.tensor)  # stage -> next stage
        pipe_s = 2 * m * (activation / bandwidth + (net_alpha if nodes > 1 else intra_alpha))
    hideable, exposed = _gradient_comm_s(setup, layout, elements)
    window = ideal if layout.strategy == "fsdp" else 2 / 3 * ideal  # fsdp prefetches in forward too
    hidden = min(setup.calibration.overlap * hideable, window)
    straggler = compute * setup.calibration.jitter * expected_max_normal(setup.workers)
    comm = tensor_s + pipe_s + hideable + exposed
    update = update_s(setup, layout, elements)
    step = compute + update + straggler + comm - hidden
    return replace(held, compute_s=ideal, bubble_s=bubble, update_s=update, comm_s=comm - hidden, step_s=step,
                   samples_per_s=setup.batch / step)


# ---- the recommendation ------------------------------------------------------------------------------

def format_count(parameters: float) -> str:
    return f"{parameters / 1e9:.4g}B" if parameters >= 1e9 else f"{parameters / 1e6:.4g}M"


class NothingFits(ValueError):
    """No layout fits the memory per worker; the message says what would."""


@dataclass
class Plan:
    setup: Setup
    fitting: List[Estimate]          # by step time, fastest first
    too_big: List[Estimate] = field(default_factory=list)

    @property
    def recommended(self) -> Estimate:
        return self.fitting[0]

    def why(self) -> str:
        best = self.recommended
        text = (f"the fastest modelled step of the {len(self.fitting)} layout(s) that fit "
                f"({best.step_s * 1e3:.3g} ms, {best.total / self.setup.memory:.0%} of the memory)")
        if len(self.fitting) > 1:
            runner = self.fitting[1]
            tie = " (a tie: the simpler layout first)" if _rank(runner)[0] == _rank(best)[0] else ""
            text += f"; next: {runner.layout.name}, {runner.step_s / best.step_s - 1:+.0%} time{tie}"
        return text


def make_plan(setup: Setup) -> Plan:
    """Every layout's estimate; NothingFits (saying what would fit) when none fits the memory."""
    options = layouts(setup)
    if not options:
        raise NothingFits(f"no layout runs {setup.workers} workers on a global batch of {setup.batch}: the data "
                          f"replicas must share it evenly (choose a batch that is a multiple of the worker count)")
    estimates = [estimate(setup, layout) for layout in options]
    fitting = sorted((e for e in estimates if e.total <= setup.memory), key=_rank)
    if not fitting:
        raise NothingFits(what_would_fit(setup, estimates))
    return Plan(setup, fitting, [e for e in estimates if e.total > setup.memory])


def _rank(e: Estimate) -> Tuple[float, int, int]:
    """Fastest first; on a tie in modelled time, the simpler layout (no model split, then ddp before
    the sharding strategies): the model cannot tell them apart, and the simpler one has less to go wrong."""
    return (round(e.step_s, 12), e.layout.tensor * e.layout.pipeline, STRATEGIES.index(e.layout.strategy))


def _smallest(setup: Setup, workers: int) -> Optional[Estimate]:
    options = [memory(setup, layout) for layout in layouts(setup, workers)]
    return min(options, key=lambda e: e.total, default=None)


def fewest_workers(setup: Setup, limit: int = 1 << 20) -> Optional[Estimate]:
    """The layout at the smallest worker count above ``setup.workers`` that fits its memory."""
    last = min(4 * setup.workers, setup.workers + 4096)  # every count up to there, then powers of two
    counts = list(range(setup.workers + 1, last + 1)) + [1 << k for k in range(64) if last < (1 << k) <= limit]
    for workers in counts:
        best = _smallest(setup, workers)
        if best is not None and best.total <= setup.memory:
            return best
    return None


def what_would_fit(setup: Setup, estimates: Sequence[Estimate]) -> str:
    from hvdtrain.common.units import format_bytes

    least = min(estimates, key=lambda e: e.total)
    text = (f"no layout fits {format_bytes(setup.memory)} per worker at {setup.workers} workers "
            f"({format_count(setup.shape.total)} parameters, {setup.optimizer}, {setup.precision}, global batch "
            f"{setup.batch}; {LABEL}). At {setup.workers} workers the least any layout needs is "
            f"{format_bytes(least.total)} per worker ({least.layout.name}): give each worker that much.")
    more = fewest_workers(setup)
    if more is None:
        return text + f" No worker count up to {1 << 20} fits {format_bytes(setup.memory)} per worker."
    workers = more.layout.data * more.layout.tensor * more.layout.pipeline
    return text + (f" At {format_bytes(setup.memory)} per worker, the fewest workers that fit are {workers} "
                   f"({more.layout.name}: {format_bytes(more.total)} per worker).")
