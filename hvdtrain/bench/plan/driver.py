"""``hvdtrain bench plan``: hvdtrain plan's MODELLED step times against MEASURED ones, every layout.

For the example transformer (TinyTransformerLM, float32, Adam, a fixed global batch) at --workers
ranks on this host, plan's time model is first calibrated to the machine, then every layout plan
lists (strategy ddp/zero1/zero2/fsdp/ps, tensor T, pipeline P) is run through the Trainer and timed.

Calibration, measured in this run (hvdtrain.bench.plan.worker does the measuring):
  * device rate: plan's own FLOP estimate of a step (6 x parameters x tokens) over the measured
    seconds of a plain step's forward and backward (the step less its Adam update) of the same
    model, one thread; update bandwidth: the bytes Adam streams (28 per parameter) over the
    update's measured seconds. Twice: one process alone on the machine (global batch), and every
    rank at once (a ddp rank's batch, no communication): with more ranks than cores each rank gets
    a share of a core, which plan cannot know unless its rates say so.
  * network: in-place Horovod all-reduces of a few sizes over all ranks, the slowest rank's time
    after a barrier, medians; least squares t = a + b S, then plan's ring terms read backwards:
    bandwidth 2(p-1)/p / b, per-step latency (a - 8.4 us) / 2(p-1). Horovod's cycle time (~1 ms)
    lands in the latency, where it belongs: every exposed collective pays it.
Predictions: plan's step time with (A) the one-process rate, (B) the rate under load — the headline —
and (C) the rate under load with overlap 0 (on CPU, communication runs on the cores that compute and
hides nothing; plan's 0.70 is calibrated on GPUs). Measured: median over rounds and segments of the
slowest rank's seconds per step. The verdict: is plan's recommendation (B) among the two fastest
measured layouts. Everything runs on one host: ranks beyond the core count share cores.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import asdict, dataclass, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

from hvdtrain.bench.common import jobs, lm_workload, report
from hvdtrain.bench.common.stats import summarize
from hvdtrain.launch.hostfile import Host
from hvdtrain.common.tables import format_table
from hvdtrain.observability.figures import new_figure, save_figure

WORKER = "hvdtrain.bench.plan.worker"
NCCL_BASE_S = 8.4e-6  # plan's ring latency on one node: base + 2(p-1) alpha (bench project)
NOISE = 0.15  # differences under ~15% are within noise on this machine (shared/reference/performance.md)
VARIANTS = {"A": "1-proc rate", "B": "rate under load", "C": "under load, overlap 0"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=4, help="ranks (default 4; on 2 cores they share them)")
    lm_workload.add_model_arguments(parser, d_model=128, layers=2)
    parser.add_argument("--batch", type=int, default=16, help="global batch, samples per step (default 16)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds over the layouts (default 5)")
    parser.add_argument("--steps", type=int, default=10, help="steps per timed segment (default 10)")
    parser.add_argument("--segments", type=int, default=2, help="timed segments per layout per round (default 2)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per layout per round (default 2)")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds before a job is killed")
    parser.add_argument("--out", help="output directory (default bench-results/plan-<time>)")


# ---- calibration arithmetic ------------------------------------------------------------------------

def step_flops(parameters: float, batch: float, seq_len: int) -> float:
    """plan's compute estimate of one step: 6 x parameters x tokens."""
    return 6.0 * parameters * batch * seq_len


def device_rate(parameters: float, batch: float, seq_len: int, seconds: float) -> float:
    """The device's rate in FLOP/s: one step's FLOPs over its seconds.

    Args:
        parameters: the model's parameter count.
        batch: samples per step.
        seq_len: tokens per sample.
        seconds: the step's measured time.
    """
    return step_flops(parameters, batch, seq_len) / seconds


@dataclass(frozen=True)
class LinkFit:
    bandwidth: float   # bytes/s, as plan's ring bandwidth term reads it
    alpha_s: float     # one ring step's latency, as plan's one-node ring latency reads it
    intercept_s: float
    slope_s_per_byte: float


def fit_link(sizes: Sequence[float], seconds: Sequence[float], workers: int) -> LinkFit:
    """Least squares t = a + b S, read as plan's ring: b = 2(p-1)/p / B, a = 8.4 us + 2(p-1) alpha."""
    if len(sizes) < 2 or len(sizes) != len(seconds) or workers < 2:
        raise ValueError("need two sizes or more, one time each, and two workers or more")
    mean_s, mean_t = statistics.fmean(sizes), statistics.fmean(seconds)
    var = sum((s - mean_s) ** 2 for s in sizes)
    slope = sum((s - mean_s) * (t - mean_t) for s, t in zip(sizes, seconds)) / var
    slope = max(slope, 1e-15)  # a flat (or noisy, falling) line: bandwidth as good as unlimited
    intercept = mean_t - slope * mean_s
    bandwidth = 2 * (workers - 1) / workers / slope
    alpha = max(0.0, (intercept - NCCL_BASE_S) / (2 * (workers - 1)))
    return LinkFit(bandwidth, alpha, intercept, slope)


def measured_network(fit: LinkFit):
    from hvdtrain.planner.network import Network

    return Network("measured", fit.bandwidth * 8 / 1e9, fit.alpha_s * 1e6, "pcie", 1.0,
                   "this host: fitted to timed Horovod all-reduces")


# ---- predictions, measurements, verdict ------------------------------------------------------------

def layout_key(layout) -> str:
    """plan's Layout -> the worker's strategy/T/P/M."""
    return f"{layout.strategy}/{layout.tensor}/{layout.pipeline}/{layout.micro_batches}"


def predictions(shape, args, rates: Dict[str, float], link,
                update_bandwidths: Optional[Dict[str, float]] = None) -> Dict[str, Any]:
    """Variant -> planner.Plan (memory unlimited: every layout 'fits').

    Args:
        shape: the model's shape.
        args: the driver's options.
        rates: device FLOP/s, one_process and under_load, as ``calibrate`` measured them.
        link: the fitted link (LinkFit).
        update_bandwidths: the optimizer update's bytes/s, keyed like ``rates`` (None: plan's assumed one).
    """
    from hvdtrain import planner
    from hvdtrain.planner.network import CALIBRATION

    updates = update_bandwidths or {key: planner.DEFAULT_UPDATE_BANDWIDTH for key in ("one_process", "under_load")}
    out = {}
    for variant, measured, overlap in (("A", "one_process", CALIBRATION.overlap),
                                       ("B", "under_load", CALIBRATION.overlap),
                                       ("C", "under_load", 0.0)):
        setup = planner.Setup(shape, args.batch, 2.0 ** 50, args.workers, flops=rates[measured], link=link,
                           calibration=replace(CALIBRATION, overlap=overlap), update_bandwidth=updates[measured])
        plan = planner.make_plan(setup)
        # Sequence-parallel layouts are planned but not measured by this bench (its worker runs T x P x D).
        out[variant] = replace(plan, fitting=[e for e in plan.fitting if e.layout.sequence == 1])
    return out


def ranks(order: Sequence[str]) -> Dict[str, int]:
    return {name: i + 1 for i, name in enumerate(order)}


def spearman(a: Dict[str, int], b: Dict[str, int]) -> float:
    n = len(a)
    if n < 2:
        return float("nan")
    return 1 - 6 * sum((a[k] - b[k]) ** 2 for k in a) / (n * (n * n - 1))


def verdict(recommended: str, measured_ms: Dict[str, float], top: int = 2) -> Tuple[bool, List[str]]:
    """Is the recommended layout among the ``top`` fastest measured (by median)?"""
    fastest = sorted(measured_ms, key=measured_ms.get)[:top]
    return recommended in fastest, fastest


def build_rows(plans: Dict[str, Any], measured: Dict[str, List[float]]) -> List[Dict[str, Any]]:
    """One row per layout, in plan B's order (its ranking)."""
    main = plans["B"]
    medians = {key: summarize(values).median for key, values in measured.items()}
    measured_rank = ranks(sorted(medians, key=medians.get))
    predicted_rank = ranks([layout_key(e.layout) for e in main.fitting])
    by_variant = {v: {layout_key(e.layout): e for e in p.fitting} for v, p in plans.items()}
    rows = []
    for e in main.fitting:
        key = layout_key(e.layout)
        summary = summarize(measured[key])
        rows.append({"layout": e.layout.name, "key": key,
                     **{f"predicted_{v}_ms": by_variant[v][key].step_s * 1e3 for v in plans},
                     "compute_ms": e.compute_s * 1e3, "bubble_ms": e.bubble_s * 1e3, "update_ms": e.update_s * 1e3,
                     "comm_ms": e.comm_s * 1e3,
                     "measured_ms": summary.median * 1e3, "measured_min_ms": summary.low * 1e3,
                     "measured_max_ms": summary.high * 1e3, "spread": summary.spread, "repeats": summary.repeats,
                     "rank_predicted": predicted_rank[key], "rank_measured": measured_rank[key]})
    return rows


def table_lines(rows: List[Dict[str, Any]], title: str) -> List[str]:
    headers = ["layout", "pred A ms", "pred B ms", "pred C ms", "B: compute", "bubble", "update", "comm",
               "measured ms", "min ms", "spread +-%", "meas/B", "rank pred B", "rank meas"]
    body = [[r["layout"], r["predicted_A_ms"], r["predicted_B_ms"], r["predicted_C_ms"], r["compute_ms"],
             r["bubble_ms"], r["update_ms"], r["comm_ms"], r["measured_ms"], r["measured_min_ms"], 100 * r["spread"],
             r["measured_ms"] / r["predicted_B_ms"], r["rank_predicted"], r["rank_measured"]] for r in rows]
    return [format_table(headers, body, title)]


def verdict_lines(plans: Dict[str, Any], rows: List[Dict[str, Any]]) -> Tuple[List[str], Dict[str, Any]]:
    measured_ms = {r["key"]: r["measured_ms"] for r in rows}
    names = {r["key"]: r["layout"] for r in rows}
    measured_rank = {r["key"]: r["rank_measured"] for r in rows}
    lines, out = [], {}
    for variant, result in plans.items():
        best = layout_key(result.recommended.layout)
        ok, fastest = verdict(best, measured_ms)
        rho = spearman(ranks([layout_key(e.layout) for e in result.fitting]), measured_rank)
        behind = measured_ms[best] / min(measured_ms.values()) - 1
        out[variant] = {"recommended": names[best], "among_two_fastest": ok, "two_fastest": [names[k] for k in fastest],
                        "recommended_measured_rank": measured_rank[best], "behind_fastest": behind,
                        "within_noise_of_fastest": behind < NOISE, "spearman": rho}
        noise = "within" if behind < NOISE else "beyond"
        lines.append(f"{variant} ({VARIANTS[variant]}): recommends {names[best]}: measured rank "
                     f"{measured_rank[best]} of {len(rows)} -> {'HOLDS' if ok else 'FAILS'} (two fastest measured: "
                     f"{', '.join(names[k] for k in fastest)}); {behind:+.0%} behind the fastest measured, "
                     f"{noise} the ~{NOISE:.0%} noise here; rank correlation (Spearman) {rho:+.2f}")
    return lines, out


def plot(rows: List[Dict[str, Any]], path) -> None:
    fig, (ax,) = new_figure(width=7, height=5.5)
    xs = [r["predicted_B_ms"] for r in rows]
    ys = [r["measured_ms"] for r in rows]
    errors = [[r["measured_ms"] - r["measured_min_ms"] for r in rows], [r["measured_max_ms"] - r["measured_ms"] for r in rows]]
    ax.errorbar(xs, ys, yerr=errors, fmt="o", label="B: rate under load (headline)")
    ax.plot([r["predicted_C_ms"] for r in rows], ys, "x", label="C: B with overlap 0")
    for r, x, y in zip(rows, xs, ys):
        ax.annotate(r["layout"], (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    low = min(xs + ys + [r["predicted_C_ms"] for r in rows]) * 0.8
    high = max(xs + ys + [r["predicted_C_ms"] for r in rows]) * 1.2
    ax.plot([low, high], [low, high], "k--", lw=0.8, label="measured = predicted")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("plan's step time, ms (MODELLED, calibrated here)")
    ax.set_ylabel("step time, ms (MEASURED, median, min-max)")
    ax.set_title("hvdtrain plan: predicted vs measured, every layout")
    ax.legend(fontsize=7)
    save_figure(fig, path)


# ---- the run ---------------------------------------------------------------------------------------

def worker_args(args: argparse.Namespace, mode: str, layouts: Sequence[str] = ()) -> List[str]:
    out = ["--mode", mode, *lm_workload.model_argv(args), "--batch", str(args.batch),
           "--rounds", str(args.rounds), "--steps", str(args.steps), "--segments", str(args.segments),
           "--warmup", str(args.warmup), "--compute-batches", str(args.batch)]
    if layouts:
        out += ["--layouts", ",".join(layouts)]
    return out


def calibrate(shape, args, single: Dict[str, Any], world: Dict[str, Any]) -> Dict[str, Any]:
    """Device rate from the plain step less its update (plan's compute is forward + backward), and
    update bandwidth from the update alone: the bytes Adam streams over the whole model / its seconds.

    Args:
        shape: the model's shape.
        args: the driver's options.
        single: the one-process run's result.
        world: the run's result at --workers.
    """
    from hvdtrain import planner

    plain = single["plain_step_s"][str(args.batch)]
    one, one_update = statistics.median(plain["step_s"]), statistics.median(plain["update_s"])
    loaded, loaded_update = statistics.median(world["local_step_s"]), statistics.median(world["local_update_s"])
    streamed = max(planner.stage_elements(shape, 1, 1)) * planner.update_bytes_per_element("adam")
    sizes = sorted(int(s) for s in world["allreduce_s"])
    medians = [statistics.median(world["allreduce_s"][str(s)]) for s in sizes]
    fit = fit_link(sizes, medians, args.workers)
    return {"one_process_step_s": one, "one_process_update_s": one_update, "one_process_batch": args.batch,
            "under_load_step_s": loaded, "under_load_update_s": loaded_update, "under_load_batch": world["local_batch"],
            "rates": {"one_process": device_rate(shape.total, args.batch, shape.seq_len, one - one_update),
                      "under_load": device_rate(shape.total, world["local_batch"], shape.seq_len,
                                                loaded - loaded_update)},
            "update_bandwidths": {"one_process": streamed / one_update, "under_load": streamed / loaded_update},
            "allreduce_median_s": dict(zip(map(str, sizes), medians)), "link": asdict(fit)}


def calibration_lines(cal: Dict[str, Any], args, cpus: int) -> List[str]:
    rates, updates, link = cal["rates"], cal["update_bandwidths"], cal["link"]
    sizes = ", ".join(f"{int(s) // 1024} KiB {t * 1e3:.2f} ms" for s, t in cal["allreduce_median_s"].items())
    share = f"{args.workers} ranks share {cpus} cores" if args.workers > cpus else f"{args.workers} ranks, {cpus} cores"
    return [f"calibration (measured here, one thread per rank; {share}):",
            f"  device rate, one process alone: {rates['one_process'] / 1e9:.2f} GFLOP/s, update "
            f"{updates['one_process'] / 1e9:.2f} GB/s (plain step of {cal['one_process_batch']} samples: "
            f"{cal['one_process_step_s'] * 1e3:.1f} ms, of which Adam's update {cal['one_process_update_s'] * 1e3:.1f} ms)",
            f"  per rank, {args.workers} ranks at once: {rates['under_load'] / 1e9:.2f} GFLOP/s, update "
            f"{updates['under_load'] / 1e9:.2f} GB/s (plain step of {cal['under_load_batch']} samples: "
            f"{cal['under_load_step_s'] * 1e3:.1f} ms, of which the update {cal['under_load_update_s'] * 1e3:.1f} ms; "
            f"slowest rank)",
            f"  all-reduce at {args.workers} ranks (median, slowest rank): {sizes}",
            f"  fitted link: bandwidth {link['bandwidth'] / 1e9:.2f} GB/s, per ring step {link['alpha_s'] * 1e6:.0f} us "
            f"(t = {link['intercept_s'] * 1e3:.2f} ms + S / {1 / link['slope_s_per_byte'] / 1e9:.2f} GB/s)"]


def run(args: argparse.Namespace) -> int:
    from hvdtrain import planner

    try:
        shape = planner.ModelShape(args.layers, args.d_model, args.seq_len, args.vocab, args.heads)
        base = planner.Setup(shape, args.batch, 2.0 ** 50, args.workers)
        # Sequence-parallel layouts are planned but not yet measured here (its worker runs T x P x D).
        keys = [layout_key(layout) for layout in planner.layouts(base) if layout.sequence == 1]
    except ValueError as error:
        print(f"hvdtrain bench plan: {error}", file=sys.stderr)
        return 2
    if not keys:
        print(f"hvdtrain bench plan: no layout runs {args.workers} workers on a batch of {args.batch}", file=sys.stderr)
        return 2
    cpus = os.cpu_count() or 1
    out = report.output_dir(args.out, "plan")
    env = {"OMP_NUM_THREADS": "1"}
    load_before = os.getloadavg()
    print(f"bench plan: {len(keys)} layouts at {args.workers} ranks on {cpus} cores, "
          f"{args.rounds} interleaved rounds ...", flush=True)
    try:
        single = jobs.run_job(WORKER, worker_args(args, "single"), 1, "none", args.timeout, env)
        hosts = [Host("localhost", args.workers)] if args.workers > cpus else []  # slots: oversubscribe
        world = jobs.run_job(WORKER, worker_args(args, "world", keys), args.workers, "mpirun", args.timeout,
                             env, hosts)
    except jobs.JobFailed as error:
        print(f"hvdtrain bench plan: {error}", file=sys.stderr)
        return 1
    load_after = os.getloadavg()
    cal = calibrate(shape, args, single, world)
    link = measured_network(fit_link(sorted(int(s) for s in world["allreduce_s"]),
                                     [cal["allreduce_median_s"][s] for s in sorted(world["allreduce_s"], key=int)],
                                     args.workers))
    plans = predictions(shape, args, cal["rates"], link, cal["update_bandwidths"])
    rows = build_rows(plans, world["layout_step_s"])
    oversubscribed = args.workers > cpus
    title = (f"hvdtrain plan, MODELLED (calibrated here) vs MEASURED: TinyTransformerLM {planner.format_count(shape.total)} "
             f"parameters ({args.layers} blocks, d_model {args.d_model}, seq {args.seq_len}, heads {args.heads}, vocab "
             f"{args.vocab}), float32, Adam, global batch {args.batch}, {args.workers} ranks"
             f"{f' OVERSUBSCRIBED on {cpus} cores' if oversubscribed else ''}, one thread each; measured = median of "
             f"{args.rounds} rounds x {args.segments} segments of {args.steps} steps, slowest rank. "
             f"pred A/B/C: {'; '.join(f'{k} {v}' for k, v in VARIANTS.items())}. B's terms in ms:")
    lines = calibration_lines(cal, args, cpus) + [""] + table_lines(rows, title)
    verdicts, verdict_json = verdict_lines(plans, rows)
    load = (f"load average (1, 5, 15 min) before {', '.join(f'{x:.2f}' for x in load_before)}, after "
            f"{', '.join(f'{x:.2f}' for x in load_after)} on {cpus} cores: a 1-minute figure before above "
            f"{cpus / 2:g} means other work was running when this run started; the figure after counts this "
            f"run's own ranks and their Horovod threads")
    lines += [""] + verdicts + [load]
    payload = {"label": "predicted: MODELLED (plan, calibrated on this host); measured: MEASURED",
               "model": {**lm_workload.dims(args), "parameters": shape.total},
               "batch": args.batch, "workers": args.workers, "cpus": cpus, "oversubscribed": oversubscribed,
               "rounds": args.rounds, "segments": args.segments, "steps": args.steps, "warmup": args.warmup,
               "load_average": {"before": load_before, "after": load_after}, "calibration": cal, "variants": VARIANTS, "rows": rows, "verdicts": verdict_json,
               "raw": {"single": single, "world": world}}
    report.write_json(out / "results.json", payload)
    plot(rows, out / "predicted_vs_measured.png")
    report.print_lines(lines + [f"wrote {out / 'results.json'} and {out / 'predicted_vs_measured.png'}"])
    return 0
