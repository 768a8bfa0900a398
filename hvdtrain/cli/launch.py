"""``hvdtrain launch``: one command line for every launcher, with a dry run and a time limit.

    hvdtrain launch -np 4 --hostfile hostfiles/two-hosts -- python train.py --epochs 20
    hvdtrain launch --launcher horovodrun -H a:2,b:2 --dry-run -- python train.py

USR1 and USR2 sent to it reach every rank (a preemption's warning: #SBATCH --signal=B:USR1@90);
HUP, INT and TERM stop every process of the job (exit code 128 + the signal).
"""
from __future__ import annotations

import argparse
import shlex
import sys
from typing import List, Optional

from hvdtrain.launch.commands import BUILDERS
from hvdtrain.launch.hostfile import HostfileError
from hvdtrain.launch.runner import build_command, execute

HELP = "start a job with mpirun, mpiexec, horovodrun or srun"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-np", "--num-proc", dest="np", type=int, default=None,
                        help="ranks to start (default: every slot of the hosts, or 1)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--hostfile", help="hostfile in Open MPI (host slots=N), Horovod (host:N) or bare form")
    where.add_argument("-H", "--hosts", help="hosts as a:2,b:2")
    parser.add_argument("--launcher", choices=sorted(BUILDERS), default="mpirun",
                        help="mpirun (Open MPI), mpich (Hydra mpiexec), horovodrun, srun (default: mpirun)")
    parser.add_argument("--network-interface", help="the interface ranks talk over, e.g. eth0 or ib0")
    parser.add_argument("--start-timeout", type=int, default=30,
                        help="seconds to reach every host before the launch fails (default: 30)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="stop the whole job after this many seconds (exit code 124)")
    parser.add_argument("--dry-run", action="store_true", help="print the exact command and exit")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the program and its arguments")


def run(args: argparse.Namespace) -> int:
    try:
        argv, spec = build_command(args)
    except (HostfileError, ValueError) as error:
        print(f"hvdtrain launch: {error}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(shlex.join(argv))
        return 0
    return execute(argv, args.timeout, spec.hosts, launcher=args.launcher, rank_command=spec.command)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="hvdtrain launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))
