"""Step time, MODELLED: compute (6 x the elements a rank holds x its replica's tokens / the device's
rate), stretched by the pipeline's bubble (M + P - 1) / M; the optimizer's update, bound by memory
bandwidth (28 bytes per element for Adam, 20 for SGD with momentum) and shared by the ranks that
shard it; and communication by the network model (hvdtrain.planner.network): the data-parallel
exchange of each strategy (partly hidden behind backward), the tensor group's 4 all-reduces per block
and micro-batch, the sequence group's 8 all-to-alls per block, and the pipeline's sends between
neighbouring stages. Under sequence parallelism each rank computes 1/S of its group's tokens.

A mixture of experts computes with the parameters a token uses (top-k of the routed experts, all the
rest). Under expert parallelism (E) a rank all-reduces the rest of the model's gradients over the N
data ranks and its 1/E of the experts' over the N/E ranks holding the same experts (stride E), and
every MoE layer exchanges its tokens within the expert group of E neighbouring ranks: forward an
all-to-all of each (token, chosen expert) pair's hidden state out and one of the results back (and
two small ones of the routing weights and the experts' indices), backward the same three gradients;
(E-1)/E of each leaves the rank.

hsdp (K ranks per shard group, one node's) is fsdp's exchange over the shard group, then, once per
step after backward (exposed), an all-reduce of each rank's 1/K of the gradients over the N/K ranks
holding the same slice (stride K, one per node): what crosses nodes."""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Tuple

from hvdtrain.planner.layout import OPTIMIZERS, PRECISIONS, Estimate, Layout, Setup
from hvdtrain.planner.memory import memory
from hvdtrain.planner.model_shape import stage_elements, stage_layers
from hvdtrain.planner.network import NETWORKS, bytes_per_s, expected_max_normal, ring_bandwidth_s, ring_latency_s


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
    """Seconds of ring all-reduces over a group, fused up to the threshold.

    Args:
        setup: the cluster and run being planned.
        nbytes: bytes per all-reduce.
        size: ranks in the group.
        stride: rank distance between the group's members (ranks fill nodes in order).
        calls: all-reduces of ``nbytes``.
    """
    if size <= 1 or nbytes <= 0:
        return 0.0
    nodes, bandwidth, net_alpha, intra_alpha = _group_link(setup, size, stride)
    buffers = math.ceil(nbytes / setup.fusion_bytes)
    return calls * (ring_bandwidth_s(nbytes, size, bandwidth)
                    + buffers * ring_latency_s(size, nodes, net_alpha, intra_alpha))


def alltoall_s(setup: Setup, nbytes: float, size: int, calls: int = 1, stride: int = 1) -> float:
    """Seconds of all-to-alls over a group of ranks ``stride`` apart, each rank holding ``nbytes`` and
    sending (size - 1) / size of it, one latency per exchange.

    Args:
        setup: the cluster and run being planned.
        nbytes: bytes each rank holds before the exchange.
        size: ranks in the group.
        calls: all-to-alls.
        stride: rank distance between the group's members (a sequence group inside tensor groups: T).
    """
    if size <= 1 or nbytes <= 0:
        return 0.0
    nodes, bandwidth, net_alpha, intra_alpha = _group_link(setup, size, stride)
    return calls * (nbytes * (size - 1) / size / bandwidth + (net_alpha if nodes > 1 else intra_alpha))


def _gradient_comm_s(setup: Setup, layout: Layout, elements: float) -> Tuple[float, float]:
    """(hideable behind backward, exposed) seconds of the data-parallel exchange."""
    grads = elements * PRECISIONS[setup.precision]
    ring = allreduce_s(setup, grads, layout.sharing, layout.tensor * layout.pipeline)
    if layout.strategy == "ddp":
        return ring, 0.0
    if layout.strategy == "zero1" and layout.tensor * layout.pipeline > 1:
        return ring, ring / 2  # the gradients all-reduced whole, then each parameter from its owner
    if layout.strategy in ("zero1", "zero2"):  # reduce-scatter in backward, all-gather after the step
        return ring / 2, ring / 2
    if layout.strategy in ("fsdp", "hsdp"):  # per unit: all-gather forward, all-gather backward, reduce-scatter
        units = setup.shape.layers + 1
        group = layout.shard if layout.strategy == "hsdp" else layout.sharing
        per_unit = allreduce_s(setup, grads / units, group, 1)
        across = allreduce_s(setup, grads / group, layout.sharing // group, group) if group < layout.sharing else 0.0
        return 1.5 * units * per_unit, across
    # ps: the busiest server receives every worker's gradients of its slice and sends the weights back.
    nodes, bandwidth, net_alpha, intra_alpha = _group_link(setup, layout.data, 1)
    slice_bytes = grads / setup.ps_servers
    return 0.0, 2 * layout.data * slice_bytes / bandwidth + ring_latency_s(layout.data, nodes, net_alpha, intra_alpha)


def _expert_split(setup: Setup, layout: Layout, elements: float) -> Tuple[float, float]:
    """(elements of the rest of the model, elements of the routed experts) one rank holds."""
    if layout.experts == 1:
        return elements, 0.0
    experts = setup.shape.expert_params
    return elements - experts, experts / layout.experts


def dispatch_s(setup: Setup, layout: Layout) -> float:
    """Seconds of one step's expert dispatch: per MoE layer, the pairs' hidden states out and the results
    back, forward and backward (4 all-to-alls of pairs x d_model), and the routing weights (forward and
    backward) and the experts' indices (forward, int64): 3 small ones."""
    if layout.experts == 1:
        return 0.0
    shape, width = setup.shape, PRECISIONS[setup.precision]
    pairs = setup.batch / layout.data * shape.seq_len * shape.top_k
    hidden = alltoall_s(setup, pairs * shape.d_model * width, layout.experts, calls=4 * shape.moe_layers)
    small = alltoall_s(setup, pairs * (2 * width + 8) / 3, layout.experts, calls=3 * shape.moe_layers)
    return hidden + small


def update_bytes_per_element(optimizer: str) -> int:
    """Bytes an elementwise update reads and writes per parameter element, fp32: the parameter (read
    and written), its gradient (read) and each state tensor (read and written)."""
    return 4 * (3 + 2 * OPTIMIZERS[optimizer])


def update_s(setup: Setup, layout: Layout, elements: float) -> float:
    """Seconds of the optimizer's update on the busiest rank, which holds ``elements`` of the model."""
    if layout.strategy in ("zero1", "zero2", "fsdp"):
        updated = elements / layout.sharing  # each rank updates its slice
    elif layout.strategy == "hsdp":
        updated = elements / layout.shard  # its slice, as every rank holding the same slice does
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
    ideal = 6 * elements * shape.active_fraction * replica_batch * shape.seq_len / layout.sequence / setup.flops
    m, p = layout.micro_batches, layout.pipeline
    bubble = ideal * (p - 1) / m
    compute = ideal + bubble
    activation = replica_batch / m * shape.seq_len * shape.d_model * width
    # A sequence group's rank holds 1/S of the tokens: the tensor group all-reduces that share.
    tensor_s = allreduce_s(setup, activation / layout.sequence, layout.tensor, 1, calls=4 * blocks * m)
    pipe_s = 0.0
    if p > 1:
        nodes, bandwidth, net_alpha, intra_alpha = _group_link(setup, 2, layout.tensor)  # stage -> next stage
        pipe_s = 2 * m * (activation / bandwidth + (net_alpha if nodes > 1 else intra_alpha))
    sequence_s = 0.0
    if layout.sequence > 1:  # 4 all-to-alls per block forward (q, k, v out; the output back), 4 backward
        # Its tokens of this rank's 1/T of the heads, between ranks T apart (tensor groups are innermost).
        sequence_s = alltoall_s(setup, activation / layout.sequence / layout.tensor, layout.sequence,
                                calls=8 * blocks, stride=layout.tensor)
    rest, own_experts = _expert_split(setup, layout, elements)
    hideable, exposed = _gradient_comm_s(setup, layout, rest)
    # The experts' share: averaged over the N/E ranks holding the same experts, E apart, as ddp's are.
    hideable += allreduce_s(setup, own_experts * width, layout.sharing // layout.experts, layout.experts)
    expert_s = dispatch_s(setup, layout)
    window = ideal if layout.strategy in ("fsdp", "hsdp") else 2 / 3 * ideal  # fsdp prefetches in forward too
    hidden = min(setup.calibration.overlap * hideable, window)
    straggler = compute * setup.calibration.jitter * expected_max_normal(setup.workers)
    comm = tensor_s + pipe_s + sequence_s + expert_s + hideable + exposed
    # The expert shares are stepped whole on their rank under ddp and fsdp alike.
    update = update_s(setup, layout, rest) + own_experts * update_bytes_per_element(setup.optimizer) / setup.update_bandwidth
    step = compute + update + straggler + comm - hidden
    return replace(held, compute_s=ideal, bubble_s=bubble, update_s=update, comm_s=comm - hidden, step_s=step,
                   samples_per_s=setup.batch / step)
