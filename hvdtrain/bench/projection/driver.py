"""``hvdtrain bench project``: a calibrated model of data-parallel step time. MODELLED, NOT MEASURED.

One step of one worker (weak scaling: a fixed batch per worker) is modelled as

    step(p) = compute + straggler(p) + comm(p) - hidden(p)
    comm    = 2(p-1)/p * S / B  +  buffers * latency(p)        ring all-reduce (Thakur et al. 2005)
    latency = 1.9 * (8.4 us + 2(n-1) * alpha_net + 2(p-n) * alpha_intra)        for n > 1 nodes
    hidden  = min(overlap * comm, backward)                     backward = 2/3 of compute
    straggler = compute * jitter * E[max of p standard normals]  (Blom's approximation)

S is the gradient size in bytes, split into ceil(S / fusion threshold) fused buffers (Horovod packs
ready tensors up to the threshold; more, smaller buffers would add latency, so this is a lower bound).
With g GPUs per node the ring runs through all p GPUs; each node boundary is crossed once per ring
step, so every NIC carries the full 2(p-1)/p * S in each direction, not 1/g of it. B is therefore the
slower of one NIC and the intra-node link, whatever g is. (NCCL spreads the ring over several
channels, but they share the same NIC; several NICs per node are not modelled.) The latency split into
2(n-1) network and 2(p-n) intra-node steps, the 8.4 us base and the 1.9 "plateau" factor for large
multi-node ring all-reduces are NCCL's own cost model (src/graph/tuning.cc, ring/Simple protocol);
with one GPU per node it reduces to the issue's 2(p-1)*alpha with alpha = 1.9 * alpha_net.
Efficiency E(p) = samples/s at p / (p * samples/s at 1) = step(1) / step(p).

Three free parameters, calibrated once on published Horovod figures (``ANCHORS``) and then used for
every projection: ``overlap`` (share of communication hidden behind backward; it also absorbs
compute slowed by concurrent communication), ``jitter`` (relative spread of one worker's step time:
synchronous SGD waits for the slowest worker, Chen et al. 2016, arXiv:1604.00981), and the TCP
bandwidth efficiency. RDMA efficiency is not fitted: nccl-tests reach 12.2 of 12.5 GB/s on one
100 Gb/s IB card (NVIDIA/nccl-tests#29) and 192 of 200 GB/s on a DGX-A100 (NVIDIA/nccl#1576): 0.96.
The fit uses the same points it is validated on; ``validate()`` therefore also reports leave-one-out
errors (refit without the point, then predict it). The fitted TCP efficiency (0.58) agrees with an
independent report of NCCL over TCP reaching at most ~60% of wire speed (NVIDIA/nccl#209).
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import asdict, dataclass, replace
from statistics import NormalDist
from typing import Dict, List, Optional, Sequence

from hvdtrain.bench.common import report

LABEL = "MODELLED (not measured)"
MiB = 2 ** 20
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
_RDMA = "efficiency 0.96 (nccl-tests, see module doc); alpha 9.6 us = NCCL tuning.cc NET ring/Simple"
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


@dataclass(frozen=True)
class Calibration:
    overlap: float         # share of communication hidden behind backward
    jitter: float          # relative standard deviation of one worker's step time
    tcp_efficiency: float  # achieved / nominal bandwidth of NCCL over TCP


# What calibrate(ANCHORS) returns (tests/unit/test_project.py checks that it still does).
CALIBRATION = Calibration(overlap=0.70, jitter=0.011, tcp_efficiency=0.58)

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


def ring_bandwidth_s(nbytes: float, workers: int, bytes_per_s: float) -> float:
    """Bandwidth term of a ring all-reduce: 2(p-1)/p * S / B."""
    return 2 * (workers - 1) / workers * nbytes / bytes_per_s if workers > 1 else 0.0


def ring_latency_s(workers: int, nodes: int, net_alpha_s: float, intra_alpha_s: float) -> float:
    """Latency of one ring all-reduce, NCCL's way: 2(n-1) network steps and 2(p-n) intra-node steps."""
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


def predict(workload: Workload, workers: int, network: Network, gpus_per_node: int = 1,
            intra: Network = NETWORKS["pcie3"], fusion_bytes: float = 128 * MiB,
            calibration: Calibration = CALIBRATION) -> Projection:
    """Step time, samples/s and efficiency of ``workers`` workers. Horovod 0.28.1 fuses up to 128 MiB."""
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


def _workers(text: str) -> List[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"--workers wants positive integers like 1,2,4, not {text!r}")
    return sorted(set(values))


def _networks(text: str) -> List[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [n for n in names if n not in NETWORKS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown network {', '.join(unknown)}: choose from {', '.join(NETWORKS)}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_argument_group("workload (--model, or --params with --compute-ms)")
    what.add_argument("--model", choices=sorted(MODELS), help="a published model: parameters and P100 compute time")
    what.add_argument("--params", type=float, help="parameter count, e.g. 25e6")
    what.add_argument("--compute-ms", type=float, help="one worker's forward+backward+update time for one batch")
    what.add_argument("--batch", type=int, default=64, help="samples per worker per step (default 64)")
    what.add_argument("--fp16", action="store_true", help="fp16 gradient compression: half the bytes")
    parser.add_argument("--workers", type=_workers, default=[2 ** i for i in range(11)],
                        help="comma-separated worker counts (default 1,2,4,...,1024)")
    parser.add_argument("--network", type=_networks, default=["10gbe", "25gbe", "100gbe", "ib-hdr"],
                        help=f"comma-separated, from {', '.join(NETWORKS)} (default 10gbe,25gbe,100gbe,ib-hdr)")
    parser.add_argument("--gpus-per-node", type=int, default=1, help="workers sharing one NIC (default 1)")
    parser.add_argument("--intra", choices=[n for n, v in NETWORKS.items() if v.intra_node], default="pcie3",
                        help="link between the GPUs of one node (default pcie3)")
    parser.add_argument("--fusion-mb", type=float, default=128.0, help="Horovod fusion threshold, MiB (default 128)")
    parser.add_argument("--validate", action="store_true", help="compare with the published Horovod figures")
    parser.add_argument("--out", help="output directory (default bench-results/project-<time>)")


def _workload(args: argparse.Namespace) -> Optional[Workload]:
    if args.gpus_per_node < 1 or args.fusion_mb <= 0:
        raise ValueError("--gpus-per-node must be >= 1 and --fusion-mb > 0")
    width = 2 if args.fp16 else 4
    if args.model and args.params is None:
        base = model_workload(args.model, args.batch, width)
        return base if args.compute_ms is None else replace(base, compute_s=args.compute_ms / 1e3)
    if args.params is not None and args.compute_ms is not None and not args.model:
        return Workload(args.params, args.compute_ms / 1e3, args.batch, width)
    if args.model or args.params is not None or args.compute_ms is not None or not args.validate:
        raise ValueError("give --model NAME, or --params N with --compute-ms MS (not both), or --validate")
    return None


def _projection_tables(workload: Workload, args: argparse.Namespace, ax) -> tuple:
    """One table and one curve per network; returns the table lines and the JSON rows by network."""
    lines, by_network = [], {}
    for name in args.network:
        rows = [predict(workload, p, NETWORKS[name], args.gpus_per_node, NETWORKS[args.intra], args.fusion_mb * MiB)
                for p in args.workers]
        by_network[name] = [dict(asdict(r), exposed_s=r.exposed_s, comm_share=r.comm_share, label=LABEL)
                            for r in rows]
        title = (f"{LABEL}: {workload.name}, {workload.params:.3g} params, {8 * workload.bytes_per_param}-bit "
                 f"gradients, {workload.compute_s * 1e3:.0f} ms compute, batch {workload.batch}, {name}, "
                 f"{args.gpus_per_node} GPU(s)/node")
        lines += [report.format_table(
            ["workers", "nodes", "step ms", "samples/s", "efficiency %", "comm share %", "exposed comm ms"],
            [[r.workers, r.nodes, r.step_s * 1e3, r.samples_per_s, 100 * r.efficiency, 100 * r.comm_share,
              r.exposed_s * 1e3] for r in rows], title), ""]
        ax.plot([r.workers for r in rows], [100 * r.efficiency for r in rows], marker="o", label=name)
    ax.set_title(f"{LABEL}: {workload.name}")
    return lines, by_network


def _validation_table(rows: List[dict]) -> List[str]:
    c = CALIBRATION
    return [report.format_table(
        ["model", "network", "workers", "published %", "projected %", "error pp", "LOO projected %", "LOO error pp"],
        [[r["model"], r["network"], r["workers"], r["published_pct"], r["projected_pct"], r["error_pp"],
          r["loo_projected_pct"], r["loo_error_pp"]] for r in rows],
        f"{LABEL} vs published (calibration: overlap {c.overlap:.2f}, jitter {c.jitter:.3f}, TCP efficiency "
        f"{c.tcp_efficiency:.2f}, fit on these same points; LOO = refit without the row, then predict it)"), ""]


def _plot_anchors(ax, workers: Sequence[int]) -> None:
    """Each published setup's modelled curve (line) and its published figures (crosses)."""
    ax.set_title(f"{LABEL} (lines) vs published (crosses)")
    for model, net in sorted({(a.model, a.network) for a in ANCHORS}):
        curve = [100 * predict(model_workload(model), p, NETWORKS[net], **ANCHOR_SETUP).efficiency for p in workers]
        line, = ax.plot(workers, curve, label=f"{model} {net}")
        points = [a for a in ANCHORS if (a.model, a.network) == (model, net)]
        ax.plot([a.workers for a in points], [100 * a.published for a in points], "x", color=line.get_color())


def run(args: argparse.Namespace) -> int:
    try:
        workload = _workload(args)
    except ValueError as error:
        print(f"hvdtrain bench project: {error}", file=sys.stderr)
        return 2
    out = report.output_dir(args.out, "project")
    payload: dict = {"label": LABEL, "calibration": asdict(CALIBRATION)}
    lines: List[str] = []
    fig, (ax,) = report.new_figure()
    if workload is not None:
        lines, payload["networks"] = _projection_tables(workload, args, ax)
        payload.update(workload=asdict(workload), gpus_per_node=args.gpus_per_node, intra=args.intra,
                       fusion_mb=args.fusion_mb)
    if args.validate:
        payload["validation"] = validate()
        lines += _validation_table(payload["validation"])
        if workload is None:
            _plot_anchors(ax, args.workers)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("workers")
    ax.set_ylabel("scaling efficiency % (modelled)")
    ax.legend(fontsize=7)
    report.write_json(out / "results.json", payload)
    report.save_figure(fig, out / "efficiency.png")
    report.print_lines(lines + [f"wrote {out / 'results.json'} and {out / 'efficiency.png'}"])
    return 0
