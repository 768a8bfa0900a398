"""Launching a job: the launcher's command line from the options, and running it with a time limit,
naming the rank that failed first. The command is hvdtrain.cli.launch."""
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

GRACE_SECONDS = 10  # between SIGTERM and SIGKILL when a job must be stopped


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
