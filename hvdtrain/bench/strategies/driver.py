"""``hvdtrain bench strategies``: samples/s and bytes per rank of ddp, zero1, zero2 and fsdp, side by side.

Every strategy trains the same model on the same synthetic data with the same batch per worker
and one thread per rank, through hvdtrain's Trainer (``throughput_worker --variant trainer``),
each run its own mpirun job. Speed: rounds interleave the strategies with a rotating start
(ddp zero1 zero2 fsdp, then zero1 zero2 fsdp ddp, ...); figures are medians over the rounds with their
spread, and each strategy's ratio to ddp is the ratio of medians in this run and also per round
(paired within a round) with its range. Each step is split into the gradient wait (the
strategy's synchronize: ddp's all-reduce, zero's and fsdp's reduce-scatter), the strategy's step
(the optimizer's update and, for zero, the parameters' all-gather), fsdp's waits for its units'
parameters (gathered in forward and again in backward) and the rest (forward, backward).

Memory is counted, not timed: the Trainer counts the bytes of parameters, gradients and
optimizer state each rank holds after its first step (from the tensors' storages). One short
Adam job per strategy and worker count (``--memory-workers``) fills the memory table, next to
ZeRO's formula for fp32 Adam (Psi parameters, N ranks): ddp 16 Psi, zero1 8 Psi + 8 Psi/N,
zero2 4 Psi + 12 Psi/N, fsdp 16 Psi/N bytes (4 parameters + 4 gradients + 8 Adam's exp_avg and
exp_avg_sq). The Trainer counts between steps, when an fsdp rank holds its shards only; while a
step runs it also holds gathered units (and, in backward, their full gradients): for fsdp the table
also gives the most a rank held during a step, counted, next to 16 Psi/N + the largest unit.

On CPU, communication runs on the cores that compute: overlapping it with backward hides nothing
here, unlike on GPUs, and what zero saves in the optimizer's update (1/N of it per rank) counts.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

from hvdtrain.bench.common import jobs, report, stats
from hvdtrain.bench.throughput import driver as throughput
from hvdtrain.bench.throughput.driver import Job, paired_ratio, ratio_of_medians
from hvdtrain.common.units import MiB, mib
from hvdtrain.distributed.cpu_allocator import MODES as CPU_ALLOCATOR_MODES
from hvdtrain.config.train import FSDP_OVERLAPS
from hvdtrain.launch.hostfile import Host
from hvdtrain.common.tables import format_table
from hvdtrain.observability.figures import new_figure, save_figure

STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")
# samples/s against ddp's, at --workers (2 on this machine): zero2 moves ddp's bytes and steps 1/N of
# the update, fsdp gathers every parameter twice a step besides (issue 35's targets)
TARGETS = {"zero1": 0.95, "zero2": 1.00, "fsdp": 0.95}
FORMULAS = {"ddp": "16 Psi", "zero1": "8 Psi + 8 Psi/N", "zero2": "4 Psi + 12 Psi/N", "fsdp": "16 Psi/N"}
MIN_PARAMETERS = 25_000_000  # the real run's model: large enough that bytes and communication matter
COMPONENTS = ("parameters", "gradients", "optimizer_state")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="mlp (default) or lm, the example transformer language model (both >= 25M "
                                        "parameters), or cnn/many with --quick")
    parser.add_argument("--workers", type=int, default=2, help="workers of the speed comparison (default: 2)")
    parser.add_argument("--memory-workers", default="2,4",
                        help="comma-separated worker counts of the memory table, one Adam job each (default: 2,4)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved repeats of the speed jobs (default: 5)")
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam",
                        help="optimizer of the speed jobs (default: adam; the memory jobs always use Adam)")
    parser.add_argument("--batch", type=int, help="samples per worker per step (default: the model's, 64; lm: 2 "
                                                  "windows of 64 tokens)")
    parser.add_argument("--cpu-allocator", choices=CPU_ALLOCATOR_MODES, default="cache",
                        help="train.cpu_allocator of every job (default: cache)")
    parser.add_argument("--fsdp-overlap", choices=FSDP_OVERLAPS, default="auto",
                        help="train.fsdp_overlap of the fsdp jobs (default: auto, gathers on a CPU)")
    parser.add_argument("--steps", type=int, default=30, help="timed optimizer steps per job (default: 30)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (default: 5)")
    parser.add_argument("--segments", type=int, default=3, help="timed parts per job (default: 3)")
    parser.add_argument("--samples", type=int, default=4096, help="synthetic training set size (default: 4096)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds before one job is killed (default: 600)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is not met")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 1 round, 3 steps after 1, batch 16, the small CNN (plumbing, not speed)")
    parser.add_argument("--out", help="output directory (default: bench-results/strategies-<time>)")


def _settings(args: argparse.Namespace) -> List[int]:
    """Apply --quick, check the options, return the memory worker counts (ValueError if wrong)."""
    if args.quick:
        args.rounds, args.steps, args.warmup, args.segments, args.samples = 1, 3, 1, 1, 512
    args.model = args.model or ("cnn" if args.quick else "mlp")
    from hvdtrain.bench.common import workloads  # torch, only once the options are read

    default_batch = workloads.get(args.model).batch
    if args.batch is None:
        args.batch = min(16, default_batch) if args.quick else default_batch
    counts = [int(n) for n in args.memory_workers.split(",") if n.strip()]
    if not counts:
        raise ValueError("--memory-workers needs at least one worker count")
    if min(args.workers, args.rounds, args.batch, args.steps, args.warmup, args.segments, *counts) < 1:
        raise ValueError("--workers, --memory-workers, --rounds, --batch, --steps, --warmup, --segments must be >= 1")
    params = workloads.parameter_count(workloads.build_model(args.model, 0))[0]
    if not args.quick and params < MIN_PARAMETERS:
        raise ValueError(f"--model {args.model} has {params / 1e6:.1f}M parameters; the real run needs "
                         f">= {MIN_PARAMETERS / 1e6:.0f}M (mlp, lm), or use --quick")
    if args.samples < args.batch * max(args.workers, *counts):
        raise ValueError(f"--samples {args.samples} is less than one global batch")
    args.segments = min(args.segments, args.steps)
    return list(dict.fromkeys(counts))


def plan(args: argparse.Namespace, memory_counts: Sequence[int]):
    trainer = throughput.VARIANTS["trainer"]
    data = ("--variant", "trainer", "--model", args.model, "--batch", str(args.batch), "--samples", str(args.samples),
            "--cpu-allocator", args.cpu_allocator, "--fsdp-overlap", args.fsdp_overlap)
    speed = [Job(f"speed/{s}", s, args.model, trainer, args.workers,
                 (*data, "--strategy", s, "--optimizer", args.optimizer, "--steps", str(args.steps),
                  "--warmup", str(args.warmup), "--segments", str(args.segments)), True) for s in STRATEGIES]
    memory = [Job(f"memory/{s}/{n}", s, args.model, trainer, n,
                  (*data, "--strategy", s, "--optimizer", "adam", "--steps", "1", "--warmup", "1"), False)
              for n in memory_counts for s in STRATEGIES]
    return speed, memory


def measure_memory(memory: List[Job], timeout: float) -> None:
    """One run per job (the counts are exact). More ranks than cores: mpirun is given that many
    slots on this host (-H localhost:N), as ``bench scaling -H localhost:N`` does."""
    for job in memory:
        hosts = [Host("localhost", job.np)] if job.np > (os.cpu_count() or 1) else []
        try:
            result = jobs.run_job(throughput.WORKER, job.args, job.np, "mpirun", timeout,
                                  env={"OMP_NUM_THREADS": "1"}, hosts=hosts)
        except jobs.JobFailed as error:
            job.errors.append(str(error))
            print(f"{job.key}: FAILED ({str(error).splitlines()[0][:200]})", flush=True)
            continue
        result["round"] = 0
        job.runs.append(result)
        print(f"{job.key}: {result['memory_per_rank'][0]['total'] / MiB:.1f} MiB counted on rank 0", flush=True)


def _per_step_ms(run: Dict[str, Any], key: str) -> float:
    values = run.get(key) or [0.0]  # gather_per_rank_s: fsdp's only
    return 1000 * sum(values) / len(values) / run["steps"]


def speed_rows(speed: List[Job]) -> List[Dict[str, Any]]:
    ddp = speed[0]
    rows = []
    for job in speed:
        s, pairs = job.summary(), paired_ratio(job, ddp)
        wall = [1000 * r["elapsed_s"] / r["steps"] for r in job.runs]
        sync = [_per_step_ms(r, "sync_per_rank_s") for r in job.runs]
        stepped = [_per_step_ms(r, "step_per_rank_s") for r in job.runs]
        update = [_per_step_ms(r, "update_per_rank_s") for r in job.runs]
        # zero: the all-gather after the update, inside step(); fsdp: the waits for its units'
        # gathers, inside forward and backward
        gather = [a - b if job.label != "fsdp" else _per_step_ms(r, "gather_per_rank_s")
                  for a, b, r in zip(stepped, update, job.runs)]
        inside_step = [g if job.label != "fsdp" else 0.0 for g in gather]
        rows.append({
            "strategy": job.label, "workers": job.np, "samples_per_sec": s.to_dict() if s else None,
            "ratio_to_ddp": ratio_of_medians(job, ddp), "paired_ratio_to_ddp": pairs.to_dict() if pairs else None,
            "step_ms": stats.median(wall), "gradient_wait_ms": stats.median(sync), "strategy_step_ms": stats.median(stepped),
            "update_ms": stats.median(update), "all_gather_ms": stats.median(gather),
            "exposed_comm_ms": stats.median([w + g for w, g in zip(sync, gather)]),
            "forward_backward_rest_ms": stats.median([t - w - a - (g - i) for t, w, a, g, i
                                                 in zip(wall, sync, stepped, gather, inside_step)]),
            "minor_faults_per_step": stats.median([sum(r["minor_faults_per_rank"]) / r["world_size"] / r["steps"]
                                              for r in job.runs]),
            "system_cpu_ms": stats.median([_per_step_ms(r, "system_cpu_per_rank_s") for r in job.runs]),
            "comm_share": stats.median([r.get("comm_share") for r in job.runs]),
            "cpu_other_cores": stats.median([r.get("cpu_other_cores") for r in job.runs]),
            "peak_rss_mb": max((max(r["peak_rss_mb_per_rank"]) for r in job.runs), default=float("nan")),
            "errors": job.errors})
    return rows


def formula(strategy: str, psi: int, n: int) -> Dict[str, float]:
    """ZeRO's bytes per rank for fp32 Adam (Rajbhandari et al. 2020), by component and in total
    (fsdp: between steps, its shards only)."""
    parts = {"parameters": 4 * psi / (n if strategy == "fsdp" else 1),
             "gradients": 4 * psi / (n if strategy in ("zero2", "fsdp") else 1),
             "optimizer_state": 8 * psi / (1 if strategy == "ddp" else n)}
    return {**parts, "total": sum(parts.values())}


def memory_rows(memory: List[Job]) -> List[Dict[str, Any]]:
    rows = []
    for job in memory:
        if not job.runs:
            rows.append({"strategy": job.label, "workers": job.np, "errors": job.errors})
            continue
        run = job.runs[0]
        per_rank, psi = run["memory_per_rank"], run["parameters"]
        expected = formula(job.label, psi, job.np)
        keys = (*COMPONENTS, "total")
        rows.append({
            "strategy": job.label, "workers": job.np, "parameters_counted": psi,
            "rank0": {k: per_rank[0][k] for k in keys}, "max": {k: max(r[k] for r in per_rank) for k in keys},
            "peak_rss_max": max(r["peak_rss"] for r in per_rank), "formula": expected,
            "counted_over_formula": {k: per_rank[0][k] / expected[k] for k in keys},
            "max_over_formula": max(r["total"] for r in per_rank) / expected["total"], "errors": job.errors})
        if job.label == "fsdp":  # during a step, against 16 Psi/N + the largest unit
            peaks = run["step_peak_per_rank"]
            during = expected["total"] + run["largest_unit_bytes"]
            rows[-1].update({"units": run["fsdp_units"], "largest_unit_bytes": run["largest_unit_bytes"],
                             "step_peak_rank0": peaks[0], "step_peak_max": max(p["total"] for p in peaks),
                             "step_formula": during, "step_peak_over_formula": peaks[0]["total"] / during,
                             "fsdp_overlap": run.get("fsdp_overlap", "")})
    return rows


def verdicts(rows: List[Dict[str, Any]], args) -> List[Dict[str, Any]]:
    by = {row["strategy"]: row for row in rows}
    lines = []
    for name, target in TARGETS.items():
        row, value = by[name], by[name]["ratio_to_ddp"]
        met = value >= target if value == value else None
        line = {"target": f"{name} samples/s vs ddp, {args.model}, {args.workers} workers", "threshold": target,
                "measured": value, "per_round": row["paired_ratio_to_ddp"], "met": met}
        if met is False:
            d = by["ddp"]
            line["why"] = (
                f"{name} takes {row['step_ms'] - d['step_ms']:+.1f} ms per step against ddp's {d['step_ms']:.1f}: "
                f"exposed communication {row['exposed_comm_ms']:.1f} ms (gradient wait {row['gradient_wait_ms']:.1f}"
                f" + all-gather {row['all_gather_ms']:.1f}{' in forward and backward' if name == 'fsdp' else ''}) "
                f"against ddp's {d['exposed_comm_ms']:.1f}; optimizer "
                f"update {row['update_ms']:.1f} against {d['update_ms']:.1f}; forward/backward/rest "
                f"{row['forward_backward_rest_ms']:.1f} against {d['forward_backward_rest_ms']:.1f}; helper-thread "
                f"CPU {row['cpu_other_cores']:.2f} against {d['cpu_other_cores']:.2f} cores per rank; page faults "
                f"{row['minor_faults_per_step']:.0f} against {d['minor_faults_per_step']:.0f} and system CPU "
                f"{row['system_cpu_ms']:.1f} against {d['system_cpu_ms']:.1f} ms per step and rank")
        lines.append(line)
    return lines


def text_report(rows, mem, verdict_lines, args, psi: Optional[int]) -> List[str]:
    """The report's text: the throughput table, each strategy's memory and the verdicts.

    Args:
        rows: one per strategy, from the runs.
        mem: the memory accounting by strategy.
        verdict_lines: the targets' verdicts.
        args: the driver's options (model, optimizer, batch, workers, rounds).
        psi: the model's parameter bytes for the ZeRO formulas (None: unknown).
    """
    def pair(held: Dict[str, Any], key: str) -> str:
        return f"{mib(held['rank0'][key]):.1f} / {mib(held['max'][key]):.1f}"

    ratio_rows = [[r["strategy"], r["samples_per_sec"]["median"] if r["samples_per_sec"] else float("nan"),
                   f"+-{r['samples_per_sec']['spread']:.0%}" if r["samples_per_sec"] else "failed",
                   r["samples_per_sec"]["repeats"] if r["samples_per_sec"] else 0, r["ratio_to_ddp"],
                   *((p["median"], f"{p['min']:.3f}-{p['max']:.3f}") if p else (float("nan"), "-")),
                   r["comm_share"], r["cpu_other_cores"], r["peak_rss_mb"]]
                  for r in rows for p in [r["paired_ratio_to_ddp"]]]
    out = ["", format_table(
        ["strategy", "samples/s", "spread", "n", "/ddp (medians)", "/ddp per round", "per-round range",
         "comm share", "helper CPU", "peak RSS MB"], ratio_rows,
        title=f"{args.model}, {args.optimizer}, cpu_allocator {args.cpu_allocator}, fsdp_overlap {args.fsdp_overlap}: "
              f"global samples/s, batch "
              f"{args.batch}/worker, {args.workers} workers, "
              f"medians of {args.rounds} rounds (ratios: same run; per round = paired within a round)")]
    out += ["", format_table(
        ["strategy", "step", "gradient wait", "strategy.step", "of it update", "all-gather", "exposed comm",
         "fwd/bwd/rest", "system CPU", "page faults"],
        [[r["strategy"], r["step_ms"], r["gradient_wait_ms"], r["strategy_step_ms"], r["update_ms"],
          r["all_gather_ms"], r["exposed_comm_ms"], r["forward_backward_rest_ms"], r["system_cpu_ms"],
          r["minor_faults_per_step"]] for r in rows],
        title="ms per optimizer step (medians over rounds; step = slowest rank, parts = mean over ranks; "
              "all-gather: zero's after the update, fsdp's waits for its units in forward and backward); "
              "minor page faults per step and rank")]
    measured = [m for m in mem if "rank0" in m]
    out += ["", format_table(
        ["strategy", "N", "parameters", "gradients", "optimizer state", "total", "peak RSS (max)", "ZeRO formula",
         "formula MiB", "counted/formula"],
        [[m["strategy"], m["workers"], pair(m, "parameters"), pair(m, "gradients"), pair(m, "optimizer_state"),
          pair(m, "total"), mib(m["peak_rss_max"]), FORMULAS[m["strategy"]],
          mib(m["formula"]["total"]), m["counted_over_formula"]["total"]] for m in measured],
        title=f"MiB held per rank after the first step, fp32 Adam, Psi = {psi or 0:,} parameters: counted from "
              "tensor storages, rank 0 / max over ranks; formula in bytes = the ZeRO column x Psi")]
    during = [m for m in measured if "step_peak_rank0" in m]
    out += ["", format_table(
        ["strategy", "N", "parameters", "gradients", "optimizer state", "total", "max over ranks", "largest unit",
         "16 Psi/N + largest unit", "counted/formula"],
        [[m["strategy"], m["workers"], *(mib(m["step_peak_rank0"][k]) for k in (*COMPONENTS, "total")),
          mib(m["step_peak_max"]), mib(m["largest_unit_bytes"]), mib(m["step_formula"]),
          m["step_peak_over_formula"]] for m in during],
        title=f"fsdp during a step (fsdp_overlap {during[0].get('fsdp_overlap', '')}): the most MiB a rank held "
              "(rank 0, by component at that moment), counted after each unit's gather and before each "
              "reduce-scatter; backward holds a unit's full parameters and its full gradient at once, so "
              "16 Psi/N + 2 units is the least any overlap holds (full: + 4)")] if during else []
    for m in during[:1]:
        units = ", ".join(f"{u['path']} {mib(u['full_bytes']):.1f}" for u in m["units"] if u["full_bytes"])
        out.append(f"fsdp units (MiB at full size; the root unit holds the parameters outside them): {units}")
    out += [f"memory job failed: {m['strategy']} at {m['workers']} workers" for m in mem if "rank0" not in m]
    out.append("")
    for line in verdict_lines:
        p = line["per_round"]
        spread = f" (per round {p['min']:.3f}-{p['max']:.3f})" if p else ""
        status = {True: "MET", False: "NOT MET", None: "NOT MEASURED"}[line["met"]]
        out.append(f"target: {line['target']} >= {line['threshold']:g}: measured {line['measured']:.3f}{spread}"
                   f" -> {status}")
        if "why" in line:
            out.append(f"  why: {line['why']}")
    out += ["notes: one host, 2 shared cores: differences under ~15% are within noise here. Communication runs on",
            "the cores that compute, so overlap hides nothing (unlike GPUs); zero steps the optimizer on 1/N of the",
            "parameters per rank. gradient wait = the strategy's synchronize(); exposed comm = it + the all-gather",
            "(zero's after the update; fsdp's waits for its units' parameters in forward and backward);",
            "helper CPU = cores' worth of CPU per rank in threads other than the training thread; page faults and",
            "system CPU mostly come from first touches of freshly allocated buffers (an out-of-place collective's",
            "output, a gradient buffer made each step). Memory is exact (counted), so one job per row; padding to a",
            "multiple of N and Adam's step scalars exceed the formula."]
    if args.quick:
        out.append("--quick: a smoke run of the plumbing; its figures say nothing about speed.")
    return out


def plot(rows, mem, path) -> None:
    fig, (speed_ax, mem_ax) = new_figure(ncols=2, width=6)
    ok = [r for r in rows if r["samples_per_sec"]]
    medians = [r["samples_per_sec"]["median"] for r in ok]
    errors = [[m - r["samples_per_sec"]["min"] for m, r in zip(medians, ok)],
              [r["samples_per_sec"]["max"] - m for m, r in zip(medians, ok)]]
    bars = speed_ax.bar([r["strategy"] for r in ok], medians, yerr=errors, capsize=4, color="tab:blue", alpha=0.8)
    for bar, r in zip(bars, ok):
        speed_ax.annotate(f"{r['ratio_to_ddp']:.2f}x ddp", (bar.get_x() + bar.get_width() / 2, r["samples_per_sec"]["max"]),
                          ha="center", va="bottom", fontsize=8, xytext=(0, 6), textcoords="offset points")
    speed_ax.set_ylabel("global samples/s (median, min-max)")
    speed_ax.margins(y=0.12)
    speed_ax.set_title(f"speed at {ok[0]['workers'] if ok else '?'} workers")
    measured = [m for m in mem if "rank0" in m]
    labels = [f"{m['strategy']}\nN={m['workers']}" for m in measured]
    bottom = [0.0] * len(measured)
    for key, colour in zip(COMPONENTS, ("tab:blue", "tab:orange", "tab:green")):
        heights = [mib(m["rank0"][key]) for m in measured]
        mem_ax.bar(labels, heights, bottom=bottom, label=key.replace("_", " "), color=colour)
        bottom = [b + h for b, h in zip(bottom, heights)]
    mem_ax.scatter(labels, [mib(m["formula"]["total"]) for m in measured], marker="_", s=400, color="black",
                   label="ZeRO formula", zorder=3)
    during = [(label, m) for label, m in zip(labels, measured) if "step_peak_rank0" in m]
    if during:
        mem_ax.scatter([label for label, _ in during], [mib(m["step_peak_rank0"]["total"]) for _, m in during],
                       marker="o", facecolors="none", edgecolors="tab:red", label="fsdp during a step", zorder=3)
    mem_ax.set_ylabel("MiB per rank (rank 0, counted)")
    mem_ax.set_title("bytes per rank, fp32 Adam")
    mem_ax.legend(fontsize=8)
    save_figure(fig, path)


def run(args: argparse.Namespace) -> int:
    try:
        memory_counts = _settings(args)
    except ValueError as error:
        print(f"hvdtrain bench strategies: {error}", file=sys.stderr)
        return 2
    speed, memory = plan(args, memory_counts)
    out_dir = report.output_dir(args.out, "strategies")
    print(f"{len(speed)} speed jobs x {args.rounds} rounds, interleaved, {args.workers} workers; then "
          f"{len(memory)} memory jobs; model {args.model}; results in {out_dir}", flush=True)
    throughput.measure(speed, args.rounds, args.timeout)
    measure_memory(memory, args.timeout)
    rows, mem = speed_rows(speed), memory_rows(memory)
    verdict_lines = verdicts(rows, args)
    psi = next((m["parameters_counted"] for m in mem if "rank0" in m), None)
    lines = text_report(rows, mem, verdict_lines, args, psi)
    report.print_lines(lines)
    settings = {k: getattr(args, k) for k in ("model", "workers", "memory_workers", "rounds", "optimizer", "batch",
                                              "cpu_allocator", "fsdp_overlap", "steps", "warmup", "segments", "samples", "quick", "strict")}
    report.write_json(out_dir / "results.json", report.finite_or_none({
        "benchmark": "strategies", "settings": settings, "parameters": psi, "speed": rows, "memory": mem,
        "verdicts": verdict_lines,
        "jobs": [{"key": j.key, "strategy": j.label, "workers": j.np, "worker_args": list(j.args), "runs": j.runs,
                  "errors": j.errors, "samples_per_sec": j.summary().to_dict() if j.runs else None}
                 for j in speed + memory]}))
    plot(rows, mem, out_dir / "strategies.png")
    (out_dir / "report.txt").write_text("\n".join(lines) + "\n")
    print(f"wrote {out_dir / 'results.json'}, {out_dir / 'strategies.png'}")
    if any(not job.runs for job in speed + memory):
        print(f"some jobs failed: {', '.join(job.key for job in speed + memory if job.errors)}")
        return 1
    return 1 if args.strict and any(line["met"] is not True for line in verdict_lines) else 0
