"""Check a layout before paying for it: the model's family built tiny on this machine (CPU, Gloo,
float64 throughout), a few steps under the layout through the Trainer against one process on the
same batches, and the verdict: equal, the first parameter that differs, or hvdtrain's refusal.

    hvdtrain check-layout gemma2 --tensor_parallel=2
    hvdtrain check-layout ./my-model --tensor_parallel=2 --pipeline_parallel=2 --optimizer sgd
    hvdtrain check-layout qwen2_moe --strategy=fsdp --meta
    hvdtrain check-layout qwen3_moe --expert_parallel=2 --strategy=fsdp
    hvdtrain check-layout llama --tensor_parallel=2 --sequence_parallel=2

MODEL is a causal-LM model type of the installed transformers (llama, gemma2, ...) or a local model
directory with a config.json (its sizes shrunk the same way: the structure is checked, not the
weights). T x P x S x D ranks are started on this machine (D = 2 without a mesh or sequence groups:
data parallelism; E or K when more). The layout is checked first against the rules of which
dimensions combine (hvdtrain.common.layout_rules) and what divides, and every rank's coordinates in
every dimension are printed (hvdtrain.parallel.topology.Dimensions), before anything is launched.
Exit status: 0 equal, 1 differs, 2 refused or bad input (a family that cannot be built tiny too),
3 an error (a crash, a hang past --timeout).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

HELP = "train a tiny copy of a Hugging Face family under a layout and compare it with one process"
EXIT = {"equal": 0, "differs": 1, "refused": 2, "skipped": 2, "error": 3}
OPTIMIZER_CHOICES = ("adamw", "sgd", "both")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="a model type (llama, gemma2, ...) or a directory with a "
                                                       "Hugging Face config.json")
    parser.add_argument("--tensor_parallel", "--tensor-parallel", type=int, default=1, help="T (default 1)")
    parser.add_argument("--pipeline_parallel", "--pipeline-parallel", type=int, default=1, help="P (default 1)")
    parser.add_argument("--data_parallel", "--data-parallel", type=int, default=0,
                        help="model replicas (default: 1 under a mesh, else 2)")
    parser.add_argument("--sequence_parallel", "--sequence-parallel", type=int, default=1, help="S (default 1)")
    parser.add_argument("--expert_parallel", "--expert-parallel", type=int, default=1,
                        help="E, ranks per expert group within the data replicas (default 1)")
    parser.add_argument("--strategy", default="ddp", help="train.strategy (default ddp)")
    parser.add_argument("--hsdp_shard_size", "--hsdp-shard-size", type=int, default=0,
                        help="strategy=hsdp: K, ranks per shard group (default 0: the ranks of one host, here all)")
    parser.add_argument("--meta", action="store_true", help="build the model on the meta device (the Trainer "
                                                           "gives it its values, as for a model too big to build)")
    parser.add_argument("--optimizer", choices=OPTIMIZER_CHOICES, default="both",
                        help="AdamW, plain SGD (shows a gradient off by a constant factor Adam's step hides), "
                             "or both (default)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps (default 3)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before the check is an error (a hang)")
    parser.add_argument("--launcher", choices=("horovodrun", "mpirun"), default="horovodrun")


def run(args: argparse.Namespace) -> int:
    try:
        family, config_dir, layout = _resolve(args)
    except ValueError as error:
        print(f"hvdtrain check-layout: {error}", file=sys.stderr)
        return EXIT["refused"]
    from hvdtrain.verify import driver
    from hvdtrain.verify.reference import OPTIMIZERS

    optimizers = list(OPTIMIZERS) if args.optimizer == "both" else [args.optimizer]
    extra = ["--tensor", str(layout.tensor), "--pipeline", str(layout.pipeline), "--data", str(layout.data),
             "--strategy", layout.strategy, "--sequence", str(layout.sequence), "--experts", str(layout.experts),
             "--shard", str(layout.shard), *(["--meta"] if layout.meta else []),
             *(["--config-dir", config_dir] if config_dir else [])]
    print(f"{family} under {layout.name} ({layout.ranks} ranks on this machine, float64, {args.steps} steps)",
          flush=True)
    for line in coordinate_lines(layout):
        print(f"  {line}", flush=True)
    try:
        outcomes = driver.run([family], [layout], optimizers, args.steps, family_timeout=args.timeout,
                              launcher=args.launcher, extra_args=extra)
    except driver.LaunchFailed as error:
        print(f"hvdtrain check-layout: {error}", file=sys.stderr)
        return EXIT["error"]
    for outcome in outcomes:
        print(f"  {outcome.optimizer}: {outcome.summary()}")
    # The gravest end decides: one optimizer's difference is a wrong split whatever the other gives.
    ends = {o.result for o in outcomes}
    return next((EXIT[end] for end in ("differs", "error", "refused", "skipped") if end in ends), EXIT["equal"])


def _resolve(args: argparse.Namespace):
    """(model type, config directory or None, layout), or ValueError saying what to give instead."""
    from hvdtrain.strategies.registry import STRATEGY_NAMES
    from hvdtrain.verify.layouts import layout_for

    if args.strategy not in STRATEGY_NAMES:
        raise ValueError(f"--strategy={args.strategy!r} is not a strategy: choose one of {', '.join(STRATEGY_NAMES)}")
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    layout = layout_for(args.tensor_parallel, args.pipeline_parallel, args.strategy, args.meta, args.data_parallel,
                        args.sequence_parallel, args.expert_parallel, args.hsdp_shard_size)
    check_rules(layout)
    from hvdtrain.verify import tiny

    if Path(args.model).is_dir():
        model_type, _ = tiny.config_from_directory(args.model)
        tiny.family(model_type)  # a causal LM the installed transformers knows
        return model_type, str(Path(args.model).resolve()), layout
    if "/" in args.model or Path(args.model).exists():
        raise ValueError(f"{args.model} is not a directory: give a model directory with a config.json, or a "
                         f"model type such as llama")
    return tiny.family(args.model).model_type, None, layout


def check_rules(layout) -> None:
    """ValueError (exit 2) when the layout's dimensions and strategy do not combine (hvdtrain.common.layout_rules),
    or hsdp_shard_size is given without hsdp, with the reason and the way out, as a training would refuse it."""
    from hvdtrain.common import layout_rules

    if layout.shard and layout.strategy != "hsdp":
        raise ValueError(f"--hsdp_shard_size={layout.shard} applies to --strategy=hsdp only: set --strategy=hsdp, "
                         f"or leave it at 0")
    settings = {**layout.settings(), "strategy": layout.strategy}
    why = layout_rules.check(settings, prefix="--")
    if why is not None:
        raise ValueError(why)
    dimensions(layout)  # what divides, refused alike


def dimensions(layout):
    """The layout's Dimensions over its ranks (LayoutError, a ValueError, when they do not divide)."""
    from hvdtrain.parallel.topology import Dimensions

    shard = (layout.shard or layout.ranks) if layout.strategy == "hsdp" else 0  # one machine: one host's ranks
    return Dimensions(layout.ranks, layout.tensor, layout.pipeline, layout.sequence, layout.experts, shard)


def coordinate_lines(layout) -> list:
    """One line per rank: its coordinate in every dimension of the layout."""
    found = dimensions(layout)
    return [found.describe(rank) for rank in range(layout.ranks)]
