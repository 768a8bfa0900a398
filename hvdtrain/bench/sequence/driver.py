"""Sequence parallelism's point: the longest sequence that trains under a memory cap per rank.

    hvdtrain bench sequence [--workers 4] [--cap-mib 200] [--lengths-ddp 2048,3072,4096,6144]
                            [--lengths-split 8192,12288,16384,24576] [--out DIR]

One training step of the example transformer (d_model 128, 4 layers, 8 heads, one sequence per
data-parallel worker) per job (hvdtrain.bench.sequence.worker), each rank capped at the same bytes
beyond what it holds before training (RLIMIT_DATA). Each ladder of lengths is climbed until a step
does not fit: ddp (every rank its own whole sequences) and sequence_parallel = workers (the ranks
share each sequence). Printed: the longest length each trained, the first that did not fit, the
ratio of the longest lengths, and per rank at each trained length the activation bytes autograd kept
for backward against the formula: sequence-parallel activations are 1/S of ddp's at the same
length, plus per layer attention's output in the tokens' layout (B x T/S x d_model floats), which
one process keeps in the same storage as attention's own saved output (per token of the sequence,
at each ladder's longest).
"""
from __future__ import annotations

import argparse
import os
from typing import Any, Dict, List, Optional, Sequence

from hvdtrain.bench.common import jobs, report
from hvdtrain.common.tables import format_table
from hvdtrain.launch.hostfile import Host

WORKER = "hvdtrain.bench.sequence.worker"
FLOAT32 = 4
OUT_OF_MEMORY = "ran out of memory"
# glibc returns freed large blocks at once with a fixed mmap threshold (else they count against
# RLIMIT_DATA long after torch freed them); Horovod's fusion buffer capped as in the OOM test.
ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "HOROVOD_FUSION_THRESHOLD": str(16 * 2**20)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=4, help="ranks, and S of the sequence-parallel runs (default: 4)")
    parser.add_argument("--cap-mib", type=float, default=200, help="memory per rank beyond the start (default: 200)")
    parser.add_argument("--lengths-ddp", default="2048,3072,4096,6144", help="ddp's ladder of sequence lengths")
    parser.add_argument("--lengths-split", default="8192,12288,16384,24576",
                        help="sequence parallelism's ladder (multiples of --workers)")
    parser.add_argument("--d-model", type=int, default=128, help="the example transformer's width (default: 128)")
    parser.add_argument("--layers", type=int, default=4, help="its blocks (default: 4)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per job (default: 900)")
    parser.add_argument("--launcher", default="mpirun", choices=jobs.LAUNCHERS)
    parser.add_argument("--out", default=None, help="directory for results.json (default: bench-results/sequence-<time>)")


def climb(sequence: int, lengths: Sequence[int], args: argparse.Namespace) -> Dict[str, Any]:
    """Each length in turn until one does not fit: {trained: {length: per-rank figures}, failed: length or None}."""
    trained: Dict[int, List[Dict[str, int]]] = {}
    failed: Optional[int] = None
    env = {**ENV, "HOROVOD_STALL_CHECK_TIME_SECONDS": "60"}
    cpus = os.cpu_count() or 1
    hosts = [Host("localhost", args.workers)] if args.workers > cpus else []  # slots: more ranks than cores
    for length in lengths:
        try:
            result = jobs.run_job(WORKER, ["--sequence", str(sequence), "--length", str(length), "--cap-mib",
                                           str(args.cap_mib), "--d-model", str(args.d_model), "--layers", str(args.layers)], args.workers, args.launcher, args.timeout, env=env,
                                  hosts=hosts)
        except jobs.JobFailed as error:
            if OUT_OF_MEMORY not in str(error):
                raise
            failed = length
            break
        trained[length] = result["ranks"]
        print(f"  sequence_parallel={sequence}: length {length} trained", flush=True)
    return {"trained": trained, "failed": failed}


def run(args: argparse.Namespace) -> int:
    ladders = {1: [int(n) for n in args.lengths_ddp.split(",")],
               args.workers: [int(n) for n in args.lengths_split.split(",")]}
    results = {size: climb(size, lengths, args) for size, lengths in ladders.items()}
    rows, longest = [], {}
    for size, result in results.items():
        longest[size] = max(result["trained"], default=0)
        for length, ranks in sorted(result["trained"].items()):
            rows.append([f"{'ddp' if size == 1 else f'S={size}'}", length, f"{max(r['activations'] for r in ranks) / 2**20:.1f}",
                         f"{max(r['peak_rss_growth'] for r in ranks) / 2**20:.1f}", "trained"])
        if result["failed"]:
            rows.append([f"{'ddp' if size == 1 else f'S={size}'}", result["failed"], "", "", "out of memory"])
    lines = [f"{args.workers} ranks, each capped at {args.cap_mib:g} MiB beyond its start (RLIMIT_DATA)",
             format_table(["layout", "length", "activations MiB/rank", "peak growth MiB/rank", "step"], rows)]
    split = args.workers
    if longest.get(1) and longest.get(split):
        lines.append(f"longest trained: ddp {longest[1]}, S={split} {longest[split]}: "
                     f"{longest[split] / longest[1]:.2f}x (ddp's first that did not fit: {results[1]['failed']})")
        per_token_ddp = max(r["activations"] for r in results[1]["trained"][longest[1]]) / longest[1]
        per_token_split = max(r["activations"] for r in results[split]["trained"][longest[split]]) / longest[split]
        # 1/S of ddp's, plus per layer attention's output in the tokens' layout (4 bytes x width per
        # token of the part), which ddp keeps in the same storage as attention's own saved output.
        formula = (per_token_ddp + args.layers * args.d_model * FLOAT32) / split
        lines.append(f"activation bytes per rank per token of the sequence: ddp {per_token_ddp:.0f}, S={split} "
                     f"{per_token_split:.0f} = {per_token_split / per_token_ddp:.3f} of ddp's; formula (ddp's + "
                     f"layers x d_model x 4) / S = {formula:.0f} ({per_token_split / formula - 1:+.2%})")
    report.print_lines(lines)
    path = report.write_json(report.output_dir(args.out, "sequence") / "results.json",
                             {"machine": report.machine(), "cap_mib": args.cap_mib, "workers": args.workers,
                              "results": {str(k): v for k, v in results.items()}, "table": lines})
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run(argparse.ArgumentParser().parse_args()))
