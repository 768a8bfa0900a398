"""Hangs, after the fact or while they last: every rank's flight record (its last collectives, step
phases and threads' stacks), and what they say together.

    hvdtrain debug dump runs/my-run      # every rank of the running job writes runs/my-run/flight/rank-NNNNN.json
    hvdtrain debug analyze runs/my-run   # the first collective the ranks disagree on; the slowest rank per phase

A stalled rank (train.stall_timeout) writes its record by itself, and so does a rank sent SIGUSR2
(unless train.preempt_signal is USR2). Neither command needs torch or Horovod: copy the run
directory's flight/ to a laptop and analyze it there.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from hvdtrain.common.flight import analysis
from hvdtrain.common.flight.dumps import POLL_SECONDS, alive_ranks, flight_directory, rank_file, request_dump

HELP = "hangs: dump every rank's flight record (collectives, phases, stacks), and analyze the dumps"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="debug_command", required=True)
    dump = commands.add_parser("dump", help="ask every rank of a running job to write its flight record into RUN_DIR/flight",
                               description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    dump.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="the run's directory (train.run_dir/<run name>)")
    dump.add_argument("--timeout", type=float, default=30.0,
                      help="seconds to wait for every rank's record (default 30; every rank answers within about 4 s)")
    dump.set_defaults(run=dump_records)
    analyze = commands.add_parser("analyze", help="the first collective the ranks disagree on, and the slowest rank "
                                                  "per phase, from RUN_DIR/flight",
                                  description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    analyze.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="the run's directory, or its flight/")
    analyze.add_argument("--json", action="store_true", help="the verdict and findings as JSON")
    analyze.set_defaults(run=analyze_records)


def dump_records(args: argparse.Namespace) -> int:
    run_dir: Path = args.run_dir
    if not run_dir.is_dir():
        print(f"hvdtrain debug dump: no directory {run_dir}: pass the run's directory (train.run_dir/<run name>)",
              file=sys.stderr)
        return 2
    directory = flight_directory(run_dir)
    alive = alive_ranks(directory)
    if not alive:
        print(f"hvdtrain debug dump: no rank of a running job announced itself in {directory}/alive: is the job "
              f"running, with train.flight_recorder > 0?", file=sys.stderr)
        return 1
    token = request_dump(run_dir)
    deadline = time.monotonic() + args.timeout
    answered: set = set()
    while time.monotonic() < deadline and len(answered) < len(alive):
        answered |= {rank for rank in alive if _answers(rank_file(directory, rank), token)}
        time.sleep(min(0.2, POLL_SECONDS))
    for rank in sorted(answered):
        print(rank_file(directory, rank))
    silent = sorted(set(alive) - answered)
    if silent:
        who = "; ".join(f"rank {r} on {alive[r].get('host')} (pid {alive[r].get('pid')})" for r in silent)
        print(f"hvdtrain debug dump: no record in {args.timeout:g} s from {who}: the process may be gone (its "
              f"alive file stays after a kill), or its host sees the run directory late; on its host, "
              f"`kill -USR2 PID` asks it too", file=sys.stderr)
        return 1
    return 0


def _answers(path: Path, token: str) -> bool:
    try:
        return json.loads(path.read_text()).get("request") == token
    except (OSError, ValueError):
        return False


def analyze_records(args: argparse.Namespace) -> int:
    try:
        found = analysis.analyze(analysis.load_dumps(args.run_dir))
    except analysis.DumpError as error:
        print(f"hvdtrain debug analyze: {error}", file=sys.stderr)
        return 2
    if args.json:
        divergence = found.divergence
        print(json.dumps({
            "verdict": found.verdict(),
            "divergence": None if divergence is None else {
                "kind": divergence.kind, "process_set": divergence.process_set, "seq": divergence.seq,
                "expected": divergence.expected, "expected_ranks": divergence.expected_ranks,
                "ranks": sorted(divergence.odd)},
            "stragglers": [s.__dict__ for s in found.stragglers],
        }, indent=1))
    else:
        print("\n".join(found.lines()))
    return 0
