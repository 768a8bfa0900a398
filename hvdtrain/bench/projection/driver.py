"""``hvdtrain bench project``: the planner's data-parallel projection (hvdtrain.planner.projection)
as tables, JSON and a PNG, at any worker count and network, and against the published Horovod
figures it is calibrated on (``--validate``). MODELLED, NOT MEASURED.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, replace
from typing import List, Optional, Sequence

from hvdtrain.bench.common import report
from hvdtrain.common.tables import format_table
from hvdtrain.common.units import MiB
from hvdtrain.observability.figures import new_figure, save_figure
from hvdtrain.planner.network import CALIBRATION, LABEL, NETWORKS
from hvdtrain.planner.projection import (ANCHOR_SETUP, ANCHORS, MODELS, Workload, model_workload, predict,
                                         validate)


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
        lines += [format_table(
            ["workers", "nodes", "step ms", "samples/s", "efficiency %", "comm share %", "exposed comm ms"],
            [[r.workers, r.nodes, r.step_s * 1e3, r.samples_per_s, 100 * r.efficiency, 100 * r.comm_share,
              r.exposed_s * 1e3] for r in rows], title), ""]
        ax.plot([r.workers for r in rows], [100 * r.efficiency for r in rows], marker="o", label=name)
    ax.set_title(f"{LABEL}: {workload.name}")
    return lines, by_network


def _validation_table(rows: List[dict]) -> List[str]:
    c = CALIBRATION
    return [format_table(
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
    fig, (ax,) = new_figure()
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
    save_figure(fig, out / "efficiency.png")
    report.print_lines(lines + [f"wrote {out / 'results.json'} and {out / 'efficiency.png'}"])
    return 0
