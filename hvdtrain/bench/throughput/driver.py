"""``hvdtrain bench throughput``: training samples/s of hvdtrain against its peers, side by side.

Every variant trains the same model on the same synthetic data with the same batch per worker
and one thread per rank; each is its own job (hvdtrain.bench.throughput.worker). Rounds interleave the
variants (A B C D, then B C D A, ...), so a busy spell on a shared machine hits every variant
alike; figures are medians over the rounds, with their spread, and every comparison is a ratio
of medians from the same run, also given per round (paired within a round) with its range.

Variants: one process; N independent processes (no communication: the ceiling for N workers);
hvdtrain's Trainer; the same Trainer without hvdtrain's Open MPI default (yield when idle);
Horovod's plain example loop with Horovod's defaults and with hvdtrain's; PyTorch DDP (gloo);
single-process ``torch.nn.DataParallel`` over N GPUs at the same global batch (per-worker batch x N),
a baseline to compare with, not a strategy hvdtrain offers: on a machine with fewer GPUs than it
needs it is skipped, its reason in the table and in results.json; optionally Horovod's plain loop
over Gloo (horovodrun --gloo).
Knobs, each a ratio in the same run, on the Trainer: tensor fusion off (many small tensors),
cycle time 5 ms vs 1 ms, fp16 gradient compression, 4 accumulated micro-batches per step; and on
the plain loop with hvdtrain's defaults, the same with Horovod's timeline armed (HOROVOD_TIMELINE=DYNAMIC).

On CPU, communication uses the same cores as compute, so overlapping the all-reduce with
backward cannot hide it as on a GPU: the comm share reported is the exposed wait in
synchronize(), and CPU efficiencies are not what a GPU cluster would show.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from hvdtrain.bench.common import jobs, report, stats
from hvdtrain.common.tables import format_table
from hvdtrain.observability.figures import new_figure, save_figure

WORKER = "hvdtrain.bench.throughput.worker"
MODELS = ("cnn", "mlp")
YIELD = "OMPI_MCA_mpi_yield_when_idle"


def gpu_count() -> int:
    """GPUs this process sees (the jobs of launcher "none" run on this host, with this environment)."""
    import torch

    return torch.cuda.device_count()


def dataparallel_skip_reason(workers: int) -> Optional[str]:
    """Why DataParallel over ``workers`` GPUs cannot run here (None: it can)."""
    gpus = gpu_count()
    if gpus < 2:
        return f"DataParallel needs 2 or more GPUs, this machine has {gpus}"
    if workers < 2:
        return f"DataParallel over {workers} GPU is the one-process run: use --workers 2 or more"
    if gpus < workers:
        return f"DataParallel over {workers} GPUs (--workers {workers}) needs {workers} GPUs, this machine has {gpus}"
    return None


@dataclass(frozen=True)
class Variant:
    key: str
    label: str
    worker_variant: str
    launcher: str = "mpirun"
    args: Tuple[str, ...] = ()
    distributed: bool = True  # stands for N workers (False: one worker)
    one_process: bool = False  # N workers in one process (DataParallel's GPUs): launched once, without mpirun
    # Given the worker count: why this variant cannot run on this machine (None: it can).
    skip_reason: Optional[Callable[[int], Optional[str]]] = None

    def worker_args(self, workers: int) -> Tuple[str, ...]:
        return (*self.args, "--devices", str(workers)) if self.one_process else self.args


VARIANTS: Dict[str, Variant] = {v.key: v for v in (
    Variant("single", "one process", "single", launcher="none", distributed=False),
    Variant("independent", "N independent processes (ceiling)", "independent"),
    Variant("trainer", "hvdtrain Trainer", "trainer"),
    Variant("trainer-noyield", "hvdtrain Trainer, Open MPI busy-polls (yield_when_idle=0)", "trainer",
            args=("--set-env", f"{YIELD}=0")),
    Variant("horovod", "plain Horovod loop, Horovod defaults", "horovod"),
    Variant("horovod-hvdenv", "plain Horovod loop, hvdtrain's env defaults", "horovod",
            args=("--hvdtrain-defaults",)),
    Variant("ddp", "PyTorch DDP (gloo)", "ddp"),
    # A baseline (one process funnelling through GPU 0), not an hvdtrain strategy.
    Variant("dataparallel", "torch.nn.DataParallel, one process over N GPUs", "dataparallel", launcher="none",
            one_process=True, skip_reason=dataparallel_skip_reason),
    Variant("horovod-gloo", "plain Horovod loop over Gloo (horovodrun --gloo)", "horovod",
            launcher="horovodrun"),
)}
DEFAULT_VARIANTS = ("single", "independent", "trainer", "trainer-noyield", "horovod", "horovod-hvdenv", "ddp",
                    "dataparallel")


@dataclass(frozen=True)
class Knob:
    """One setting, compared with the same variant and model without it, in the same run."""

    key: str
    label: str
    model: str
    args: Tuple[str, ...]
    step_divisor: int = 1  # accumulation: fewer optimizer steps, the same micro-batches
    variant: str = "trainer"


def knobs(knob_model: str) -> List[Knob]:
    return [
        Knob("fusion-off", "tensor fusion off (HOROVOD_FUSION_THRESHOLD=0)", "many",
             ("--set-env", "HOROVOD_FUSION_THRESHOLD=0")),
        Knob("cycle-5ms", "cycle time 5 ms (default 1 ms)", knob_model, ("--set-env", "HOROVOD_CYCLE_TIME=5")),
        Knob("fp16", "fp16 gradient compression", knob_model, ("--fp16",)),
        Knob("accumulation-4", "4 micro-batches per step (backward_passes_per_step=4)", knob_model,
             ("--accumulation", "4"), step_divisor=4),
        # What train.timeline_steps needs (Horovod's timeline armed to start mid-run) costs even
        # while nothing is recorded: why hvdtrain arms it only when a timeline is asked for.
        Knob("timeline-armed", "HOROVOD_TIMELINE=DYNAMIC, nothing recorded", knob_model,
             ("--set-env", "HOROVOD_TIMELINE=DYNAMIC"), variant="horovod-hvdenv"),
    ]


@dataclass
class Job:
    """One measured configuration, run once per round."""

    key: str
    label: str
    model: str
    variant: Variant
    np: int  # processes launched
    args: Tuple[str, ...]
    in_table: bool  # a row of its model's table (else only a knob's measurement)
    workers: int = 0  # workers it stands for (DataParallel: N GPUs in one process); 0: np
    skipped: Optional[str] = None  # why it cannot run on this machine: never launched
    runs: List[Dict[str, Any]] = field(default_factory=list)
    errors: List[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.workers = self.workers or self.np

    def rates(self) -> List[float]:
        return [run["samples_per_sec"] for run in self.runs]

    def summary(self) -> Optional[stats.Summary]:
        return stats.summarize(self.rates()) if self.runs else None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated, from cnn, mlp, many (default: {','.join(MODELS)})")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help=f"comma-separated, from {', '.join(VARIANTS)} (default: all but horovod-gloo)")
    parser.add_argument("--workers", type=int, default=2, help="workers of the distributed variants (default: 2)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved repeats of every job (default: 5)")
    parser.add_argument("--batch", type=int, default=64, help="samples per worker per micro-batch (default: 64)")
    parser.add_argument("--steps", type=int, default=30, help="timed optimizer steps per job (default: 30)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (default: 5)")
    parser.add_argument("--segments", type=int, default=3,
                        help="timed parts per job, each after a barrier; the best one is also reported (default: 3)")
    parser.add_argument("--samples", type=int, default=4096, help="synthetic training set size (default: 4096)")
    parser.add_argument("--knob-model", default="mlp", help="model for the cycle/fp16/accumulation knobs (default: mlp)")
    parser.add_argument("--no-knobs", dest="knobs", action="store_false", help="skip the knobs section")
    parser.add_argument("--timeout", type=float, default=600, help="seconds before one job is killed (default: 600)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 1 round, 3 steps after 1, batch 16 (checks the plumbing, not speed)")
    parser.add_argument("--out", help="output directory (default: bench-results/throughput-<time>)")


def _apply_quick(args: argparse.Namespace) -> None:
    if args.quick:
        args.rounds, args.steps, args.warmup, args.segments, args.batch, args.samples = 1, 3, 1, 1, 16, 512


def _split(value: str, allowed: Sequence[str], what: str) -> List[str]:
    items = [item.strip() for item in value.split(",") if item.strip()]
    unknown = [item for item in items if item not in allowed]
    if unknown or not items:
        raise ValueError(f"unknown {what} {', '.join(unknown) or '(none)'}: choose from {', '.join(allowed)}")
    return items


def plan(args: argparse.Namespace) -> Tuple[List[Job], List[Tuple[Knob, Job, Job]]]:
    """The jobs of one round, in the order each round runs them, and the knob comparisons."""
    from hvdtrain.bench.common.workloads import WORKLOADS  # light: no torch work until a model is built

    models = _split(args.models, list(WORKLOADS), "model")
    variants = _split(args.variants, list(VARIANTS), "variant")
    common = ("--batch", str(args.batch), "--samples", str(args.samples))
    jobs_by_key: Dict[str, Job] = {}

    def job(model: str, variant: Variant, extra: Tuple[str, ...] = (), key: str = "", label: str = "",
            divisor: int = 1, in_table: bool = False) -> Job:
        key = key or f"{model}/{variant.key}"
        if key not in jobs_by_key:
            steps = max(1, args.steps // divisor)
            timing = ("--steps", str(steps), "--warmup", str(max(1, args.warmup // divisor)),
                      "--segments", str(min(args.segments, steps)))
            workers = args.workers if variant.distributed else 1
            jobs_by_key[key] = Job(key, label or variant.label, model, variant,
                                   1 if variant.one_process else workers,
                                   ("--variant", variant.worker_variant, "--model", model, *common, *timing,
                                    *variant.worker_args(workers), *extra), in_table, workers=workers,
                                   skipped=variant.skip_reason(workers) if variant.skip_reason else None)
        return jobs_by_key[key]

    for model in models:
        for name in variants:
            job(model, VARIANTS[name], in_table=True)
    comparisons = []
    if args.knobs:
        if args.knob_model not in WORKLOADS:
            raise ValueError(f"unknown knob model {args.knob_model}: choose from {', '.join(WORKLOADS)}")
        for knob in knobs(args.knob_model):
            variant = VARIANTS[knob.variant]
            base = job(knob.model, variant)
            changed = job(knob.model, variant, knob.args, key=f"{knob.model}/{variant.key}/{knob.key}",
                          label=f"{variant.label}, {knob.label}", divisor=knob.step_divisor)
            comparisons.append((knob, base, changed))
    return list(jobs_by_key.values()), comparisons


def measure(all_jobs: List[Job], rounds: int, timeout: float) -> None:
    """Run every job once per round (A B C, then B C A, ...: the start rotates, so a slow drift of
    the machine favours no job); a failed run is kept as an error, not fatal. Skipped jobs never run."""
    all_jobs = [job for job in all_jobs if not job.skipped]
    for round_index in range(rounds if all_jobs else 0):
        shift = round_index % len(all_jobs)
        for job in all_jobs[shift:] + all_jobs[:shift]:
            try:
                result = jobs.run_job(WORKER, job.args, job.np, job.variant.launcher, timeout,
                                      env={"OMP_NUM_THREADS": "1"})
            except jobs.JobFailed as error:
                job.errors.append(str(error))
                print(f"round {round_index + 1}/{rounds} {job.key}: FAILED ({str(error).splitlines()[0][:200]})",
                      flush=True)
                continue
            result["round"] = round_index
            job.runs.append(result)
            print(f"round {round_index + 1}/{rounds} {job.key}: {result['samples_per_sec']:.0f} samples/s",
                  flush=True)


def ratio_of_medians(a: Optional[Job], b: Optional[Job]) -> float:
    if a is None or b is None or not a.runs or not b.runs:
        return float("nan")
    return stats.ratio(a.summary(), b.summary())


def paired_ratio(a: Optional[Job], b: Optional[Job]) -> Optional[stats.Summary]:
    """a/b within each round where both ran: robust to the machine's slow drift between rounds."""
    if a is None or b is None:
        return None
    rates_b = {run["round"]: run["samples_per_sec"] for run in b.runs}
    pairs = [run["samples_per_sec"] / rates_b[run["round"]] for run in a.runs if run["round"] in rates_b]
    return stats.summarize(pairs) if pairs else None


def analyse(all_jobs: List[Job], comparisons, workers: int) -> Dict[str, Any]:
    """Medians, ratios to each peer, efficiencies and knob ratios, as plain data."""
    by_key = {job.key: job for job in all_jobs}
    models = list(dict.fromkeys(job.model for job in all_jobs if job.in_table))
    tables: Dict[str, Any] = {}
    for model in models:
        single = by_key.get(f"{model}/single")
        ceiling = by_key.get(f"{model}/independent")
        rows = []
        for job in all_jobs:
            if job.model != model or not job.in_table:
                continue
            s = job.summary()
            rate = s.median if s else float("nan")
            rows.append({
                "key": job.key, "variant": job.variant.key, "label": job.label, "workers": job.workers,
                "processes": job.np, "skipped": job.skipped,
                "samples_per_sec": s.to_dict() if s else None,
                "vs_ceiling": ratio_of_medians(job, ceiling) if job.workers == workers else float("nan"),
                "efficiency": (rate / (job.workers * single.summary().median)
                               if single is not None and single.runs and s else float("nan")),
                "best_segment": stats.median([run["best_segment_samples_per_sec"] for run in job.runs]),
                "comm_share": stats.median([run.get("comm_share") for run in job.runs]),
                "cpu_other_cores": stats.median([run.get("cpu_other_cores") for run in job.runs]),
                "peak_rss_mb": max((max(run["peak_rss_mb_per_rank"]) for run in job.runs), default=float("nan")),
                "errors": job.errors,
            })
        ratios, paired = {}, {}
        for numerator, denominator in RATIOS:
            a, b = by_key.get(f"{model}/{numerator}"), by_key.get(f"{model}/{denominator}")
            value = ratio_of_medians(a, b)
            if value == value:
                ratios[f"{numerator}/{denominator}"] = value
                pairs = paired_ratio(a, b)
                paired[f"{numerator}/{denominator}"] = pairs.to_dict() if pairs else None
        tables[model] = {"rows": rows, "ratios": ratios, "paired_ratios": paired}
    knob_rows = [{
        "knob": knob.key, "label": knob.label, "model": knob.model, "variant": knob.variant,
        "default": base.summary().to_dict() if base.runs else None,
        "changed": changed.summary().to_dict() if changed.runs else None,
        "ratio": ratio_of_medians(changed, base),
        "comm_share_default": stats.median([run.get("comm_share") for run in base.runs]),
        "comm_share_changed": stats.median([run.get("comm_share") for run in changed.runs]),
    } for knob, base, changed in comparisons]
    return {"models": tables, "knobs": knob_rows}


# (numerator, denominator) variant pairs reported for each model, when both were measured.
RATIOS = (
    ("trainer", "horovod"),          # target >= 0.98: what hvdtrain adds to (or saves over) the plain loop
    ("trainer", "horovod-hvdenv"),   # what the Trainer costs beyond hvdtrain's env defaults
    ("trainer", "ddp"),              # target >= 1.0
    ("trainer", "trainer-noyield"),  # hvdtrain's yield_when_idle default, with and without
    ("horovod-hvdenv", "horovod"),   # the same default on the plain loop
    ("horovod", "ddp"),
    ("horovod-hvdenv", "ddp"),       # Horovod with hvdtrain's env defaults against DDP
    ("horovod-gloo", "ddp"),
    ("horovod-gloo", "horovod"),
    ("trainer", "dataparallel"),     # hvdtrain against one process over the same GPUs, the same global batch
)

TARGETS = (
    # (ratio key, threshold, wording)
    ("trainer/horovod", 0.98, "hvdtrain Trainer vs plain Horovod loop (Horovod's defaults)"),
    ("trainer/horovod-hvdenv", 0.98, "hvdtrain Trainer vs plain Horovod loop (with hvdtrain's env defaults)"),
    ("trainer/ddp", 1.0, "hvdtrain Trainer vs PyTorch DDP (gloo)"),
)


def verdicts(analysis: Dict[str, Any], workers: int) -> List[Dict[str, Any]]:
    lines = []
    for key, threshold, wording in TARGETS:
        for model, table in analysis["models"].items():
            if key not in table["ratios"]:
                continue
            value = table["ratios"][key]
            lines.append({"target": f"{wording}, {model}", "measured": value, "threshold": threshold,
                          "per_round": table["paired_ratios"].get(key), "met": value >= threshold})
    if "cnn" in analysis["models"]:
        trainer = next((row for row in analysis["models"]["cnn"]["rows"] if row["variant"] == "trainer"), None)
        value = trainer["efficiency"] if trainer else float("nan")
        lines.append({"target": f"weak-scaling efficiency, cnn, {workers} workers (Trainer)", "measured": value,
                      "threshold": 0.9, "per_round": None, "met": value >= 0.9 if value == value else None})
    return lines


def text_report(analysis: Dict[str, Any], verdict_lines, args) -> List[str]:
    out: List[str] = []
    for model, table in analysis["models"].items():
        rows, skipped = [], {}
        for index, row in enumerate(table["rows"]):
            s = row["samples_per_sec"]
            if row.get("skipped"):
                skipped[index] = f"skipped: {row['skipped']}"
            rows.append([row["label"], row["workers"], s["median"] if s else float("nan"),
                         f"+-{s['spread']:.0%}" if s else "-" if row.get("skipped") else "failed",
                         s["repeats"] if s else 0, row["best_segment"],
                         row["vs_ceiling"], row["efficiency"], row["comm_share"], row["cpu_other_cores"],
                         row["peak_rss_mb"]])
        out += ["", _span(format_table(
            ["variant", "workers", "samples/s", "spread", "n", "best segment", "/ceiling", "efficiency",
             "comm share", "helper CPU", "peak RSS MB"],
            rows, title=f"{model}: global samples/s, batch {args.batch}/worker, medians of {args.rounds} rounds"),
            skipped, keep=2)]
        ratio_rows = [[k, v, *((p["median"], f"{p['min']:.2f}-{p['max']:.2f}") if p else (float("nan"), "-"))]
                      for k, v in table["ratios"].items() for p in [table["paired_ratios"].get(k)]]
        out += ["", format_table(["ratio", "of medians", "per round: median", "min-max"], ratio_rows,
                                        title=f"{model}: ratios (same run; per round = paired within a round)")]
    if analysis["knobs"]:
        rows = [[k["label"], k["variant"], k["model"], k["default"]["median"] if k["default"] else float("nan"),
                 k["changed"]["median"] if k["changed"] else float("nan"), k["ratio"],
                 k["comm_share_default"], k["comm_share_changed"]] for k in analysis["knobs"]]
        out += ["", format_table(
            ["knob", "variant", "model", "default samples/s", "changed samples/s", "changed/default",
             "comm share default", "comm share changed"], rows,
            title="knobs, each against the same variant without it, in the same run")]
    out += [""]
    for line in verdict_lines:
        status = {True: "MET", False: "NOT MET", None: "NOT MEASURED"}[line["met"]]
        spread = (f" (per round {line['per_round']['min']:.2f}-{line['per_round']['max']:.2f})"
                  if line.get("per_round") else "")
        out.append(f"target: {line['target']} >= {line['threshold']:g}: measured {line['measured']:.3f}{spread}"
                   f" -> {status}")
    out += ["notes: one host with shared cores: differences under ~15% are within noise. Communication runs on",
            "the cores that compute, so overlapping it with backward gains nothing here, unlike on GPUs.",
            "comm share = exposed wait in synchronize(); helper CPU = cores' worth of CPU used per rank by",
            "threads other than the training thread (Horovod's background thread, gloo's) over the timed steps;",
            "best segment = the fastest timed part of a job (the least disturbed by other work on the machine)."]
    if any(row["variant"] == "dataparallel" and row["samples_per_sec"]
           for table in analysis["models"].values() for row in table["rows"]):
        out += ["DataParallel computes on GPUs 0..N-1 at the global batch (batch/worker x N); of the others only",
                "the Trainer uses GPUs (one per rank): compare it with trainer/dataparallel, not with the CPU rows."]
    return out


def _span(table: str, texts: Dict[int, str], keep: int) -> str:
    """The table with row ``i``'s cells after its first ``keep`` columns replaced by ``texts[i]``
    (a skipped variant's reason, across the columns it has no figures for)."""
    lines = table.split("\n")
    first = next(i for i, line in enumerate(lines) if line.startswith("-"))  # under the header
    widths = [len(dashes) for dashes in lines[first].split("  ")]
    start = sum(widths[:keep]) + 2 * keep
    for index, text in texts.items():
        line = lines[first + 1 + index]
        lines[first + 1 + index] = line[:start].ljust(start) + text
    return "\n".join(lines)


def plot(analysis: Dict[str, Any], path) -> None:
    models = list(analysis["models"])
    fig, axes = new_figure(ncols=max(1, len(models)) + (1 if analysis["knobs"] else 0), width=5.5)
    for ax, model in zip(axes, models):
        rows = [r for r in analysis["models"][model]["rows"] if r["samples_per_sec"]]
        names = [r["variant"] for r in rows]
        medians = [r["samples_per_sec"]["median"] for r in rows]
        low = [m - r["samples_per_sec"]["min"] for m, r in zip(medians, rows)]
        high = [r["samples_per_sec"]["max"] - m for m, r in zip(medians, rows)]
        ax.barh(names, medians, xerr=[low, high], color="tab:blue", alpha=0.8)
        ax.invert_yaxis()
        ax.set_xlabel("global samples/s (median, min-max)")
        ax.set_title(f"{model}")
    if analysis["knobs"]:
        ax = axes[-1]
        knob_rows = [k for k in analysis["knobs"] if k["ratio"] == k["ratio"]]
        ax.barh([f"{k['knob']} ({k['model']})" for k in knob_rows], [k["ratio"] for k in knob_rows], color="tab:orange")
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.invert_yaxis()
        ax.set_xlabel("samples/s ratio, changed / default")
        ax.set_title("knobs")
    save_figure(fig, path)


def run(args: argparse.Namespace) -> int:
    _apply_quick(args)
    if min(args.workers, args.rounds, args.batch, args.steps, args.warmup, args.segments) < 1:
        print("hvdtrain bench throughput: --workers, --rounds, --batch, --steps, --warmup and --segments must be >= 1",
              file=sys.stderr)
        return 2
    try:
        all_jobs, comparisons = plan(args)
    except ValueError as error:
        print(f"hvdtrain bench throughput: {error}", file=sys.stderr)
        return 2
    out_dir = report.output_dir(args.out, "throughput")
    print(f"{len(all_jobs)} jobs x {args.rounds} rounds, interleaved; {args.workers} workers; results in {out_dir}",
          flush=True)
    for job in all_jobs:
        if job.skipped:
            print(f"{job.key}: skipped: {job.skipped}", flush=True)
    measure(all_jobs, args.rounds, args.timeout)
    analysis = analyse(all_jobs, comparisons, args.workers)
    verdict_lines = verdicts(analysis, args.workers)
    lines = text_report(analysis, verdict_lines, args)
    report.print_lines(lines)
    settings = {k: getattr(args, k) for k in ("models", "variants", "workers", "rounds", "batch", "steps",
                                              "warmup", "segments", "samples", "knob_model", "knobs", "quick")}
    report.write_json(out_dir / "results.json", report.finite_or_none({
        "benchmark": "throughput", "settings": settings,
        "jobs": [{"key": j.key, "label": j.label, "model": j.model, "variant": j.variant.key, "workers": j.workers,
                  "processes": j.np, "launcher": j.variant.launcher, "worker_args": list(j.args),
                  "skipped": j.skipped, "runs": j.runs, "errors": j.errors,
                  "samples_per_sec": j.summary().to_dict() if j.runs else None} for j in all_jobs],
        **analysis, "verdicts": verdict_lines,
    }))
    plot(analysis, out_dir / "throughput.png")
    (out_dir / "report.txt").write_text("\n".join(lines) + "\n")
    print(f"wrote {out_dir / 'results.json'}, {out_dir / 'throughput.png'}")
    failed = [job.key for job in all_jobs if job.errors]
    if failed:
        print(f"some runs failed: {', '.join(failed)}")
    return 1 if any(not job.runs for job in all_jobs if not job.skipped) else 0
