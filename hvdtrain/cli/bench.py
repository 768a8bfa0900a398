"""``hvdtrain bench <name>``: each benchmark module brings its own options and runner."""
from __future__ import annotations

import argparse
import importlib

# name -> (module, one-line help). The drivers import torch/Horovod only inside their workers,
# so building this parser stays instant.
BENCHMARKS = {
    "collectives": ("hvdtrain.bench.collectives.driver",
                    "all-reduce/broadcast/allgather sweeps: Horovod MPI and Gloo, raw MPI, torch gloo"),
    "throughput": ("hvdtrain.bench.throughput.driver",
                   "training samples/s: one process, hvdtrain, plain Horovod, PyTorch DDP; knobs"),
    "strategies": ("hvdtrain.bench.strategies.driver",
                   "ddp, zero1, zero2 through the Trainer: samples/s and bytes per rank against ZeRO's formula"),
    "scaling": ("hvdtrain.bench.scaling.driver", "the same job at 1..N workers: samples/s, efficiency, communication share"),
    "project": ("hvdtrain.bench.projection.driver", "MODELLED step time and scaling efficiency on large clusters"),
    "model-parallel": ("hvdtrain.bench.model_parallel.driver", "pipeline bubble against (P-1)/(M+P-1), tensor-parallel all-reduce share, parameter bytes per rank against model/(TxP)"),
    "plan": ("hvdtrain.bench.plan.driver", "hvdtrain plan's modelled step times against measured ones, every layout, at N ranks on this host"),
    "ps": ("hvdtrain.bench.ps.driver", "parameter server against ddp: bytes per rank per step, counted, and samples/s"),
    "checkpoint": ("hvdtrain.bench.checkpoint.driver",
                   "the step's stall per checkpoint, synchronous against train.checkpoint_async, full and sharded"),
    "activations": ("hvdtrain.bench.activations.driver",
                    "train.activation_checkpointing: activation bytes kept for backward and step time, against none"),
    "sequence": ("hvdtrain.bench.sequence.driver",
                 "the longest sequence that trains under a memory cap per rank: ddp against sequence_parallel"),
    "packing": ("hvdtrain.bench.packing.driver",
                "real tokens/s of documents packed into rows (hvdtrain.data.packing) against padded batches, on a Llama"),
    "startup": ("hvdtrain.bench.startup.driver",
                "seconds from launch to the first step's end, per phase (imports, Horovod init, set-up, first step), eager and compiled"),
}


HELP = ("benchmarks: collectives, throughput, strategies, scaling, projection, model-parallel, ps, plan, "
        "checkpoint, activations, sequence, packing, startup")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    names = parser.add_subparsers(dest="benchmark", required=True)
    for name, (module_name, help_text) in BENCHMARKS.items():
        module = importlib.import_module(module_name)
        benchmark = names.add_parser(name, help=help_text, description=module.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(benchmark)
        benchmark.set_defaults(run=module.run)
