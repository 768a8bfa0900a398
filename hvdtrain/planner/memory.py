"""Memory per rank, MODELLED: the ZeRO arithmetic over the data ranks of what each stage's rank holds
(parameters, gradients, optimizer state: what the strategies count, tests/mpi/test_plan_memory.py
checks it against their counts), activations (Korthikanti et al. 2022, no recomputation), and under
fsdp the largest unit's parameters and gradients held whole while it computes, as many as the overlap keeps
(layout.FSDP_UNITS_HELD; hsdp: fsdp's over its shard group of K). Under expert parallelism a rank holds 1/E of the
routed experts, sharded by the strategy over the N/E ranks holding the same experts, and the rest of
the model as the strategy holds it over all N (tests/unit/test_plan_experts.py checks the split
against hvdtrain's own)."""
from __future__ import annotations

from typing import Dict

from hvdtrain.planner.layout import FSDP_UNITS_HELD, OPTIMIZERS, PRECISIONS, Estimate, Layout, Setup
from hvdtrain.planner.model_shape import stage_elements, stage_layers

# Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"):
# activation bytes per block = seq x batch x d_model x (10 + 24/T + 5 heads seq / (d_model T)), 16-bit.
ACTIVATION_FIXED, ACTIVATION_SPLIT, ACTIVATION_ATTENTION = 10, 24, 5


def sharded_state_bytes(strategy: str, parameters: float, param_bytes: float, grad_bytes: float,
                        state_bytes: float, data_ranks: int, ps_servers: int = 1, shard_ranks: int = 0,
                        ) -> Dict[str, float]:
    """What the busiest rank holds in parameters, gradients and optimizer state (Rajbhandari et al.
    2020). A parameter server also receives the summed gradients of its
    slice, and holds the optimizer state of its slice (1/servers of the parameters).

    Args:
        strategy: ddp, zero1, zero2, fsdp, hsdp or ps.
        parameters: the model's parameter count.
        param_bytes: bytes per parameter.
        grad_bytes: bytes per gradient element.
        state_bytes: bytes of optimizer state per parameter (Adam in fp32: 8; mixed precision: 12, the fp32 master copy
            included).
        data_ranks: data-parallel ranks sharing the shards.
        ps_servers: strategy ps: the ranks that also serve.
        shard_ranks: strategy hsdp: K, the ranks of a shard group (fsdp's over K: 16 Psi / K for fp32 Adam).
    """
    if strategy == "hsdp":
        if shard_ranks < 1:
            raise ValueError("hsdp's memory needs its shard groups' size (shard_ranks >= 1)")
        strategy, data_ranks = "fsdp", shard_ranks
    p, g, k = parameters * param_bytes, parameters * grad_bytes, parameters * state_bytes
    n, servers = data_ranks, ps_servers
    shares = {"ddp": (p, g, k), "zero1": (p, g, k / n), "zero2": (p, g / n, k / n),
              "fsdp": (p / n, g / n, k / n), "ps": (p, g + g / servers, k / servers)}[strategy]
    return dict(zip(("parameters", "gradients", "optimizer_state"), shares))


def state_bytes_per_parameter(optimizer: str, precision: str) -> int:
    """fp32 optimizer state, plus an fp32 master copy when the parameters are 16-bit."""
    return 4 * OPTIMIZERS[optimizer] + (4 if PRECISIONS[precision] < 4 else 0)


def _held_bytes(setup: Setup, layout: Layout, elements: float, width: int, state: int) -> Dict[str, float]:
    """What one rank of a stage holding ``elements`` keeps in parameters, gradients and optimizer state."""
    if layout.experts == 1:
        return sharded_state_bytes(layout.strategy, elements, width, width, state, layout.sharing, setup.ps_servers,
                                   layout.shard)
    if layout.tensor * layout.pipeline * layout.sequence > 1:
        raise ValueError(f"{layout.name}: expert parallelism is planned without a tensor, pipeline or sequence split")
    experts = setup.shape.expert_params
    rest = sharded_state_bytes(layout.strategy, elements - experts, width, width, state, layout.sharing,
                               setup.ps_servers)
    # Each rank's 1/E of the experts is held whole under ddp, zero1, zero2 and fsdp alike (the shares stay
    # out of ZeRO's buckets and fsdp's units): replicated over the N/E ranks holding the same experts.
    own = sharded_state_bytes("ddp", experts / layout.experts, width, width, state, 1, setup.ps_servers)
    return {key: rest[key] + own[key] for key in rest}


def _activation_bytes(setup: Setup, layout: Layout, blocks: int, held: int, last: bool) -> float:
    s, d, heads = setup.shape.seq_len, setup.shape.d_model, setup.shape.heads
    width = PRECISIONS[setup.precision]
    micro = setup.batch / layout.data / layout.micro_batches
    per_block = s * micro * d * (ACTIVATION_FIXED + ACTIVATION_SPLIT / layout.tensor
                                 + ACTIVATION_ATTENTION * heads * s / (d * layout.tensor)) * width / 2
    logits = 2 * micro * s * setup.shape.vocab * width if last else 0.0  # logits and their gradient
    # Sequence parallelism: 1/S of every token-wise term, and attention's scores are whole sequences of
    # 1/S of the heads: all of it / S (plus attention's output per block in the tokens' layout: 2 bytes x d).
    if layout.sequence > 1:  # (under tensor parallelism attention's output is this rank's d / T)
        per_block = per_block / layout.sequence + s / layout.sequence * micro * d / layout.tensor * width
        logits /= layout.sequence
    return blocks * held * per_block + logits


def memory(setup: Setup, layout: Layout) -> Estimate:
    """The busiest rank's modelled bytes (no time)."""
    shape, width = setup.shape, PRECISIONS[setup.precision]
    state = state_bytes_per_parameter(setup.optimizer, setup.precision)
    layers = shape.pipeline_layers()
    rows = []
    for index, (stage, elements) in enumerate(zip(stage_layers(shape, layout.pipeline),
                                                  stage_elements(shape, layout.tensor, layout.pipeline))):
        held = _held_bytes(setup, layout, elements, width, state)
        blocks = sum(layers[i].block for i in stage)
        in_flight = min(layout.micro_batches, layout.pipeline - index)
        activations = _activation_bytes(setup, layout, blocks, in_flight, index == layout.pipeline - 1)
        rows.append((held, activations))
    gathered = 0.0
    if layout.strategy in ("fsdp", "hsdp"):  # the largest unit (a block, or the root) whole, as often as held
        gathered = FSDP_UNITS_HELD[setup.fsdp_overlap] * width * max(layers[1].split + layers[1].replicated, layers[0].replicated + 2 * shape.d_model)
    held, _ = max(rows, key=lambda row: sum(row[0].values()))
    total = max(sum(h.values()) + a for h, a in rows) + gathered
    return Estimate(layout, held["parameters"], held["gradients"], held["optimizer_state"],
                    max(a for _, a in rows), gathered, total)
