"""``hvdtrain bench scaling``: the same training job at 1..N workers (weak scaling).

N is the slots of ``--hostfile``/``-H``, else the SLURM allocation this shell runs in, else this
host's cores. Each worker count runs hvdtrain's Trainer (``throughput_worker``) with the same
batch per worker; rounds interleave the counts. Reported per count: global samples/s (median and
spread), the efficiency E(N) = samples/s at N / (N x samples/s at 1), and the share of a step
spent waiting in the optimizer's synchronize() (communication that backward did not hide).
Writes results.json, scaling.png and report.txt.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

from hvdtrain.bench.common import jobs, report, stats
from hvdtrain.launch.allocation import allocation_hosts
from hvdtrain.launch.hostfile import Host, HostfileError, hosts_from_options, to_host_list, total_slots
from hvdtrain.common.tables import format_table
from hvdtrain.observability.figures import new_figure, save_figure

WORKER = "hvdtrain.bench.throughput.worker"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hostfile", help="hosts and slots (Open MPI or host:N lines); N = their slots")
    parser.add_argument("-H", "--hosts", dest="host_list", help="host:N,host:N; N = their slots")
    parser.add_argument("--max-workers", type=int, help="stop at this many workers (default: every slot)")
    parser.add_argument("--model", default="cnn", help="cnn, mlp or many (default: cnn)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved repeats of every count (default: 3)")
    parser.add_argument("--batch", type=int, default=64, help="samples per worker (default: 64)")
    parser.add_argument("--steps", type=int, default=30, help="timed optimizer steps (default: 30)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (default: 5)")
    parser.add_argument("--samples", type=int, default=4096, help="synthetic training set size (default: 4096)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds before one job is killed (default: 600)")
    parser.add_argument("--out", help="output directory (default: bench-results/scaling-<time>)")


def resolve_hosts(hostfile: Optional[str], host_list: Optional[str], environ=os.environ) -> List[Host]:
    """--hostfile/-H, else the SLURM allocation, else none (this host: ``local_slots``)."""
    hosts = hosts_from_options(hostfile, host_list)
    if hosts is not None:
        return hosts
    if environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST"):
        return allocation_hosts(environ)
    return []


def local_slots() -> int:
    """The cores this process may run on (a cpuset or taskset may allow fewer than the host has)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def worker_counts(maximum: int) -> List[int]:
    """1..N one by one up to 8, then powers of two, always ending at N."""
    if maximum < 1:
        raise ValueError(f"need at least one worker, got {maximum}")
    counts = list(range(1, min(maximum, 8) + 1))
    power = 16
    while power < maximum:
        counts.append(power)
        power *= 2
    if counts[-1] != maximum:
        counts.append(maximum)
    return counts


def analyse(counts: Sequence[int], runs: Dict[int, List[Dict[str, Any]]]) -> List[Dict[str, Any]]:
    base = stats.summarize([r["samples_per_sec"] for r in runs[1]]).median if runs.get(1) else float("nan")
    rows = []
    for count in counts:
        if not runs.get(count):
            rows.append({"workers": count, "samples_per_sec": None, "efficiency": float("nan"),
                         "comm_share": float("nan"), "peak_rss_mb": float("nan")})
            continue
        summary = stats.summarize([r["samples_per_sec"] for r in runs[count]])
        shares = [r["comm_share"] for r in runs[count] if r.get("comm_share") is not None]
        rows.append({
            "workers": count,
            "samples_per_sec": summary.to_dict(),
            "efficiency": summary.median / (count * base),
            "comm_share": stats.summarize(shares).median if shares else float("nan"),
            "peak_rss_mb": max(max(r["peak_rss_mb_per_rank"]) for r in runs[count]),
        })
    return rows


def plot(rows: List[Dict[str, Any]], path, model: str) -> None:
    measured = [r for r in rows if r["samples_per_sec"]]
    fig, (rate_ax, eff_ax, comm_ax) = new_figure(ncols=3, width=4.5)
    workers = [r["workers"] for r in measured]
    medians = [r["samples_per_sec"]["median"] for r in measured]
    rate_ax.errorbar(workers, medians, marker="o", capsize=3,
                     yerr=[[m - r["samples_per_sec"]["min"] for m, r in zip(medians, measured)],
                           [r["samples_per_sec"]["max"] - m for m, r in zip(medians, measured)]], label="measured")
    one = next((r for r in measured if r["workers"] == 1), None)
    if one:
        rate_ax.plot(workers, [w * one["samples_per_sec"]["median"] for w in workers], "k--", linewidth=0.8,
                     label="linear (N x 1 worker)")
    rate_ax.set(xlabel="workers", ylabel="global samples/s", title=f"{model}: throughput")
    rate_ax.legend()
    eff_ax.plot(workers, [r["efficiency"] for r in measured], marker="o")
    eff_ax.axhline(0.9, color="grey", linestyle=":", linewidth=0.8)
    eff_ax.set(xlabel="workers", ylabel="efficiency", title="E(N) = X_N / (N X_1)", ylim=(0, 1.1))
    comm_ax.plot(workers, [r["comm_share"] for r in measured], marker="o", color="tab:red")
    comm_ax.set(xlabel="workers", ylabel="share of step time", title="waiting in synchronize()", ylim=(0, 1))
    for ax in (rate_ax, eff_ax, comm_ax):
        ax.set_xticks(workers)
    save_figure(fig, path)


def run(args: argparse.Namespace) -> int:
    try:
        hosts = resolve_hosts(args.hostfile, args.host_list)
    except (HostfileError, ValueError) as error:
        print(f"hvdtrain bench scaling: {error}", file=sys.stderr)
        return 2
    from hvdtrain.bench.common.workloads import WORKLOADS

    if args.model not in WORKLOADS:
        print(f"hvdtrain bench scaling: unknown model {args.model!r}: choose one of {', '.join(WORKLOADS)}",
              file=sys.stderr)
        return 2
    slots = total_slots(hosts) if hosts else local_slots()
    maximum = min(slots, args.max_workers) if args.max_workers else slots
    if min(maximum, args.rounds, args.batch, args.steps, args.warmup) < 1:
        print("hvdtrain bench scaling: --max-workers, --rounds, --batch, --steps and --warmup must be >= 1",
              file=sys.stderr)
        return 2
    counts = worker_counts(maximum)
    where = to_host_list(hosts) if hosts else f"this host ({slots} cores)"
    out_dir = report.output_dir(args.out, "scaling")
    print(f"scaling {args.model} over {', '.join(map(str, counts))} workers on {where}, {args.rounds} rounds",
          flush=True)
    worker_args = ["--variant", "trainer", "--model", args.model, "--batch", str(args.batch),
                   "--steps", str(args.steps), "--warmup", str(args.warmup), "--samples", str(args.samples)]
    runs: Dict[int, List[Dict[str, Any]]] = {count: [] for count in counts}
    errors: Dict[int, List[str]] = {count: [] for count in counts}
    for round_index in range(args.rounds):
        shift = round_index % len(counts)  # rotate the start: slow drift of the machine favours no count
        for count in counts[shift:] + counts[:shift]:
            try:
                result = jobs.run_job(WORKER, worker_args, count, "mpirun", args.timeout,
                                      env={"OMP_NUM_THREADS": "1"}, hosts=hosts)
            except jobs.JobFailed as error:
                errors[count].append(str(error))
                print(f"round {round_index + 1}/{args.rounds} {count} workers: FAILED "
                      f"({str(error).splitlines()[0][:200]})", flush=True)
                continue
            runs[count].append(result)
            print(f"round {round_index + 1}/{args.rounds} {count} workers: {result['samples_per_sec']:.0f} samples/s",
                  flush=True)
    rows = analyse(counts, runs)
    table = format_table(
        ["workers", "samples/s", "spread", "n", "efficiency", "comm share", "peak RSS MB"],
        [[r["workers"], r["samples_per_sec"]["median"] if r["samples_per_sec"] else float("nan"),
          f"+-{r['samples_per_sec']['spread']:.0%}" if r["samples_per_sec"] else "failed",
          r["samples_per_sec"]["repeats"] if r["samples_per_sec"] else 0,
          r["efficiency"], r["comm_share"], r["peak_rss_mb"]] for r in rows],
        title=f"{args.model}, hvdtrain Trainer, batch {args.batch}/worker, medians of {args.rounds} rounds "
              f"(efficiency = X_N / (N x X_1); comm share = wait in synchronize())")
    report.print_lines(["", table])
    settings = {"model": args.model, "rounds": args.rounds, "batch": args.batch, "steps": args.steps,
                "warmup": args.warmup, "samples": args.samples, "hosts": to_host_list(hosts) if hosts else None,
                "slots": slots}
    report.write_json(out_dir / "results.json", {
        "benchmark": "scaling", "settings": settings, "rows": [_finite(r) for r in rows],
        "runs": {str(c): runs[c] for c in counts}, "errors": {str(c): errors[c] for c in counts},
    })
    plot(rows, out_dir / "scaling.png", args.model)
    (out_dir / "report.txt").write_text(table + "\n")
    print(f"wrote {out_dir / 'results.json'}, {out_dir / 'scaling.png'}")
    return 0 if all(runs[c] for c in counts) else 1


def _finite(row: Dict[str, Any]) -> Dict[str, Any]:
    return {k: (None if isinstance(v, float) and v != v else v) for k, v in row.items()}
