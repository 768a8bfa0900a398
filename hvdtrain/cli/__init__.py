"""The ``hvdtrain`` command. Subcommands import what they need, so ``--help`` stays instant."""
from __future__ import annotations

import argparse
import os
import platform
import sys
from typing import List, Optional

from hvdtrain.cli import checkpoint as consolidate_command
from hvdtrain.cli import export as export_command
from hvdtrain.cli import plan as plan_command
from hvdtrain.observability import plots as plot_command
from hvdtrain.cli.bench import add_bench_parser
from hvdtrain.launch import doctor as launch_doctor
from hvdtrain.launch import runner as launch_runner


def _info(_: argparse.Namespace) -> int:
    """What this install can do: versions and the collective back-ends Horovod was built with."""
    import torch
    import horovod
    import horovod.torch as hvd

    import hvdtrain

    rows = [
        ("hvdtrain", hvdtrain.__version__),
        ("python", platform.python_version()),
        ("torch", torch.__version__),
        ("horovod", horovod.__version__),
        ("horovod MPI", "yes" if hvd.mpi_built() else "no"),
        ("horovod Gloo", "yes" if hvd.gloo_built() else "no"),
        ("horovod NCCL", "yes" if hvd.nccl_built() else "no"),
        ("CUDA devices", str(torch.cuda.device_count())),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0


def _hosts(args: argparse.Namespace) -> int:
    """The SLURM allocation's hosts, in the form a launcher takes."""
    from hvdtrain.launch.allocation import allocation_hosts
    from hvdtrain.launch.hostfile import (HostfileError, to_colon_lines, to_host_list, to_openmpi,
                                          total_slots)

    try:
        hosts = allocation_hosts(os.environ)
    except (HostfileError, ValueError) as error:
        print(f"hvdtrain hosts: {error}", file=sys.stderr)
        return 2
    writers = {"list": lambda h: to_host_list(h) + "\n", "openmpi": to_openmpi, "colon": to_colon_lines,
               "np": lambda h: f"{total_slots(h)}\n"}
    sys.stdout.write(writers[args.format](hosts))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hvdtrain", description="Data-parallel PyTorch training on Horovod.")
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="versions and the back-ends Horovod was built with")
    info.set_defaults(run=_info)
    launch = commands.add_parser("launch", help="start a job with mpirun, mpiexec, horovodrun or srun",
                                 description=launch_runner.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    launch_runner.add_arguments(launch)
    launch.set_defaults(run=launch_runner.run)
    doctor = commands.add_parser("doctor", help="check every host before a launch",
                                 description=launch_doctor.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    launch_doctor.add_arguments(doctor)
    doctor.set_defaults(run=launch_doctor.run)
    hosts = commands.add_parser("hosts", help="the SLURM allocation's hosts, for -H or a hostfile")
    hosts.add_argument("--format", choices=["list", "openmpi", "colon", "np"], default="list",
                       help="list: a:2,b:2 (for -H); openmpi: 'a slots=2' lines; colon: 'a:2' lines; "
                            "np: the total number of slots")
    hosts.set_defaults(run=_hosts)
    plot = commands.add_parser("plot", help="PNGs of a run's loss, accuracy and throughput",
                               description=plot_command.__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    plot_command.add_arguments(plot)
    plot.set_defaults(run=plot_command.run)
    checkpoint = commands.add_parser("checkpoint", help="checkpoints: consolidate a sharded one into a full one")
    checkpoint_commands = checkpoint.add_subparsers(dest="checkpoint_command", required=True)
    consolidate = checkpoint_commands.add_parser(
        "consolidate", help="a sharded checkpoint as one full file, which any strategy and worker count resumes",
        description=consolidate_command.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    consolidate_command.add_arguments(consolidate)
    consolidate.set_defaults(run=consolidate_command.run)
    export = commands.add_parser(
        "export", help="a checkpoint's model as model.safetensors + config.yaml, loadable without hvdtrain",
        description=export_command.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    export_command.add_arguments(export)
    export.set_defaults(run=export_command.run)
    plan = commands.add_parser(
        "plan", help="which strategy and mesh fit this model on this cluster, and the fastest (modelled)",
        description=plan_command.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    plan_command.add_arguments(plan)
    plan.set_defaults(run=plan_command.run)
    add_bench_parser(commands)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)

