"""Data-parallel step time on large clusters, calibrated on published Horovod figures. MODELLED.

    step(p)   = compute + straggler(p) + comm(p) - hidden(p)
    comm      = 2(p-1)/p * S / B + buffers * latency(p)         ring all-reduce (Thakur et al. 2005)
    hidden    = min(overlap * comm, backward)                    backward = 2/3 of compute
    straggler = compute * jitter * E[max of p standard normals]  (Chen et al. 2016)

S is the gradient bytes in ceil(S / fusion threshold) fused buffers; B the slower of one NIC and the
intra-node link (each node boundary carries the whole ring). Three parameters (overlap, jitter, TCP
efficiency) are fitted once on ``ANCHORS``; ``validate`` reports in-sample and leave-one-out errors.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Dict, List, Sequence

from hvdtrain.common.units import MiB
from hvdtrain.planner.network import (CALIBRATION, NETWORKS, Calibration, Network, bytes_per_s,
                                      expected_max_normal, ring_bandwidth_s, ring_latency_s)


@dataclass(frozen=True)
class Workload:
    """One worker's training step: ``compute_s`` is forward + backward + update of one batch, alone."""

    params: float
    compute_s: float
    batch: int = 64
    bytes_per_param: int = 4     # fp32 gradients; 2 with fp16 compression
    backward_fraction: float = 2 / 3
    name: str = "custom"

    def __post_init__(self):
        if self.params <= 0 or self.compute_s <= 0 or self.batch <= 0 or self.bytes_per_param <= 0:
            raise ValueError(f"workload {self.name!r}: params, compute_s, batch and bytes_per_param must be > 0")

    @property
    def grad_bytes(self) -> float:
        return self.params * self.bytes_per_param


# Parameter counts: Keras Applications table (InceptionV3 23.9M, ResNet101 44.7M, VGG16 138.4M) and
# torchvision (inception_v3 without the auxiliary head 23.8M, resnet101 44.5M, vgg16 138.4M).
# Single-GPU images/s, batch 64, synthetic data, tf_cnn_benchmarks on a DGX-1 (P100), TensorFlow
# performance/benchmarks.md (May 2017): InceptionV3 142, ResNet-50 219, ResNet-152 91.8, VGG16 154.
# ResNet-101 is not in that table: per-image time interpolated linearly in FLOPs (torchvision 4.13/
# 7.87/11.6 GFLOPs for ResNet-50/101/152) between ResNet-50 and ResNet-152 gives 129.3 images/s.
# (Horovod's benchmarks page shows 1656.82 images/s for ResNet-101 on 16 GPUs, 103.6 per GPU, GPU unstated.)
MODELS: Dict[str, tuple] = {  # name: (parameters, single-GPU images/s at batch 64)
    "inception_v3": (23.8e6, 142.0), "resnet50": (25.6e6, 219.0),
    "resnet101": (44.5e6, 129.3), "vgg16": (138.4e6, 154.0),
}


def model_workload(name: str, batch: int = 64, bytes_per_param: int = 4) -> Workload:
    params, images_per_s = MODELS[name]
    return Workload(params, batch / images_per_s, batch, bytes_per_param, name=name)


@dataclass(frozen=True)
class Projection:
    workers: int
    nodes: int
    compute_s: float
    straggler_s: float
    bandwidth_s: float     # ring bandwidth term, all buffers
    latency_s: float       # ring latency term, all buffers
    hidden_s: float
    step_s: float
    samples_per_s: float
    efficiency: float

    @property
    def comm_s(self) -> float:
        return self.bandwidth_s + self.latency_s

    @property
    def exposed_s(self) -> float:
        return self.comm_s - self.hidden_s

    @property
    def comm_share(self) -> float:
        """Exposed communication as a share of the step."""
        return self.exposed_s / self.step_s


def predict(workload: Workload, workers: int, network: Network, gpus_per_node: int = 1,
            intra: Network = NETWORKS["pcie3"], fusion_bytes: float = 128 * MiB,
            calibration: Calibration = CALIBRATION) -> Projection:
    """Step time, samples/s and efficiency of data-parallel workers. Horovod 0.28.1 fuses up to 128 MiB.

    Args:
        workload: one worker's step alone.
        workers: data-parallel workers.
        network: the link between nodes.
        gpus_per_node: workers per node.
        intra: the link inside a node.
        fusion_bytes: Horovod's fusion threshold, in bytes.
        calibration: the factors fitted to measurements.
    """
    if workers < 1 or gpus_per_node < 1 or fusion_bytes <= 0:
        raise ValueError("need workers >= 1, gpus_per_node >= 1 and fusion_bytes > 0")
    if network.intra_node:  # the whole job inside one NVLink/PCIe domain
        nodes, intra = 1, network
    else:
        nodes = math.ceil(workers / gpus_per_node)
    hops = [intra] if nodes == 1 else [network] + ([intra] if gpus_per_node > 1 else [])
    bandwidth = min(bytes_per_s(link, calibration) for link in hops)
    buffers = math.ceil(workload.grad_bytes / fusion_bytes) if workers > 1 else 0
    bw_s = ring_bandwidth_s(workload.grad_bytes, workers, bandwidth)
    lat_s = buffers * ring_latency_s(workers, nodes, network.alpha_us * 1e-6, intra.alpha_us * 1e-6)
    hidden = min(calibration.overlap * (bw_s + lat_s), workload.backward_fraction * workload.compute_s)
    straggler = workload.compute_s * calibration.jitter * expected_max_normal(workers)
    step = workload.compute_s + straggler + bw_s + lat_s - hidden
    return Projection(workers, nodes, workload.compute_s, straggler, bw_s, lat_s, hidden, step,
                      workers * workload.batch / step, workload.compute_s / step)


@dataclass(frozen=True)
class Anchor:
    model: str
    network: str
    workers: int
    published: float   # scaling efficiency, 0..1
    source: str


_PAPER = "Sergeev & Del Balso 2018, arXiv:1802.05799 (128 Pascal GPUs, 25GbE TCP; 4 per server assumed)"
_DOCS_128 = "Horovod docs/benchmarks.md, 2017 (32 servers x 4 Pascal GPUs, 25 Gbit/s RoCE)"
_DOCS_512 = "Horovod docs/benchmarks.rst (128 servers x 4 Pascal GPUs, 25 Gbit/s RoCE)"
ANCHORS = (
    Anchor("inception_v3", "25gbe", 128, 0.88, _PAPER), Anchor("resnet101", "25gbe", 128, 0.88, _PAPER),
    Anchor("inception_v3", "25roce", 128, 0.90, _DOCS_128), Anchor("resnet101", "25roce", 128, 0.90, _DOCS_128),
    Anchor("vgg16", "25roce", 128, 0.79, _DOCS_128),
    Anchor("inception_v3", "25roce", 512, 0.90, _DOCS_512), Anchor("resnet101", "25roce", 512, 0.90, _DOCS_512),
    Anchor("vgg16", "25roce", 512, 0.68, _DOCS_512),
)
# How the anchors ran: tf_cnn_benchmarks, batch 64, fp32, 4 GPUs per server (PCIe between them is an
# assumption), and a Horovod older than 0.21, whose fusion threshold was 64 MB (shared/reference/horovod.md).
ANCHOR_SETUP = dict(gpus_per_node=4, intra=NETWORKS["pcie3"], fusion_bytes=64 * MiB)


def anchor_projection(anchor: Anchor, calibration: Calibration = CALIBRATION) -> Projection:
    return predict(model_workload(anchor.model), anchor.workers, NETWORKS[anchor.network],
                   calibration=calibration, **ANCHOR_SETUP)


def _sse(anchors: Sequence[Anchor], calibration: Calibration) -> float:
    return sum((anchor_projection(a, calibration).efficiency - a.published) ** 2 for a in anchors)


def calibrate(anchors: Sequence[Anchor] = ANCHORS) -> Calibration:
    """Least squares on grids: overlap and jitter on the RDMA anchors, then TCP efficiency on the TCP ones."""
    rdma = [a for a in anchors if NETWORKS[a.network].efficiency is not None]
    tcp = [a for a in anchors if NETWORKS[a.network].efficiency is None]
    grid = [Calibration(o / 100, j / 1000, 1.0) for o in range(101) for j in range(41)]
    best = min(grid, key=lambda c: _sse(rdma, c))
    if tcp:
        best = min((replace(best, tcp_efficiency=e / 100) for e in range(20, 101)), key=lambda c: _sse(tcp, c))
    return best


def validate(calibration: Calibration = CALIBRATION, anchors: Sequence[Anchor] = ANCHORS) -> List[dict]:
    """Projected vs published efficiency per anchor, in-sample and leave-one-out (errors in points)."""
    rows = []
    for i, anchor in enumerate(anchors):
        projected = anchor_projection(anchor, calibration).efficiency
        loo = anchor_projection(anchor, calibrate(anchors[:i] + anchors[i + 1:])).efficiency
        rows.append(dict(model=anchor.model, network=anchor.network, workers=anchor.workers,
                         published_pct=100 * anchor.published, projected_pct=100 * projected,
                         error_pp=100 * (projected - anchor.published), loo_projected_pct=100 * loo,
                         loo_error_pp=100 * (loo - anchor.published), source=anchor.source))
    return rows
