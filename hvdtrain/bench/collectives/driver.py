"""``hvdtrain bench collectives``: all-reduce, broadcast and allgather sweeps, nccl-tests style.

Back-ends, interleaved call by call inside each job: raw MPI (mpi4py on numpy), Horovod with MPI
operations, Horovod with Gloo operations, torch.distributed gloo, and a local memory copy (the limit
for moving bytes on one host). Each round runs three jobs, in rotating order:

  mpirun                  raw MPI, Horovod MPI, torch gloo, memcpy
  horovodrun --gloo       Horovod Gloo, torch gloo, memcpy
  mpirun, no Horovod      raw MPI alone

Horovod Gloo needs its own job: Horovod 0.28.1 creates the Gloo context its operations use only
under its Gloo controller, so HOROVOD_CPU_OPERATIONS=gloo under mpirun crashes on the first
collective; and a horovodrun --gloo job has no MPI world to run raw MPI in. Horovod MPI is compared
with raw MPI of the same processes (the target: TARGET_RATIO); Horovod Gloo with raw MPI of the mpirun
jobs of the same rounds. Raw MPI alone shows what Horovod's background thread, which shares the
cores with the raw MPI calls in the first job, costs that baseline.

Figures follow nccl-tests (doc/PERFORMANCE.md): S bytes per rank buffer (allgather: S is the
gathered output), algbw = S / time, busbw = algbw x 2(n-1)/n (all-reduce), (n-1)/n (allgather),
1 (broadcast); times are medians over every repeat of every round, with their spread.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from hvdtrain.bench.common import jobs, report, stats
from hvdtrain.common.units import MiB, binary_label, parse_binary_size
from hvdtrain.common.tables import format_table
from hvdtrain.observability.figures import new_figure, save_figure

WORKER = "hvdtrain.bench.collectives.worker"
OPS = ("allreduce", "broadcast", "allgather")
DEFAULT_SIZES = tuple(4096 * 4 ** k for k in range(8))  # 4K, 16K, ... 64M
TARGET_RATIO, TARGET_FROM = 0.9, MiB  # Horovod-MPI all-reduce vs raw MPI, at >= 1 MiB
BACKENDS = ("mpi", "mpi_alone", "horovod_mpi", "horovod_gloo", "torch_gloo", "memcpy")
LABELS = {"mpi": "raw MPI", "mpi_alone": "raw MPI alone", "horovod_mpi": "Horovod MPI",
          "horovod_gloo": "Horovod Gloo*", "torch_gloo": "torch gloo", "memcpy": "memcpy (limit)"}
BUSBW_FACTOR_TEXT = {"allreduce": "2(n-1)/n", "allgather": "(n-1)/n", "broadcast": "1"}
MEMCPY_CONVENTION = ("memcpy GB/s = size / time, bytes copied per second (each byte read once and written "
                     "once: memory traffic is twice this, STREAM's Copy convention); like busbw it counts "
                     "bytes delivered, so it is the busbw limit on one host")


@dataclass(frozen=True)
class JobKind:
    name: str  # as printed
    mode: str  # the worker's --mode
    launcher: str  # jobs.run_job's launcher


JOB_KINDS = (JobKind("mpirun", "mpi", "mpirun"), JobKind("horovodrun --gloo", "gloo", "horovodrun"),
             JobKind("mpirun, no Horovod", "mpi_alone", "mpirun"))


def busbw_factor(op: str, ranks: int) -> float:
    """nccl-tests' bus bandwidth factor: what each rank's link must carry, relative to algbw."""
    return {"allreduce": 2 * (ranks - 1) / ranks, "allgather": (ranks - 1) / ranks, "broadcast": 1.0}[op]


def parse_size(token: str) -> int:
    size = parse_binary_size(token)
    if not size:
        raise argparse.ArgumentTypeError(
            f"{token!r} is not a size: use bytes with an optional K, M or G suffix (powers of 1024), "
            f"e.g. 4K,1M,64M")
    return size


def parse_sizes(text: str) -> List[int]:
    return sorted({parse_size(token) for token in text.split(",")})


def parse_ops(text: str) -> List[str]:
    ops = [token.strip() for token in text.split(",")]
    for op in ops:
        if op not in OPS:
            raise argparse.ArgumentTypeError(f"{op!r} is not a collective: choose from {','.join(OPS)}")
    return list(dict.fromkeys(ops))


def size_label(size: int) -> str:
    return binary_label(size)


def check_arguments(args: argparse.Namespace) -> None:
    """What argparse cannot check alone; raises ValueError with the fix."""
    if args.np < 2:
        raise ValueError(f"-np must be >= 2, got {args.np}: a collective over one rank moves no data")
    for name, least in (("rounds", 1), ("iters", 1), ("repeats", 1), ("warmup", 0)):
        if getattr(args, name) < least:
            raise ValueError(f"--{name} must be >= {least}, got {getattr(args, name)}")
    step = 4 * args.np  # fp32, and allgather splits the buffer evenly over the ranks
    for size in args.sizes:
        if size % step:
            raise ValueError(f"--sizes: {size_label(size)} ({size} bytes) is not a whole number of fp32 "
                             f"values per rank at -np {args.np}: use a multiple of {step} bytes")


def worker_args(args: argparse.Namespace, kind: JobKind) -> List[str]:
    return ["--mode", kind.mode, "--ops", ",".join(args.ops), "--sizes", ",".join(map(str, args.sizes)),
            "--iters", str(args.iters), "--warmup", str(args.warmup), "--repeats", str(args.repeats)]


def run_rounds(args: argparse.Namespace) -> Dict[str, List[Dict[str, Any]]]:
    """Every round's jobs; the order rotates so slow drift of the machine favours none of them."""
    runs, measurements = [], []
    for round_index in range(args.rounds):
        shift = round_index % len(JOB_KINDS)
        kinds = JOB_KINDS[shift:] + JOB_KINDS[:shift]
        for kind in kinds:
            started = time.monotonic()
            result = jobs.run_job(WORKER, worker_args(args, kind), args.np, kind.launcher, args.timeout)
            seconds = time.monotonic() - started
            print(f"round {round_index + 1}/{args.rounds}: {kind.name} job done in {seconds:.1f} s",
                  flush=True)
            runs.append({"round": round_index, "job": kind.name, "seconds": seconds,
                         **{k: result[k] for k in ("mode", "ranks", "backends", "horovod", "calls")}})
            measurements += [{"round": round_index, "job": kind.name, **row}
                             for row in result["measurements"]]
    return {"runs": runs, "measurements": measurements}


def _summary_us(measurements: Sequence[Dict[str, Any]], **match: Any) -> Optional[stats.Summary]:
    values = [m["seconds"] * 1e6 for m in measurements if all(m[k] == v for k, v in match.items())]
    return stats.summarize(values) if values else None


# What each back-end's "x raw MPI" is measured against (raw MPI runs only in the mpirun jobs).
PAIRING = {"horovod_mpi": "same job", "horovod_gloo": "same rounds, other job",
           "torch_gloo": "same rounds, pooled over both Horovod jobs"}


def summarize(measurements: Sequence[Dict[str, Any]], ops: Sequence[str], sizes: Sequence[int],
              ranks: int) -> List[Dict[str, Any]]:
    """One row per (op, size, backend) that ran: median time and spread, bandwidths, ratios to raw MPI.

    Args:
        measurements: every run's records, one per (op, size, backend).
        ops: the collectives measured, in report order.
        sizes: the message sizes measured, in bytes.
        ranks: the job's rank count, for the bus bandwidth factor.
    """
    rows = []
    for op in ops:
        for size in sizes:
            summaries = {backend: _summary_us(measurements, op=op, size=size, backend=backend)
                         for backend in BACKENDS}
            rows += [_row(op, size, backend, summaries, ranks) for backend in BACKENDS if summaries[backend]]
    return rows


def _row(op: str, size: int, backend: str, summaries: Dict[str, Optional[stats.Summary]],
         ranks: int) -> Dict[str, Any]:
    summary = summaries[backend]
    row = {"op": op, "size": size, "count": size // 4, "backend": backend, "time_us": summary.to_dict(),
           "summary": summary}
    gbps = size / summary.median / 1e3  # bytes per us / 1e3 = GB/s
    if backend == "memcpy":
        return {**row, "copy_GBps": gbps, "read_write_GBps": 2 * gbps}
    row.update(algbw_GBps=gbps, busbw_factor=busbw_factor(op, ranks), busbw_GBps=gbps * busbw_factor(op, ranks))
    # Ratios of times, raw MPI over this back-end: its busbw relative to raw MPI's (> 1 is faster).
    if backend in PAIRING and summaries["mpi"]:
        row.update(vs_raw_mpi=stats.ratio(summaries["mpi"], summary), vs_raw_mpi_pairing=PAIRING[backend])
    if backend != "mpi_alone" and summaries["mpi_alone"]:
        row["vs_raw_mpi_alone"] = stats.ratio(summaries["mpi_alone"], summary)
    return row


def op_table(op: str, rows: Sequence[Dict[str, Any]], ranks: int) -> str:
    nan = float("nan")
    body = [[r["size"], r["count"], LABELS[r["backend"]], r["summary"].median,
             round(100 * r["summary"].spread), r["summary"].repeats, r.get("algbw_GBps", nan),
             r.get("busbw_GBps", r.get("copy_GBps", nan)),  # memcpy's copy rate stands in the busbw column
             r.get("vs_raw_mpi", nan), r.get("vs_raw_mpi_alone", nan)]
            for r in rows if r["op"] == op]
    title = (f"{op}: fp32, {ranks} ranks, busbw = algbw x {BUSBW_FACTOR_TEXT[op]} = "
             f"{busbw_factor(op, ranks):.2f}; time = median of n figures, +-% = half their min-max range")
    headers = ["size(B)", "count", "backend", "time(us)", "+-%", "n", "algbw(GB/s)", "busbw(GB/s)",
               "x raw MPI", "x MPI alone"]
    return format_table(headers, body, title=title)


def target(rows: Sequence[Dict[str, Any]], ranks: int) -> Dict[str, Any]:
    """The target: Horovod-MPI all-reduce at >= TARGET_RATIO x raw MPI (same job) at every size
    >= 1 MiB; the same ratios against raw MPI alone are given beside it."""
    mine = [r for r in rows
            if r["op"] == "allreduce" and r["backend"] == "horovod_mpi" and r["size"] >= TARGET_FROM]
    ratios = {r["size"]: r.get("vs_raw_mpi", float("nan")) for r in mine}
    alone = {r["size"]: r.get("vs_raw_mpi_alone", float("nan")) for r in mine}
    return {"ratio": TARGET_RATIO, "from_bytes": TARGET_FROM, "ranks": ranks,
            "ratios": ratios, "met": _met(ratios),
            "ratios_vs_raw_mpi_alone": alone, "met_vs_raw_mpi_alone": _met(alone)}


def _met(ratios: Dict[int, float]) -> Optional[bool]:
    return all(ratio >= TARGET_RATIO for ratio in ratios.values()) if ratios else None  # NaN never meets it


def verdict_line(goal: Dict[str, Any]) -> str:
    head = f"target: Horovod-MPI all-reduce >= {goal['ratio']:.2f} x raw MPI at every size >= 1 MiB"
    if goal["met"] is None:
        return f"{head}: not evaluated (no all-reduce size >= 1 MiB in this run)"
    caveat = "" if goal["ranks"] == 2 else f"; the target is for 2 workers, this run has {goal['ranks']}"
    return (f"{head}: {_word(goal['met'])} (same job: {_ratios_text(goal['ratios'])}); against raw MPI alone: "
            f"{_word(goal['met_vs_raw_mpi_alone'])} ({_ratios_text(goal['ratios_vs_raw_mpi_alone'])}){caveat}")


def _word(met: Optional[bool]) -> str:
    return {True: "MET", False: "NOT MET", None: "not measured"}[met]


def _ratios_text(ratios: Dict[int, float]) -> str:
    return ", ".join(f"{size_label(size)} {ratio:.2f}" for size, ratio in sorted(ratios.items()))


def notes(runs: Sequence[Dict[str, Any]]) -> List[str]:
    """What the figures are, stated next to them."""
    cycle = next(run["horovod"]["cycle_time_ms"] for run in runs if run["horovod"])
    return [
        "measured: after a warm-up and a barrier, each rank times back-to-back calls of one collective; "
        "a figure is the slowest rank's mean time per call; every back-end is checked for the right "
        "answer first. One thread per rank.",
        "in place: raw MPI (MPI_IN_PLACE), Horovod (allreduce_async_/broadcast_async_), torch gloo; allgather "
        "writes into a preallocated output, except Horovod's (no in-place API: a new output per call).",
        f"Horovod: one blocking call at a time (async + synchronize, no fusion). Each call waits for the "
        f"background thread's next cycle, HOROVOD_CYCLE_TIME = {cycle:g} ms: no Horovod time is below about "
        f"one cycle, so at small sizes the Horovod rows measure the cycle, not the transport.",
        "raw MPI: mpi4py in the same processes as Horovod MPI (the target's baseline); raw MPI alone: a "
        "separate mpirun job without Horovod, whose background thread otherwise competes for the same cores.",
        "* Horovod Gloo runs in its own horovodrun --gloo job (Horovod 0.28.1 crashes with "
        "HOROVOD_CPU_OPERATIONS=gloo under mpirun); its ratio is to raw MPI of the mpirun jobs of the same "
        "rounds. torch gloo ran in both Horovod jobs; its figures pool them.",
        MEMCPY_CONVENTION + "; below ~64 KiB it is bound by Python's per-call cost (~1 us), not memory.",
        "On one host every back-end moves bytes through memory on the same 2 cores that also run the "
        "other ranks' threads; nothing here measures a network.",
    ]


def plot(rows: Sequence[Dict[str, Any]], ops: Sequence[str], path: Path) -> Path:
    fig, axes = new_figure(ncols=len(ops))
    for ax, op in zip(axes, ops):
        for backend in BACKENDS:
            mine = sorted((r for r in rows if r["op"] == op and r["backend"] == backend),
                          key=lambda r: r["size"])
            if not mine:
                continue
            sizes = [r["size"] for r in mine]
            scale = [r.get("busbw_factor", 1.0) * s / 1e3 for r, s in zip(mine, sizes)]  # GB/s from us
            median = [k / r["summary"].median for k, r in zip(scale, mine)]
            if backend == "memcpy":
                ax.plot(sizes, median, "k--", label="memcpy (limit)")
                continue
            line, = ax.plot(sizes, median, marker="o", label=LABELS[backend])
            ax.fill_between(sizes, [k / r["summary"].high for k, r in zip(scale, mine)],  # min-max band
                            [k / r["summary"].low for k, r in zip(scale, mine)], color=line.get_color(),
                            alpha=0.2)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ticks = sorted({r["size"] for r in rows if r["op"] == op})
        ax.set_xticks(ticks, [size_label(s) for s in ticks], rotation=45)
        ax.set_xlabel("size (fp32 buffer)")
        ax.set_ylabel("busbw (GB/s)")
        ax.set_title(f"{op} (busbw = algbw x {BUSBW_FACTOR_TEXT[op]})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    return save_figure(fig, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-np", type=int, default=2, help="ranks per job (default 2)")
    parser.add_argument("--sizes", type=parse_sizes, default=list(DEFAULT_SIZES),
                        help="buffer sizes, e.g. 4K,1M,64M (K/M/G: powers of 1024; default 4K to 64M by x4)")
    parser.add_argument("--ops", type=parse_ops, default=list(OPS), help=f"default {','.join(OPS)}")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the three jobs (default 5)")
    parser.add_argument("--iters", type=int, default=20,
                        help="timed calls per figure up to 1 MiB; above, fewer for about as many bytes, "
                             "at least 3 (default 20)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls before each figure (default 5)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="figures per back-end, op and size in each job, interleaved (default 2)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds each job may take (default 900)")
    parser.add_argument("--out", default=None,
                        help="output directory (default bench-results/collectives-<time>)")


def run(args: argparse.Namespace) -> int:
    try:
        check_arguments(args)
    except ValueError as error:
        print(f"hvdtrain bench collectives: {error}", file=sys.stderr)
        return 2
    out = report.output_dir(args.out, "collectives")
    try:
        collected = run_rounds(args)
    except jobs.JobFailed as error:
        print(f"hvdtrain bench collectives: a job failed: {error}", file=sys.stderr)
        return 1
    except FileNotFoundError as error:  # the launcher itself is missing
        print(f"hvdtrain bench collectives: cannot start a job: {error}; mpirun and horovodrun must be on "
              f"PATH (activate the virtualenv that has Horovod)", file=sys.stderr)
        return 1
    publish(args, collected, out)
    return 0


def publish(args: argparse.Namespace, collected: Dict[str, List[Dict[str, Any]]], out: Path) -> None:
    """Tables, notes and the verdict on stdout; every raw figure and summary as JSON; the plot as PNG."""
    rows = summarize(collected["measurements"], args.ops, args.sizes, args.np)
    goal = target(rows, args.np)
    lines = [""]
    for op in args.ops:
        lines += [op_table(op, rows, args.np), ""]
    lines += notes(collected["runs"]) + ["", verdict_line(goal)]
    report.print_lines(lines)
    settings = {k: getattr(args, k) for k in ("np", "sizes", "ops", "rounds", "iters", "warmup", "repeats")}
    summaries = [{k: v for k, v in r.items() if k != "summary"} for r in rows]
    json_path = report.write_json(out / "results.json", {
        "benchmark": "collectives", "settings": settings, "notes": notes(collected["runs"]), "target": goal,
        "summaries": summaries, **collected})
    png_path = plot(rows, args.ops, out / "collectives.png")
    print(f"wrote {json_path} and {png_path}", flush=True)
