"""``hvdtrain hosts``: the SLURM allocation's hosts, in the form a launcher takes (-H, a hostfile)."""
from __future__ import annotations

import argparse
import os
import sys

from hvdtrain.launch.allocation import allocation_hosts
from hvdtrain.launch.hostfile import HostfileError, to_colon_lines, to_host_list, to_openmpi, total_slots

HELP = "the SLURM allocation's hosts, for -H or a hostfile"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--format", choices=["list", "openmpi", "colon", "np"], default="list",
                        help="list: a:2,b:2 (for -H); openmpi: 'a slots=2' lines; colon: 'a:2' lines; "
                             "np: the total number of slots")


def run(args: argparse.Namespace) -> int:
    try:
        hosts = allocation_hosts(os.environ)
    except (HostfileError, ValueError) as error:
        print(f"hvdtrain hosts: {error}", file=sys.stderr)
        return 2
    writers = {"list": lambda h: to_host_list(h) + "\n", "openmpi": to_openmpi, "colon": to_colon_lines,
               "np": lambda h: f"{total_slots(h)}\n"}
    sys.stdout.write(writers[args.format](hosts))
    return 0
