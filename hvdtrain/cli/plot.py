"""``hvdtrain plot RUN_DIR``: PNGs of a run's loss, accuracy and throughput, from its metrics.jsonl.

Runs anywhere matplotlib does (no torch or Horovod): copy the run directory to a laptop and plot it.
A resumed run appends to the same file; the later record for a step wins, and each restart is
drawn as a dashed vertical line.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from hvdtrain.observability.plots import MetricsError, load_metrics, plot_accuracy, plot_loss, plot_throughput
from hvdtrain.observability.metric_sinks import METRICS_FILE

HELP = "PNGs of a run's loss, accuracy and throughput"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help=f"a run directory holding {METRICS_FILE}")
    parser.add_argument("--out", metavar="DIR", help="where to write the PNGs (default: RUN_DIR/plots)")


def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        print(f"hvdtrain plot: no directory {run_dir}: pass the run directory the trainer wrote "
              f"(train.run_dir)", file=sys.stderr)
        return 2
    if importlib.util.find_spec("matplotlib") is None:
        print("hvdtrain plot: matplotlib is not installed: pip install matplotlib", file=sys.stderr)
        return 2
    try:
        steps, epochs = load_metrics(run_dir)
    except MetricsError as error:
        print(f"hvdtrain plot: {error}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else run_dir / "plots"
    title = run_dir.resolve().name
    written = [plot_loss(steps, epochs, out, title)]
    accuracy = plot_accuracy(epochs, out, title)
    if accuracy is None:
        print("hvdtrain plot: no validation accuracy in the epoch records (no validation set?): "
              "accuracy.png not written", file=sys.stderr)
    else:
        written.append(accuracy)
    if steps:
        written.append(plot_throughput(steps, out, title))
    else:
        print("hvdtrain plot: no step records: throughput.png not written", file=sys.stderr)
    for path in written:
        print(path)
    return 0
