"""Model parallelism against its theory: the pipeline bubble, the tensor-parallel communication
share, and the parameter bytes per rank.

    python -m hvdtrain.bench.model_parallel.driver [--stages 2[,4]] [--micro-batches 1,2,4,8] [--out DIR]

The example transformer (TinyTransformerLM, float32, dropout 0; synthetic token ids) through the
Trainer's ModelParallelStrategy, one mpirun job per part (hvdtrain.bench.model_parallel.worker):

1. Pipeline bubble, P stages on P ranks, GPipe and 1F1B at M micro-batches, the same batch per
   worker (a micro-batch shrinks as M grows), configurations interleaved in rounds. Per stage:
   measured idle share = 1 - compute_s / the schedule's wall time (ScheduleStats; median over the
   measured steps), beside the theory (P - 1) / (M + P - 1). The idle share holds the bubble and
   the exchanges' own cost (each a Horovod all-to-all: at least one cycle, 1 ms by default, whatever
   the size), so it sits above the theory, the more the more exchanges (2M per stage pair and step).
   Also the most micro-batches a stage held at once: GPipe M, 1F1B min(M, P - stage).
   More ranks than cores (P = 4 on a 2-core host) is OVERSUBSCRIBED: an idle stage's core goes to
   another stage, so idle is not free there and the bubble is distorted.
   Then the schedules with less bubble (``--variants``), each on its own stages in the same job:
   1F1B, the interleaved 1F1B with v chunks per stage (``1f1b:v2``) and ZB-H1. Per stage: the idle
   fraction = the time the stage waited in receives (ScheduleStats.wait_s) / the step's wall time,
   beside its formula, (P - 1) / (v·M + P - 1) (ZB-H1 at F = B = W: (P - 1) / (3M + P - 1)), and
   their ratio; for ZB-H1 also its waiting time over 1F1B's at the same M (about 1/3 in theory).
2. Tensor-parallel communication share, T ranks: the time of a forward + backward spent in the
   tensor group's all-reduces (Megatron's f and g, timed around each hvd.allreduce: a direct
   measurement; waiting for the peer included), and the bytes they move, counted, beside the
   formula 4 x layers x batch x seq x d_model x 4 bytes (2 all-reduces per block forward, 2
   backward). Beside it, interleaved in the same job, the whole unsplit model on each rank alone
   (T = 1, no communication): T x (T = 1 time) / (T time) is how close the split comes to ideal.
3. Parameter bytes per rank at W ranks for the layouts T x P (ddp, T=2, P=2, T=2 x P=2, T=4,
   P=4): ``strategy.memory_bytes()["parameters"]`` (counted from the storages) against the model
   / (T x P), and against an account of every parameter of the layers each stage holds: split
   matrices (and column-parallel biases) / T; LayerNorms, row-parallel biases, the embeddings
   replicated over the tensor group; the tied token matrix held by both ends of a pipeline.

On CPUs the all-reduces and exchanges run on the cores that compute: nothing overlaps as it would
on GPUs. Read ratios measured in one job, not absolute times.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict, Iterable, List, Optional, Sequence

from hvdtrain.bench.common import jobs, lm_workload, report, stats
from hvdtrain.launch.hostfile import Host
from hvdtrain.common.tables import format_table
from hvdtrain.observability.figures import new_figure, save_figure
from hvdtrain.parallel.pipeline.actions import bubble_formula

WORKER = "hvdtrain.bench.model_parallel.worker"
SCHEDULES = ("gpipe", "1f1b")
FLOAT32 = 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stages", default="2",
                        help="comma-separated pipeline sizes P, one job of P ranks each; 4 oversubscribes 2 cores "
                             "and is labelled so (default: 2)")
    parser.add_argument("--micro-batches", default="1,2,4,8", help="M of the bubble table (default: 1,2,4,8)")
    parser.add_argument("--variants", default="1f1b,1f1b:v2,zb-h1",
                        help="schedules of the idle-fraction table: schedule[:vN] (N chunks per stage), comma-separated; "
                             "empty skips (default: 1f1b,1f1b:v2,zb-h1)")
    parser.add_argument("--tensor", type=int, default=2, help="T of the communication share (default: 2; 0 skips)")
    parser.add_argument("--memory-workers", type=int, default=4,
                        help="ranks of the parameter-bytes job (default: 4; 0 skips)")
    parser.add_argument("--layouts", default="1x1,2x1,1x2,2x2,4x1,1x4",
                        help="TxP layouts of the parameter-bytes table (default: 1x1,2x1,1x2,2x2,4x1,1x4)")
    lm_workload.add_model_arguments(parser, d_model=256, layers=4)
    parser.add_argument("--batch", type=int, default=16, help="samples per worker per step (default: 16)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per job (default: 5)")
    parser.add_argument("--steps", type=int, default=5, help="measured steps per configuration and round (default: 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before each (default: 2)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per job (default: 900)")
    parser.add_argument("--out", help="output directory (default: bench-results/model-parallel-<time>)")


# ---- theory -----------------------------------------------------------------------------------

def bubble_theory(stages: int, micro_batches: int) -> float:
    """The idle share of every stage of a balanced pipeline, GPipe and 1F1B alike: (P-1)/(M+P-1)."""
    return (stages - 1) / (micro_batches + stages - 1)


def in_flight_theory(schedule: str, micro_batches: int, stages: int, stage: int) -> int:
    """The most micro-batches whose activations ``stage`` holds at once: GPipe all M; 1F1B the
    P - 1 - stage warm-up forwards and one more, never more than M.

    Args:
        schedule: gpipe or 1f1b.
        micro_batches: M, micro-batches per batch.
        stages: P, pipeline stages.
        stage: this stage's index, from 0.
    """
    if schedule == "gpipe":
        return micro_batches
    if schedule == "1f1b":
        return min(micro_batches, stages - stage)
    raise ValueError(f"unknown schedule {schedule!r}")


def tensor_bytes_formula(dims: Dict[str, int], batch: int) -> int:
    """Bytes the tensor group's all-reduces take in per rank and step: 2 per block forward (g after
    attention and after the MLP), 2 backward (f before each), each batch x seq x d_model floats."""
    return 4 * dims["layers"] * batch * dims["seq_len"] * dims["d_model"] * FLOAT32


def layer_parameters(dims: Dict[str, int]) -> List[Dict[str, int]]:
    """TinyTransformerLM as pipeline_layers cuts it ([embedding, blocks..., head]), each layer's
    parameter counts: split (divided over the tensor group), replicated, and tied (the token
    matrix, one Parameter in the first and the last layer)."""
    v, s, d, layers = dims["vocab"], dims["seq_len"], dims["d_model"], dims["layers"]
    embedding = {"split": 0, "replicated": s * d, "tied": v * d}  # position; token (tied)
    # qkv weight + bias, proj weight, mlp.0 weight + bias, mlp.2 weight: split;
    # norm1, norm2 (weight + bias), proj bias, mlp.2 bias: replicated.
    block = {"split": 3 * d * d + 3 * d + d * d + 4 * d * d + 4 * d + 4 * d * d, "replicated": 2 * d + d + 2 * d + d,
             "tied": 0}
    head = {"split": 0, "replicated": 2 * d, "tied": v * d}  # final norm; the tied output layer
    return [embedding] + [dict(block) for _ in range(layers)] + [head]


def model_bytes(dims: Dict[str, int]) -> int:
    """The whole model's parameter bytes, the tied matrix once."""
    counts = layer_parameters(dims)
    total = sum(c["split"] + c["replicated"] for c in counts) + counts[0]["tied"]
    return total * FLOAT32


def rank_bytes(dims: Dict[str, int], tensor: int, stages: int, held: Iterable[int]) -> Dict[str, float]:
    """The parameter bytes of a rank, accounted, and how they
    differ from the model / (T x P): measured - ideal = replicated + tied + stage balance, with
      replicated     the replicated parameters' bytes (the tied matrix excepted) x (1 - 1/T): each
                     tensor rank holds them whole instead of a 1/T share
      tied           the token matrix on the last stage of a pipeline (P > 1): a second copy, the
                     first stage's is the model's own
      stage balance  (the full bytes of the stage's layers, tied copy excepted, - model / P) / T:
                     stages hold whole layers, so not exactly 1/P of the model

    Args:
        dims: the model's dimensions (vocab, d_model, layers, ...).
        tensor: T, the tensor-parallel size.
        stages: P, the pipeline stages.
        held: the layers this rank's stage holds.
    """
    counts = layer_parameters(dims)
    held = sorted(set(held))
    split = sum(counts[i]["split"] for i in held) * FLOAT32
    replicated = sum(counts[i]["replicated"] for i in held) * FLOAT32
    token = counts[0]["tied"] * FLOAT32
    holds_token = bool({0, len(counts) - 1} & set(held))
    duplicate = token if stages > 1 and (len(counts) - 1) in held and 0 not in held else 0
    full = split + replicated + (token if holds_token else 0)
    whole = model_bytes(dims)
    ideal = whole / (tensor * stages)
    return {
        "accounted": split / tensor + replicated + (token if holds_token else 0),
        "ideal": ideal,
        "replicated": (replicated + (token if holds_token else 0) - duplicate) * (1 - 1 / tensor),
        "tied": duplicate,
        "stage_balance": (full - duplicate - whole / stages) / tensor,
    }


# ---- summaries of the workers' figures --------------------------------------------------------

def pipeline_rows(result: Dict[str, Any]) -> List[Dict[str, Any]]:
    """One row per (M, stage): both schedules' idle shares (median over steps, with min and max),
    wait shares, step times and most micro-batches held, beside the theory."""
    stages = result["pipeline"]
    by_rank = sorted(result["per_rank"], key=lambda r: r["stage"])
    keys = list(by_rank[0]["steps"])
    micro = sorted({int(k.split("/")[1]) for k in keys})
    rows = []
    for m in micro:
        for rank in by_rank:
            row = {"stages": stages, "micro_batches": m, "stage": rank["stage"], "layers": rank["layers"],
                   "theory": bubble_theory(stages, m), "cpus": result.get("cpus"),
                   "oversubscribed": stages > (result.get("cpus") or stages)}
            for schedule in SCHEDULES:
                steps = rank["steps"].get(f"{schedule}/{m}", [])
                idle = [1 - compute / wall for wall, compute, _, _ in steps if wall > 0]
                row[schedule] = {
                    "idle": stats.median(idle), "idle_min": min(idle, default=float("nan")),
                    "idle_max": max(idle, default=float("nan")),
                    "wait_share": stats.median([wait / wall for wall, _, wait, _ in steps if wall > 0]),
                    "step_ms": stats.median([wall * 1e3 for wall, _, _, _ in steps]),
                    "compute_ms": stats.median([compute * 1e3 for _, compute, _, _ in steps]),
                    "max_in_flight": max((int(s[3]) for s in steps), default=0),
                    "in_flight_theory": in_flight_theory(schedule, m, stages, rank["stage"]),
                    "steps": len(steps),
                }
            rows.append(row)
    return rows


def parse_variant(text: str) -> tuple:
    """``1f1b:v2`` -> ("1f1b", 2); ``zb-h1`` -> ("zb-h1", 1)."""
    schedule, _, virtual = text.strip().partition(":v")
    return schedule, int(virtual) if virtual else 1


def schedule_rows(result: Dict[str, Any]) -> List[Dict[str, Any]]:
    """One row per (variant, M, stage): the idle fraction measured (median over steps of the time in
    receives / the step's wall time), its formula and their ratio; ZB-H1's waiting time over 1F1B's."""
    stages = result["pipeline"]
    by_rank = sorted(result["per_rank"], key=lambda r: r["stage"])
    rows = []
    for key in by_rank[0]["steps"]:
        variant, m = key.split("/")
        schedule, virtual = parse_variant(variant)
        for rank in by_rank:
            steps = rank["steps"][key]
            idle = stats.median([wait / wall for wall, _, wait, _ in steps if wall > 0])
            formula = bubble_formula(schedule, stages, virtual, int(m))
            wait_ms = stats.median([wait * 1e3 for _, _, wait, _ in steps])
            base = rank["steps"].get(f"1f1b/{m}")
            versus = (wait_ms / stats.median([wait * 1e3 for _, _, wait, _ in base])
                      if schedule == "zb-h1" and base else None)
            rows.append({"stages": stages, "variant": variant, "micro_batches": int(m), "stage": rank["stage"],
                         "idle": idle, "formula": formula, "ratio": idle / formula if formula else float("nan"),
                         "wait_ms": wait_ms, "step_ms": stats.median([wall * 1e3 for wall, _, _, _ in steps]),
                         "versus_1f1b": versus, "max_in_flight": max((int(s[3]) for s in steps), default=0),
                         "steps": len(steps), "oversubscribed": stages > (result.get("cpus") or stages)})
    return sorted(rows, key=lambda r: (r["micro_batches"], r["variant"], r["stage"]))


def schedule_table(rows: List[Dict[str, Any]]) -> List[str]:
    if not rows:
        return []
    stages = rows[0]["stages"]
    label = f" -- OVERSUBSCRIBED: {stages} ranks" if rows[0]["oversubscribed"] else ""
    headers = ["M", "schedule", "stage", "idle (wait/step)", "formula", "ratio", "wait ms", "step ms",
               "wait / 1f1b's", "held"]
    table = [[r["micro_batches"], r["variant"], r["stage"], round(r["idle"], 3), round(r["formula"], 3),
              round(r["ratio"], 2), round(r["wait_ms"], 1), round(r["step_ms"], 1),
              "" if r["versus_1f1b"] is None else round(r["versus_1f1b"], 2), r["max_in_flight"]] for r in rows]
    title = (f"Pipeline schedules, P={stages}{label}: idle = time waiting in receives / step wall time, median over "
             f"{rows[0]['steps']} steps; formula (P-1)/(v*M+P-1) (1f1b:vN interleaved, v=N), zb-h1 (P-1)/(3M+P-1) "
             f"(F=B=W); ratio = idle / formula; wait / 1f1b's: zb-h1's waiting time over 1f1b's (theory 1/3)")
    return ["", format_table(headers, table, title=title)]


def tensor_summary(result: Dict[str, Any]) -> Dict[str, Any]:
    """Per rank: medians of the split model's step, its all-reduce time, their share, the bytes and
    calls per step, and the whole model's step on the rank alone; and the formula's bytes."""
    tensor, dims, batch = result["tensor"], result["dims"], result["batch"]
    ranks = []
    for rank in sorted(result["per_rank"], key=lambda r: r["rank"]):
        split, whole = rank["steps"]["tensor"], rank["steps"]["whole"]
        isolated = rank["steps"].get("isolated", [])
        split_ms = stats.median([s[0] * 1e3 for s in split])
        whole_ms = stats.median([s[0] * 1e3 for s in whole])
        allreduce_ms = stats.median([s[1] * 1e3 for s in split])
        isolated_ms = stats.median([s[0] * 1e3 for s in isolated])
        ranks.append({
            "rank": rank["rank"], "step_ms": split_ms, "allreduce_ms": allreduce_ms,
            "isolated_ms": isolated_ms, "isolated_share": isolated_ms / split_ms if split_ms else float("nan"),
            "share": stats.median([s[1] / s[0] for s in split if s[0] > 0]),
            "share_min": min((s[1] / s[0] for s in split if s[0] > 0), default=float("nan")),
            "share_max": max((s[1] / s[0] for s in split if s[0] > 0), default=float("nan")),
            "bytes": int(stats.median([s[2] for s in split])), "calls": int(stats.median([s[3] for s in split])),
            "whole_ms": whole_ms, "speedup": whole_ms / split_ms if split_ms else float("nan"),
            "steps": len(split),
        })
    return {"tensor": tensor, "batch": batch, "bytes_formula": tensor_bytes_formula(dims, batch),
            "calls_formula": 4 * dims["layers"], "ranks": ranks}


def memory_rows(result: Dict[str, Any]) -> List[Dict[str, Any]]:
    """One row per layout and (stage, tensor) coordinate (data-parallel replicas hold the same)."""
    dims, rows = result["dims"], []
    for layout in result["layouts"]:
        tensor, stages = layout["tensor"], layout["pipeline"]
        seen = set()
        for rank in sorted(layout["per_rank"], key=lambda r: r["rank"]):
            _, stage, t = rank["coordinates"]
            replicas = [r for r in layout["per_rank"] if r["coordinates"][1:] == [stage, t]]
            if (stage, t) in seen:
                continue
            seen.add((stage, t))
            account = rank_bytes(dims, tensor, stages, rank["layers"])
            rows.append({"tensor": tensor, "pipeline": stages, "data": result["np"] // (tensor * stages),
                         "rank": rank["rank"], "stage": stage, "tensor_index": t, "layers": rank["layers"],
                         "measured": rank["parameters"],
                         "replicas_agree": all(r["parameters"] == rank["parameters"] for r in replicas),
                         **account})
    return rows


# ---- the report -------------------------------------------------------------------------------

def _layers_text(layers: Sequence[int], total: int) -> str:
    names = ["emb" if i == 0 else "head" if i == total - 1 else f"b{i - 1}" for i in layers]
    return "+".join(names)


def pipeline_table(rows: List[Dict[str, Any]], dims: Dict[str, int], batch: int) -> List[str]:
    if not rows:
        return []
    stages, total = rows[0]["stages"], dims["layers"] + 2
    label = (f" -- OVERSUBSCRIBED: {stages} ranks on {rows[0]['cpus']} cores, idle stages give their core away"
             if rows[0]["oversubscribed"] else "")
    headers = ["M", "stage", "layers", "theory", "idle gpipe", "idle 1f1b", "compute ms gpipe", "compute ms 1f1b",
               "step ms gpipe", "step ms 1f1b", "held gpipe", "held 1f1b"]
    table = [[r["micro_batches"], r["stage"], _layers_text(r["layers"], total), round(r["theory"], 3),
              f"{r['gpipe']['idle']:.3f} ({r['gpipe']['idle_min']:.2f}-{r['gpipe']['idle_max']:.2f})",
              f"{r['1f1b']['idle']:.3f} ({r['1f1b']['idle_min']:.2f}-{r['1f1b']['idle_max']:.2f})",
              round(r["gpipe"]["compute_ms"], 1), round(r["1f1b"]["compute_ms"], 1),
              round(r["gpipe"]["step_ms"], 1), round(r["1f1b"]["step_ms"], 1),
              f"{r['gpipe']['max_in_flight']} (M={r['gpipe']['in_flight_theory']})",
              f"{r['1f1b']['max_in_flight']} (min(M,P-s)={r['1f1b']['in_flight_theory']})"] for r in rows]
    title = (f"Pipeline bubble, P={stages} on {stages} ranks{label}; batch {batch} per worker, "
             f"micro-batch = {batch}/M; idle = 1 - compute_s / schedule wall time, median over "
             f"{rows[0]['gpipe']['steps']} steps (min-max); theory (P-1)/(M+P-1); compute = the stage's "
             f"forward + backward (ScheduleStats.compute_s); held = most micro-batches held at once (theory)")
    return ["", format_table(headers, table, title=title)]


def tensor_table(summary: Dict[str, Any]) -> List[str]:
    headers = ["rank", "step ms (T)", "all-reduce ms", "share (min-max)", "alone ms", "alone share", "calls",
               "bytes/step", "formula bytes", "step ms (whole, alone)", "whole / split"]
    rows = [[r["rank"], round(r["step_ms"], 1), round(r["allreduce_ms"], 1),
             f"{r['share']:.3f} ({r['share_min']:.2f}-{r['share_max']:.2f})", round(r["isolated_ms"], 1),
             round(r["isolated_share"], 3), f"{r['calls']} ({summary['calls_formula']})",
             r["bytes"], summary["bytes_formula"], round(r["whole_ms"], 1), round(r["speedup"], 2)]
            for r in summary["ranks"]]
    t = summary["tensor"]
    title = (f"Tensor-parallel communication, T={t} on {t} ranks, batch {summary['batch']}, forward + backward: "
             f"the tensor group's all-reduces timed around each hvd.allreduce (share of the step); bytes counted "
             f"(formula 4 x layers x batch x seq x d_model x 4); 'alone' = the same all-reduces with nothing else "
             f"running, each after a barrier (transfer only: the rest of the timed all-reduce is waiting for the "
             f"peer); 'whole' = the unsplit model on each rank alone (T=1, no communication); all interleaved; "
             f"ideal whole / split = {t}")
    return ["", format_table(headers, rows, title=title)]


def memory_table(rows: List[Dict[str, Any]], dims: Dict[str, int], np: int) -> List[str]:
    if not rows:
        return []
    total = dims["layers"] + 2
    headers = ["layout", "D", "stage", "t", "layers", "measured", "accounted", "model/(TxP)", "measured/ideal",
               "+replicated", "+tied copy", "+stage balance"]
    table = []
    for r in rows:
        parts = ([f"T={r['tensor']}"] if r["tensor"] > 1 else []) + ([f"P={r['pipeline']}"] if r["pipeline"] > 1 else [])
        name = "x".join(parts) or "ddp"
        table.append([name, r["data"], r["stage"], r["tensor_index"], _layers_text(r["layers"], total), r["measured"],
                      round(r["accounted"]), round(r["ideal"]), round(r["measured"] / r["ideal"], 3),
                      round(r["replicated"]), round(r["tied"]), round(r["stage_balance"])])
    title = (f"Parameter bytes per rank at {np} ranks (float32; strategy.memory_bytes()['parameters'], counted "
             f"from storages), model = {model_bytes(dims)} bytes; measured - model/(TxP) = +replicated "
             f"(LayerNorms, row-parallel biases, embeddings: whole on each tensor rank) + tied copy (the token "
             f"matrix on the last stage too) + stage balance (whole layers per stage)")
    return ["", format_table(headers, table, title=title)]


def plot(pipelines: List[List[Dict[str, Any]]], path) -> None:
    fig, axes = new_figure(ncols=max(1, len(pipelines)), width=5.5)
    for ax, rows in zip(axes, pipelines):
        stages = rows[0]["stages"]
        micro = sorted({r["micro_batches"] for r in rows})
        dense = [m / 4 for m in range(4, 4 * max(micro) + 1)]
        ax.plot(dense, [bubble_theory(stages, m) for m in dense], color="black", label="theory (P-1)/(M+P-1)")
        for schedule, marker in zip(SCHEDULES, ("o", "s")):
            for stage in range(stages):
                mine = [r for r in rows if r["stage"] == stage]
                ax.plot([r["micro_batches"] for r in mine], [r[schedule]["idle"] for r in mine], marker=marker,
                        linestyle="--" if schedule == "gpipe" else ":", label=f"{schedule} stage {stage}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(micro)
        ax.set_xticklabels([str(m) for m in micro])
        ax.set_ylim(0, 1)
        ax.set_xlabel("micro-batches M")
        ax.set_ylabel("idle share of the step (measured: 1 - compute / wall)")
        over = " (OVERSUBSCRIBED, 2 cores)" if rows[0]["oversubscribed"] else ""
        ax.set_title(f"pipeline bubble, P={stages}{over}", fontsize=10)
        ax.legend(fontsize=7)
    save_figure(fig, path)


# ---- the driver -------------------------------------------------------------------------------

def worker_args(args: argparse.Namespace, mode: str) -> List[str]:
    return ["--mode", mode, *lm_workload.model_argv(args), "--batch", str(args.batch),
            "--micro-batches", args.micro_batches, "--layouts", args.layouts, "--rounds", str(args.rounds),
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--variants", args.variants]


def launch(args: argparse.Namespace, mode: str, np: int) -> Dict[str, Any]:
    cpus = os.cpu_count() or 1
    hosts = [Host("localhost", np)] if np > cpus else []  # slots for np > cores
    result = jobs.run_job(WORKER, worker_args(args, mode), np, "mpirun", args.timeout,
                          env={"OMP_NUM_THREADS": "1"}, hosts=hosts)
    return {**result, "cpus": cpus}


def load() -> Optional[List[float]]:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def run(args: argparse.Namespace) -> int:
    out_dir = report.output_dir(args.out, "model-parallel")
    dims = lm_workload.dims(args)
    stage_counts = [int(p) for p in args.stages.split(",") if p.strip()]
    print(f"TinyTransformerLM d_model={args.d_model} layers={args.layers} heads={args.heads} seq={args.seq_len} "
          f"vocab={args.vocab}: {model_bytes(dims)} parameter bytes; batch {args.batch} per worker; load {load()}; "
          f"results in {out_dir}", flush=True)
    settings = {key: value for key, value in vars(args).items() if not callable(value)}  # not the cli's run()
    lines, payload, failed = [], {"benchmark": "model-parallel", "settings": settings, "dims": dims,
                                  "model_bytes": model_bytes(dims), "load_before": load()}, []
    pipelines = []
    for stages in stage_counts:
        try:
            result = launch(args, "pipeline", stages)
            payload.setdefault("environment", result.get("environment"))
            rows = pipeline_rows(result)
        except jobs.JobFailed as error:
            failed.append(f"pipeline P={stages}: {error}")
            continue
        pipelines.append(rows)
        lines += pipeline_table(rows, dims, args.batch)
        report.print_lines(pipeline_table(rows, dims, args.batch))
    payload["pipeline"] = pipelines
    payload["schedules"] = []
    for stages in stage_counts if args.variants.strip() else []:
        try:
            rows = schedule_rows(launch(args, "schedules", stages))
        except jobs.JobFailed as error:
            failed.append(f"schedules P={stages}: {error}")
            continue
        payload["schedules"].append(rows)
        lines += schedule_table(rows)
        report.print_lines(schedule_table(rows))
    if args.tensor > 1:
        try:
            summary = tensor_summary(launch(args, "tensor", args.tensor))
            payload["tensor"] = summary
            lines += tensor_table(summary)
            report.print_lines(tensor_table(summary))
        except jobs.JobFailed as error:
            failed.append(f"tensor T={args.tensor}: {error}")
    if args.memory_workers > 0:
        try:
            result = launch(args, "memory", args.memory_workers)
            rows = memory_rows(result)
            payload["memory"] = rows
            lines += memory_table(rows, dims, args.memory_workers)
            report.print_lines(memory_table(rows, dims, args.memory_workers))
        except jobs.JobFailed as error:
            failed.append(f"memory at {args.memory_workers} ranks: {error}")
    payload["load_after"] = load()
    lines.append(f"\nload average before {payload['load_before']}, after {payload['load_after']} (1, 5, 15 min); "
                 f"workers' environment {payload.get('environment')}")
    print(lines[-1].strip())
    report.write_json(out_dir / "results.json", {**payload, "failed": failed})
    written = [out_dir / "results.json"]
    if pipelines:
        plot(pipelines, out_dir / "bubble.png")
        written.append(out_dir / "bubble.png")
    (out_dir / "report.txt").write_text("\n".join(lines) + "\n")
    print(f"wrote {', '.join(str(p) for p in written)}, {out_dir / 'report.txt'}")
    for failure in failed:
        print(f"FAILED {failure}", file=sys.stderr)
    return 1 if failed else 0


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
