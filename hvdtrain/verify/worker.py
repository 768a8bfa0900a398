"""The worker of the layout checks: every rank of one launch runs many families in sequence, each
under the layouts of this world size and each optimizer; rank 0 appends one JSON line per case to
``--out`` as it ends (and a line when a family starts, so that the driver can tell which one a
crash or a hang was in and start again after it).

    python -m hvdtrain.verify.worker --out FILE --families llama,gemma2 --layouts T2,P2 \\
        [--optimizers adamw,sgd] [--steps 3] [--config-dir DIR]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Optional, Sequence

from hvdtrain.verify.layouts import named
from hvdtrain.verify.outcome import Outcome

STARTED = "started"  # the event of a family's first line


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--families", required=True, help="comma-separated model types")
    parser.add_argument("--layouts", required=True, help="comma-separated layout names (hvdtrain.verify.layouts)")
    parser.add_argument("--optimizers", default="adamw,sgd")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--config-dir", default=None, help="a local model directory whose config.json is shrunk "
                                                          "(one family: its model type)")
    parser.add_argument("--tensor", type=int, help="a layout of these sizes instead of --layouts (check-layout)")
    parser.add_argument("--pipeline", type=int, default=1)
    parser.add_argument("--data", type=int, default=0)
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--meta", action="store_true")
    parser.add_argument("--sequence", type=int, default=1)
    parser.add_argument("--experts", type=int, default=1)
    parser.add_argument("--shard", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    _quiet()
    from hvdtrain.distributed import startup
    from hvdtrain.distributed.waiting import wait_without_spinning
    from hvdtrain.verify.case import run_case
    from hvdtrain.verify.layouts import layout_for

    world = startup.init(seed=0, threads=1, dynamic_process_sets=True)
    if world.local_size >= len(os.sched_getaffinity(0)):
        wait_without_spinning()
    layouts = ([layout_for(args.tensor, args.pipeline, args.strategy, args.meta, args.data, args.sequence, args.experts,
                           args.shard)]
               if args.tensor else named(args.layouts))
    layouts = [layout for layout in layouts if layout.ranks == world.size]
    optimizers = [name for name in args.optimizers.split(",") if name]
    for family in [name for name in args.families.split(",") if name]:
        _write(world, args.out, json.dumps({"event": STARTED, "family": family}))
        tiny = _built(family, args.config_dir)
        for layout in layouts:
            for optimizer in optimizers:
                if not tiny.built:
                    outcome = Outcome(family, layout.name, optimizer, "skipped", reason=tiny.reason)
                else:
                    outcome = run_case(world, family, tiny.config, layout, optimizer, args.steps)
                _write(world, args.out, outcome.to_json())
    return 0


def _built(family: str, config_dir: Optional[str]):
    from hvdtrain.verify.tiny import build_tiny, config_from_directory

    config = config_from_directory(config_dir)[1] if config_dir else None
    tiny = build_tiny(family, config)
    tiny.model = None  # every case builds its own, on the device its layout asks for
    return tiny


def _write(world, out: Path, line: str) -> None:
    if world.rank == 0:
        with open(out, "a") as file:
            file.write(line + "\n")


def _quiet() -> None:
    """transformers' and the Trainer's notices, a few per case, would drown a crash's last lines."""
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    logging.getLogger("hvdtrain").setLevel(logging.WARNING)


if __name__ == "__main__":
    sys.exit(main())
