"""The network and time model both planner tools share: links (bandwidth, latency), ring all-reduce
terms as NCCL's own cost model has them (src/graph/tuning.cc, ring/Simple), the straggler term, and
the calibration fitted on published Horovod figures (hvdtrain.planner.projection). MODELLED.
"""
from __future__ import annotations

from dataclasses import dataclass
from statistics import NormalDist
from typing import Dict, Optional

LABEL = "MODELLED (not measured)"
NCCL_BASE_S = 8.4e-6  # NCCL tuning.cc baseLat, ring/Simple
NCCL_PLATEAU = 1.9    # NCCL tuning.cc: ring/Simple latency x1.9 for large multi-node all-reduce


@dataclass(frozen=True)
class Network:
    """One link kind. ``efficiency`` None means "TCP: use the calibrated TCP efficiency"."""

    name: str
    gbit_s: float          # nominal rate per direction
    alpha_us: float        # latency of one ring step
    transport: str         # tcp | rdma | pcie | nvlink (the last two are intra-node links)
    efficiency: Optional[float] = None
    note: str = ""

    def __post_init__(self):
        if self.gbit_s <= 0 or self.alpha_us < 0 or not (self.efficiency is None or 0 < self.efficiency <= 1):
            raise ValueError(f"network {self.name!r}: need gbit_s > 0, alpha_us >= 0, 0 < efficiency <= 1")

    @property
    def intra_node(self) -> bool:
        return self.transport in ("pcie", "nvlink")


_TCP = "NCCL socket transport; alpha: 8-byte NCCL broadcast over TCP takes 38-46 us (NVIDIA/nccl-tests#82)"
# RDMA's efficiency is not fitted: nccl-tests reach 12.2 of 12.5 GB/s on one 100 Gb/s IB card
# (NVIDIA/nccl-tests#29) and 192 of 200 GB/s on a DGX-A100 (NVIDIA/nccl#1576).
_RDMA = "efficiency 0.96 (nccl-tests); alpha 9.6 us = NCCL tuning.cc NET ring/Simple"
NETWORKS: Dict[str, Network] = {n.name: n for n in (
    Network("10gbe", 10, 35.0, "tcp", note=_TCP),
    Network("25gbe", 25, 35.0, "tcp", note=_TCP),
    Network("100gbe", 100, 35.0, "tcp", note=_TCP + "; TCP efficiency at 100 Gb/s is likely lower still"),
    Network("25roce", 25, 9.6, "rdma", 0.96, _RDMA),
    Network("100roce", 100, 9.6, "rdma", 0.96, _RDMA),
    Network("ib-edr", 100, 9.6, "rdma", 0.96, "InfiniBand EDR 4x, 100 Gb/s; " + _RDMA),
    Network("ib-hdr", 200, 9.6, "rdma", 0.96, "InfiniBand HDR 4x, 200 Gb/s; " + _RDMA),
    # PCIe 3.0 x16: 8 GT/s x 16 lanes x 128/130 = 15.75 GB/s per direction; 0.8 achievable is an assumption.
    Network("pcie3", 126, 5.7, "pcie", 0.80, "alpha = NCCL tuning.cc PCI ring/Simple"),
    Network("pcie4", 252, 5.7, "pcie", 0.80, "PCIe 4.0 x16, 31.5 GB/s per direction"),
    # A100 NVLink 3: 12 links, 600 GB/s both directions (nvidia.com/data-center/nvlink) = 300 GB/s each way;
    # 8 x A100 in one node reach 232.5 GB/s all-reduce busbw (NVIDIA/nccl#1048): 0.78.
    Network("nvlink", 2400, 3.4, "nvlink", 0.78, "A100 NVLink 3; alpha = NCCL tuning.cc NVLink ring/Simple; "
            "as --network it puts every worker in one NVLink/NVSwitch domain (real ones hold 8-72 GPUs)"),
)}


@dataclass(frozen=True)
class Calibration:
    """The three fitted parameters. The fitted TCP efficiency (0.58) agrees with an independent
    report of NCCL over TCP reaching at most ~60% of wire speed (NVIDIA/nccl#209)."""

    overlap: float         # share of communication hidden behind backward
    jitter: float          # relative standard deviation of one worker's step time
    tcp_efficiency: float  # achieved / nominal bandwidth of NCCL over TCP


# What calibrate(ANCHORS) returns (tests/unit/test_project.py checks that it still does).
CALIBRATION = Calibration(overlap=0.70, jitter=0.011, tcp_efficiency=0.58)


def ring_bandwidth_s(nbytes: float, workers: int, bytes_per_s: float) -> float:
    """Bandwidth term of a ring all-reduce: 2(p-1)/p * S / B."""
    return 2 * (workers - 1) / workers * nbytes / bytes_per_s if workers > 1 else 0.0


def ring_latency_s(workers: int, nodes: int, net_alpha_s: float, intra_alpha_s: float) -> float:
    """Latency of one ring all-reduce, NCCL's way: 2(n-1) network steps and 2(p-n) intra-node steps.

    Args:
        workers: p, ranks in the ring.
        nodes: n, the nodes they span.
        net_alpha_s: one network step's latency, in seconds.
        intra_alpha_s: one intra-node step's latency, in seconds.
    """
    if workers <= 1:
        return 0.0
    if nodes <= 1:
        return NCCL_BASE_S + 2 * (workers - 1) * intra_alpha_s
    return NCCL_PLATEAU * (NCCL_BASE_S + 2 * (nodes - 1) * net_alpha_s + 2 * (workers - nodes) * intra_alpha_s)


def expected_max_normal(n: int) -> float:
    """E[max of n standard normals], Blom's approximation (within 0.03 of exact for all n)."""
    return 0.0 if n <= 1 else NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def bytes_per_s(network: Network, calibration: Calibration) -> float:
    efficiency = calibration.tcp_efficiency if network.efficiency is None else network.efficiency
    return network.gbit_s * 1e9 / 8 * efficiency
