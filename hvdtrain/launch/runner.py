"""``hvdtrain launch``: one command line for every launcher, with a dry run and a time limit.

    hvdtrain launch -np 4 --hostfile hostfiles/two-hosts -- python train.py --epochs 20
    hvdtrain launch --launcher horovodrun -H a:2,b:2 --dry-run -- python train.py
"""
from __future__ import annotations

import argparse
import collections
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
from typing import IO, Deque, List, Optional, Sequence, Tuple

from hvdtrain.launch.commands import BUILDERS, LaunchSpec, exports_present
from hvdtrain.launch.failures import first_failed_rank, rank_host
from hvdtrain.launch.hostfile import Host, HostfileError, hosts_from_options, total_slots

GRACE_SECONDS = 10  # between SIGTERM and SIGKILL when a job must be stopped


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


def build_command(args: argparse.Namespace, environ=os.environ) -> Tuple[List[str], LaunchSpec]:
    hosts = hosts_from_options(args.hostfile, args.hosts) or []
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    spec = LaunchSpec(
        np=args.np or total_slots(hosts) or 1,
        command=command,
        hosts=hosts,
        network_interface=args.network_interface,
        exports=exports_present(environ),
        as_root=hasattr(os, "geteuid") and os.geteuid() == 0,
        start_timeout=args.start_timeout,
    )
    return BUILDERS[args.launcher](spec), spec


def _relay(stream: IO[str], sink: IO[str], keep: Deque[str]) -> None:
    """Copy the launcher's stderr through, keeping its tail to find the failed rank in."""
    for line in stream:
        sink.write(line)
        sink.flush()
        keep.append(line)


def execute(argv: List[str], timeout: Optional[float], hosts: Sequence[Host] = ()) -> int:
    """Run the launcher in its own process group: a timeout or Ctrl-C stops every rank it started."""
    try:
        process = subprocess.Popen(argv, start_new_session=True, stderr=subprocess.PIPE, text=True)
    except FileNotFoundError:
        print(f"hvdtrain launch: {argv[0]} not found on PATH: install it or choose another --launcher",
              file=sys.stderr)
        return 127

    def stop(signum=signal.SIGTERM, _frame=None) -> None:
        try:
            os.killpg(process.pid, signum)
        except ProcessLookupError:
            pass

    tail: Deque[str] = collections.deque(maxlen=400)
    relay = threading.Thread(target=_relay, args=(process.stderr, sys.stderr, tail), daemon=True)
    relay.start()
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            print(f"hvdtrain launch: the job ran past --timeout {timeout:g} s; stopping every rank",
                  file=sys.stderr, flush=True)
            stop()
            try:
                process.wait(timeout=GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                stop(signal.SIGKILL)
                process.wait()
            return 124
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    relay.join(timeout=GRACE_SECONDS)
    if code != 0:
        failed = first_failed_rank("".join(tail))
        culprit = "the launcher's messages above say more"
        if failed is not None:
            rank, host = failed
            culprit = f"rank {rank} on {host or rank_host(rank, hosts, socket.gethostname())} failed first"
        print(f"hvdtrain launch: the job failed with exit code {code}: {culprit}", file=sys.stderr, flush=True)
    return code


def run(args: argparse.Namespace) -> int:
    try:
        argv, spec = build_command(args)
    except (HostfileError, ValueError) as error:
        print(f"hvdtrain launch: {error}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(shlex.join(argv))
        return 0
    return execute(argv, args.timeout, spec.hosts)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="hvdtrain launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))
