"""Which strategy and mesh to run, for a model on a cluster: every layout that fits, its memory per
rank and step time (MODELLED, not measured: hvdtrain.planner says how), and the fastest one.

    hvdtrain plan --example textlm --workers 4 --memory 2GiB
    hvdtrain plan --layers 48 --d-model 1600 --seq-len 1024 --vocab 50257 --heads 25 \\
        --batch 512 --workers 64 --memory 40GB --network ib-hdr --gpus-per-node 8 --intra nvlink --precision bf16

A memory that fits nothing is an error that says the memory per worker and the worker count that would fit.
"""
from __future__ import annotations

import argparse
import sys
from typing import List

from hvdtrain.common import units
from hvdtrain.common.tables import format_table
from hvdtrain.common.units import MiB, format_bytes
from hvdtrain import planner
from hvdtrain.planner.network import LABEL, NETWORKS


def parse_bytes(text: str) -> float:
    """'2GiB', '40GB', '512MiB', '1e9' -> bytes."""
    size = units.parse_bytes(text)
    if size is None:
        raise argparse.ArgumentTypeError(f"a memory size like 2GiB, 40GB or 512MiB, not {text!r}")
    return size


HELP = "which strategy and mesh fit this model on this cluster, and the fastest (modelled)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("the model (--example, or its shape)")
    model.add_argument("--example", choices=["textlm"],
                       help="textlm: hvdtrain.examples.textlm's TinyTransformerLM, default config")
    for name, text in (("layers", "transformer blocks"), ("d-model", "width"), ("seq-len", "context, tokens"),
                       ("vocab", "vocabulary size"), ("heads", "attention heads")):
        model.add_argument(f"--{name}", type=int, help=text)
    model.add_argument("--params", type=float,
                       help="parameter count, if not the shape's own (GPT blocks, tied head); the blocks take the difference")
    parser.add_argument("--batch", type=int, default=64, help="global batch, samples per step (default 64)")
    parser.add_argument("--workers", type=int, required=True, help="worker (device) count")
    parser.add_argument("--memory", type=parse_bytes, required=True, help="device memory per worker: 2GiB, 40GB...")
    parser.add_argument("--network", choices=list(NETWORKS), default="25gbe",
                        help="bench project's network presets (default 25gbe)")
    parser.add_argument("--gpus-per-node", type=int, default=1, help="workers per node (default 1)")
    parser.add_argument("--intra", choices=[n for n, v in NETWORKS.items() if v.intra_node], default="pcie3",
                        help="link between the workers of one node (default pcie3)")
    parser.add_argument("--optimizer", choices=list(planner.OPTIMIZERS), default="adam",
                        help="adam (2 state tensors) or sgd with momentum (1); state in fp32 (default adam)")
    parser.add_argument("--precision", choices=list(planner.PRECISIONS), default="fp32",
                        help="parameters, gradients and activations; bf16 adds an fp32 master copy (default fp32)")
    parser.add_argument("--flops", type=float, default=planner.DEFAULT_FLOPS,
                        help=f"FLOP/s one device achieves (default {planner.DEFAULT_FLOPS:.3g}: assumed, not measured)")
    parser.add_argument("--update-bandwidth", type=float, default=planner.DEFAULT_UPDATE_BANDWIDTH,
                        help=f"bytes/s one device's optimizer update streams (default "
                             f"{planner.DEFAULT_UPDATE_BANDWIDTH:.3g}: assumed, not measured)")
    parser.add_argument("--micro-batches", type=int,
                        help="pipeline micro-batches (default: the most, up to 4 x stages, dividing a replica's batch)")
    parser.add_argument("--ps-servers", type=int, default=1, help="strategy ps: server ranks (default 1)")
    parser.add_argument("--fusion-mb", type=float, default=128.0, help="Horovod fusion threshold, MiB (default 128)")


def _shape(args: argparse.Namespace) -> planner.ModelShape:
    given = {name: getattr(args, name) for name in ("layers", "d_model", "seq_len", "vocab", "heads")}
    if args.example:
        if any(value is not None for value in given.values()) or args.params is not None:
            raise ValueError("give --example or the model's shape, not both")
        from hvdtrain.examples.textlm import planner_shape  # torch: only for --example

        return planner_shape()
    missing = [f"--{name.replace('_', '-')}" for name, value in given.items() if value is None]
    if missing:
        raise ValueError(f"give --example textlm, or the model's shape: missing {', '.join(missing)}")
    return planner.ModelShape(**given, params=args.params)


def setup_from(args: argparse.Namespace) -> planner.Setup:
    return planner.Setup(_shape(args), args.batch, args.memory, args.workers, args.network, args.optimizer,
                      args.precision, args.flops, args.micro_batches, args.gpus_per_node, args.intra,
                      args.ps_servers, args.fusion_mb * MiB, update_bandwidth=args.update_bandwidth)


def table_lines(result: planner.Plan) -> List[str]:
    setup, shape = result.setup, result.setup.shape
    rows = [[e.layout.strategy, e.layout.tensor, e.layout.pipeline, e.layout.sequence, e.layout.data, e.layout.micro_batches,
             e.states / MiB, e.activations / MiB, e.total / MiB, e.step_s * 1e3, e.samples_per_s]
            for e in result.fitting]
    title = (f"{LABEL}: {planner.format_count(shape.total)} parameters ({shape.layers} layers, d_model {shape.d_model}, "
             f"seq {shape.seq_len}, vocab {shape.vocab}, heads {shape.heads}), {setup.optimizer}, {setup.precision}, "
             f"global batch {setup.batch}, {setup.workers} workers x {format_bytes(setup.memory)}, {setup.network}, "
             f"{setup.flops / 1e12:.3g} TFLOP/s and an update at {setup.update_bandwidth / 1e12:.3g} TB/s per device "
             f"(assumed). Layouts that fit, fastest first:")
    headers = ["strategy", "T", "P", "S", "D", "M", "params+grads+state MiB (modelled)", "activations MiB (modelled)",
               "total MiB (modelled)", "step ms (modelled)", "samples/s (modelled)"]
    lines = [format_table(headers, rows, title)]
    if result.too_big:
        lines.append("do not fit: " + ", ".join(f"{e.layout.name} ({format_bytes(e.total)})"
                                                 for e in sorted(result.too_big, key=lambda e: e.total)))
    best = result.recommended.layout
    lines += [f"recommended (modelled): {best.name}: {result.why()}",
              _how_to_run(best, setup.batch)]
    return lines


def _how_to_run(layout: planner.Layout, batch: int) -> str:
    flags = [f"--train.strategy={layout.strategy}", f"--train.batch_size={batch // layout.data}"]
    if layout.tensor > 1:
        flags.append(f"--train.tensor_parallel={layout.tensor}")
    if layout.pipeline > 1:
        flags += [f"--train.pipeline_parallel={layout.pipeline}", f"--train.micro_batches={layout.micro_batches}"]
    if layout.sequence > 1:
        flags.append(f"--train.sequence_parallel={layout.sequence}")
    return "  run with: " + " ".join(flags)


def run(args: argparse.Namespace) -> int:
    try:
        result = planner.make_plan(setup_from(args))
    except ValueError as error:  # NothingFits included
        print(f"hvdtrain plan: {error}", file=sys.stderr)
        return 2
    print("\n".join(table_lines(result)), flush=True)
    return 0
