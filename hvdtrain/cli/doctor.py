"""``hvdtrain doctor``: check every host before a launch, and say what to fix, in one table.

    hvdtrain doctor --hostfile hostfiles/cluster --checkpoint-dir /shared/ckpt
    hvdtrain doctor                      # inside a SLURM allocation: its hosts

Checks: ssh to every host; one machine per host name (by kernel boot id); the same
Python/torch/Horovod/mpi4py/hvdtrain on every host; a network interface with one name on every
host; slots against cores and GPUs; the checkpoint directory writable and the same directory on
every host, each host's clock against its file times, and the flock it gives (coherent,
node-local or none, from two hosts); a short all-reduce with its bandwidth; scontrol inside
SLURM. Exit 1 when any row fails. Runs on login nodes: no torch import here.

    hvdtrain doctor --gpu                # on a GPU node: the GPU self-test (hvdtrain.bench.gpu)

The self-test runs a rank per visible GPU on this host: NCCL all-reduce bandwidth, each strategy
and a T=2 / P=2 mesh against one process, bf16 and fp16 steps, pinning and CUDA peak memory.
Exit 0 pass, 1 a check failed, 2 bad arguments, 3 no GPU visible here (nothing was tested).
"""
from __future__ import annotations

import argparse
import os
import sys

from hvdtrain.launch.allocation import allocation_hosts
from hvdtrain.launch.doctor import FAIL, diagnose, render
from hvdtrain.launch.hostfile import HostfileError, hosts_from_options

HELP = "check every host before a launch"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--hostfile", help="the hostfile the job will use (any format hvdtrain reads)")
    where.add_argument("-H", "--hosts", help="hosts as a:2,b:2 (default: the SLURM allocation)")
    parser.add_argument("--checkpoint-dir", help="check it is writable, the same directory on every host, "
                                                 "each host's clock against its file times, and the file locks it gives")
    parser.add_argument("--network-interface", help="check this interface exists on every host")
    parser.add_argument("--python", default=sys.executable,
                        help="the Python the job runs on every host (default: this one)")
    parser.add_argument("--no-probe", dest="probe", action="store_false", help="skip the all-reduce probe")
    parser.add_argument("--gpu", action="store_true",
                        help="instead of the hosts' checks, the GPU self-test of this node (exit 3: no GPU visible)")
    parser.add_argument("--link-gbps", type=float,
                        help="--gpu: the GPUs' link bandwidth per direction in GB/s, to compare the all-reduce's "
                             "bus bandwidth with (default: NVIDIA's figure for known SXM GPUs)")


def run(args: argparse.Namespace) -> int:
    if args.link_gbps is not None and (not args.gpu or args.link_gbps <= 0):
        print("hvdtrain doctor: --link-gbps needs --gpu and a positive figure", file=sys.stderr)
        return 2
    if args.gpu:
        if args.hostfile or args.hosts or args.checkpoint_dir or args.network_interface:
            print("hvdtrain doctor: --gpu tests this node alone: run it without --hostfile, -H, "
                  "--checkpoint-dir and --network-interface (then run doctor with them, without --gpu)",
                  file=sys.stderr)
            return 2
        from hvdtrain.bench.gpu import driver  # imports no torch; its worker job does
        return driver.run(args.link_gbps)
    try:
        hosts = hosts_from_options(args.hostfile, args.hosts) or allocation_hosts(os.environ)
    except (HostfileError, ValueError) as error:
        print(f"hvdtrain doctor: {error}", file=sys.stderr)
        return 2
    rows = diagnose(hosts, args.python, args.checkpoint_dir, args.network_interface, args.probe, os.environ)
    print(render(rows), flush=True)
    failed = [row for row in rows if row.status == FAIL]
    if failed:
        print(f"\nhvdtrain doctor: {len(failed)} check(s) failed: "
              + ", ".join(sorted({f'{r.check} ({r.host})' for r in failed})), flush=True)
        return 1
    print(f"\nhvdtrain doctor: all {len(rows)} checks passed on {len(hosts)} host(s)", flush=True)
    return 0
