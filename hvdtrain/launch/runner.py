"""Launching a job: the launcher's command line from the options, and running it with a time limit,
passing on the signals a scheduler sends (preemption's USR1 among them), naming the rank that failed
first. The command is hvdtrain.cli.launch."""
from __future__ import annotations

import argparse
import collections
import os
import signal
import socket
import subprocess
import sys
import threading
from typing import IO, Deque, List, Optional, Sequence, Tuple

from hvdtrain.launch.commands import BUILDERS, LaunchSpec, exports_present
from hvdtrain.launch.failures import first_failed_rank, rank_host
from hvdtrain.launch.hostfile import Host, hosts_from_options, total_slots
from hvdtrain.launch.sessions import descendants_running

GRACE_SECONDS = 10  # between SIGTERM and SIGKILL when a job must be stopped

# What hvdtrain launch passes on to the job instead of dying of it (USR1/USR2's default action would
# kill the launcher alone, leaving mpirun and the ranks running). Each goes to the launcher's process
# group, which holds the launcher but not the ranks (mpirun puts each rank in a group of its own), so
# that every rank gets it once, from its launcher: Open MPI's mpirun forwards USR1 and USR2 to the
# ranks and answers TERM and INT by sending TERM to them (then KILL a second later); srun forwards
# them all. horovodrun forwards neither USR1 nor USR2 (it dies of them; its ranks get TERM): under it
# those go straight to the ranks on this host (execute's rank_command).
FORWARDED = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)


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


def execute(argv: List[str], timeout: Optional[float], hosts: Sequence[Host] = (),
            rank_command: Optional[Sequence[str]] = None) -> int:
    """Run the launcher in its own process group: a timeout stops every rank it started; USR1,
    USR2, TERM and INT sent to this process go on to the job (FORWARDED), which then ends as the
    ranks decide (a preempted run checkpoints and exits): its exit code is returned.

    Args:
        argv: the launcher's command line (build_command).
        timeout: seconds before the whole job is stopped (exit code 124); None: no limit.
        hosts: the hosts of the job, to name the one of a failed rank.
        rank_command: for a launcher that does not forward USR1 and USR2 (horovodrun), the ranks'
            command line: those signals go to the processes running it on this host instead.
    """
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

    def forward(signum, _frame=None) -> None:
        if rank_command is not None and signum in (signal.SIGUSR1, signal.SIGUSR2):
            for pid in descendants_running(process.pid, rank_command):
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:
                    pass
            return
        # INT as TERM: srun takes one INT for a status report, not an order to stop.
        stop(signal.SIGTERM if signum == signal.SIGINT else signum)

    tail: Deque[str] = collections.deque(maxlen=400)
    relay = threading.Thread(target=_relay, args=(process.stderr, sys.stderr, tail), daemon=True)
    relay.start()
    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
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
