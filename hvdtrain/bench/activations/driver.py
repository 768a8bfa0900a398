"""``hvdtrain bench activations``: what train.activation_checkpointing saves and costs, on the
example transformer in one process: the activation bytes a step keeps for backward (counted: the
storages autograd saves and the checkpointed blocks' inputs, parameters excluded) and the step time
(forward, backward and the optimizer step), for none, every_k, selective and full, side by side in
one run (the modes take turns, step by step), as ratios to none.

Per rank the activations do not depend on the data-parallel strategy (ddp, zero and fsdp run the
same forward on the same micro-batch), which is why one process measures them.
"""
from __future__ import annotations

import argparse
import time
from typing import Any, Dict, List

from hvdtrain.bench.common import lm_workload, report
from hvdtrain.bench.common.stats import ratio, summarize
from hvdtrain.common.tables import format_table
from hvdtrain.common.units import format_bytes

MODES = ("none", "every_k", "selective", "full")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    lm_workload.add_model_arguments(parser, d_model=256, layers=8)
    parser.add_argument("--batch", type=int, default=16, help="samples per step (default: 16)")
    parser.add_argument("--every", type=int, default=2, help="every_k's k (default: 2)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per mode, after one untimed (default: 10)")
    parser.add_argument("--seed", type=int, default=0, help="the model's and the data's seed (default: 0)")
    parser.add_argument("--out", help="output directory (default bench-results/activations-<time>)")


def measure(args: argparse.Namespace) -> Dict[str, Dict[str, Any]]:
    """Per mode: the counted activation bytes of a step and its step times."""
    import torch

    from hvdtrain.examples.textlm import lm_loss
    from hvdtrain.components.activation_checkpointing import checkpoint_activations, saved_activation_bytes

    inputs, targets = lm_workload.token_batch(args, args.batch)
    runs: Dict[str, Dict[str, Any]] = {}
    for mode in MODES:
        model = lm_workload.build_model(args)
        blocks = checkpoint_activations(model, mode, args.every)
        runs[mode] = {"model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-3),
                      "blocks": len(blocks), "step_s": []}

    def step(run: Dict[str, Any], count: bool) -> None:
        model, optimizer = run["model"], run["optimizer"]
        optimizer.zero_grad()
        if count:
            loss, run["activation_bytes"] = saved_activation_bytes(model, lambda: lm_loss(model(inputs), targets))
        else:
            loss = lm_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()

    for run in runs.values():  # untimed: first-touch allocations, and the count
        step(run, count=True)
    for _ in range(args.steps):
        for run in runs.values():
            started = time.perf_counter()
            step(run, count=False)
            run["step_s"].append(time.perf_counter() - started)
    return {mode: {"blocks": run["blocks"], "activation_bytes": run["activation_bytes"],
                   "step_s": summarize(run["step_s"])} for mode, run in runs.items()}


def run(args: argparse.Namespace) -> int:
    if min(args.batch, args.every, args.steps) < 1:
        raise SystemExit("hvdtrain bench activations: --batch, --every and --steps must be >= 1")
    results = measure(args)
    none = results["none"]
    rows: List[list] = []
    for mode, result in results.items():
        result["bytes_ratio"] = result["activation_bytes"] / none["activation_bytes"]
        result["time_ratio"] = ratio(result["step_s"], none["step_s"])
        rows.append([mode if mode != "every_k" else f"every_{args.every}", f"{result['blocks']}/{args.layers}",
                     format_bytes(result["activation_bytes"]), result["bytes_ratio"],
                     result["step_s"].median * 1e3, result["step_s"].spread * 100, result["time_ratio"]])
    shape = lm_workload.dims(args)
    title = (f"activation checkpointing: the example transformer ({args.layers} blocks, width {args.d_model}, "
             f"{args.heads} heads, {args.seq_len} tokens, vocabulary {args.vocab}), batch {args.batch}, one "
             f"process, {args.steps} steps per mode taken in turn")
    out = report.output_dir(args.out, "activations")
    path = report.write_json(out / "activations.json", {
        "model": shape, "batch": args.batch, "every": args.every,
        "modes": {mode: dict(r, step_s=r["step_s"].to_dict()) for mode, r in results.items()}})
    report.print_lines([format_table(["mode", "blocks", "activations", "x none", "step ms", "+-%", "time x none"],
                                     rows, title), f"wrote {path}"])
    return 0
