"""Seconds from a launch to the end of its first step, and where they go.

    python -m hvdtrain.bench.startup.driver [--workers 2,4] [--rounds 2]

Each job is the main job's (train.py: the digits CNN, SGD) through the Trainer, two steps, one
mpirun launch per job. Rank 0's start-up clock (hvdtrain.common.startup_clock) splits the time from
its process's start into imports, Horovod's init, set-up and the first step; the driver adds the
launcher's own share (from its call of mpirun to the process's start). Variants, in rotating order
per round:

- **eager** at every worker count;
- **compile, cold**: ``train.compile=true`` with an empty Inductor cache and no checkpoints (a
  first run on a new host);
- **compile, warm restart**: the same, restarted on a "new host" (another empty Inductor cache)
  from the cold run's checkpoint directory, which holds its compiled artifacts
  (hvdtrain.components.compile_cache).

``import torch`` alone in one process is printed beside them: the floor no launch goes below.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Sequence

from hvdtrain.bench.common import jobs, report, stats
from hvdtrain.common.startup_clock import PHASES, record_key
from hvdtrain.common.tables import format_table
from hvdtrain.launch.hostfile import Host

WORKER = "hvdtrain.bench.startup.driver"
VARIANTS = ("eager", "compile-cold", "compile-warm")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", default="2,4", help="comma-separated worker counts (default: 2,4)")
    parser.add_argument("--compile-workers", type=int, default=2,
                        help="the worker count of the compile variants (default: 2; 0: skip them)")
    parser.add_argument("--rounds", type=int, default=2, help="repeats of every job, interleaved (default: 2)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per job (default: 900)")
    parser.add_argument("--out", help="output directory (default: bench-results/startup-<time>)")


def import_torch_seconds() -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.perf_counter() - started


def run(args: argparse.Namespace) -> int:
    counts = [int(n) for n in args.workers.split(",") if n.strip()]
    if not counts or min(counts) < 1 or args.rounds < 1 or args.compile_workers < 0:
        raise ValueError("--workers needs counts >= 1, --rounds >= 1, --compile-workers >= 0")
    out = report.output_dir(args.out, "startup")
    plan = [("eager", np) for np in counts]
    if args.compile_workers:
        plan += [("compile-cold", args.compile_workers), ("compile-warm", args.compile_workers)]
    results: Dict[tuple, List[Dict[str, Any]]] = {}
    floor: List[float] = []
    with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-startup-") as scratch:
        for round_index in range(args.rounds):
            floor.append(import_torch_seconds())
            cold_checkpoints = Path(scratch) / f"checkpoints-{round_index}"
            eager = [job for job in plan if job[0] == "eager"]
            shift = round_index % len(eager)
            # The warm restart reads what the cold run wrote: the two stay in that order, after the eager jobs.
            for variant, np in eager[shift:] + eager[:shift] + [job for job in plan if job[0] != "eager"]:
                worker_args = ["--variant", variant]
                env = {"OMP_NUM_THREADS": "1",  # a fresh Inductor cache per job: a new host's
                       "TORCHINDUCTOR_CACHE_DIR": str(Path(scratch) / f"inductor-{variant}-{np}-{round_index}")}
                if variant != "eager":
                    worker_args += ["--checkpoint-dir", str(cold_checkpoints)]
                hosts = [Host("localhost", np)] if np > (os.cpu_count() or 1) else []
                launched = time.time()
                result = jobs.run_job(WORKER, worker_args, np, "mpirun", args.timeout, env=env, hosts=hosts)
                result["launcher_s"] = result["process_started_at"] - launched
                result["launch_to_first_step_s"] = result["launcher_s"] + result["total_s"]
                results.setdefault((variant, np), []).append(result)
                print(f"round {round_index + 1}: {variant}, {np} workers: "
                      f"{result['launch_to_first_step_s']:.1f} s to the first step's end", flush=True)
    rows = summarize(results, plan)
    lines = table(rows, stats.median(floor), args.rounds)
    report.print_lines(lines)
    report.write_json(out / "startup.json", {"settings": {k: v for k, v in vars(args).items() if not callable(v)},
                                             "import_torch_s": floor, "rows": rows,
                                             "runs": {f"{v}/{n}": r for (v, n), r in results.items()}})
    (out / "startup.txt").write_text("\n".join(lines) + "\n")
    print(f"results in {out}", flush=True)
    return 0


def summarize(results, plan: Sequence[tuple]) -> List[Dict[str, Any]]:
    """One row per (variant, workers): the medians of rank 0's phases and of the launcher's share."""
    rows = []
    for variant, np in plan:
        runs = results[(variant, np)]
        row = {"variant": variant, "workers": np,
               "launch_to_first_step_s": stats.median([r["launch_to_first_step_s"] for r in runs]),
               "launcher_s": stats.median([r["launcher_s"] for r in runs])}
        for phase in PHASES:
            row[record_key(phase)] = stats.median([r.get(record_key(phase), 0.0) for r in runs])
        rows.append(row)
    return rows


def table(rows: List[Dict[str, Any]], import_torch: float, rounds: int) -> List[str]:
    body = [[r["variant"], r["workers"], f"{r['launch_to_first_step_s']:.1f}", f"{r['launcher_s']:.1f}",
             *[f"{r[record_key(phase)]:.1f}" for phase in PHASES]] for r in rows]
    headers = ["variant", "N", "launch to first step s", "launcher s", *[f"{phase} s" for phase in PHASES]]
    title = f"Start-up of the main job (digits CNN), rank 0's clock, {rounds} round(s); medians"
    return ["", format_table(headers, body, title=title),
            f"import torch alone, one process: {import_torch:.1f} s (the floor of 'imports')"]


# The worker: one job, every rank.

def worker(argv: Sequence[str]) -> int:
    import torch  # counted in 'imports', as in any script

    import hvdtrain
    from hvdtrain.common.startup_clock import CLOCK
    from hvdtrain.config.train import TrainConfig
    from hvdtrain.examples.digits import DigitsCNN, load_digits_datasets

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--variant", choices=VARIANTS, required=True)
    parser.add_argument("--checkpoint-dir")
    args = parser.parse_args(argv)
    world = hvdtrain.init(seed=0, threads=1)
    train_set, val_set = load_digits_datasets()
    model = DigitsCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    resume_from = 2 if args.variant == "compile-warm" else 0
    config = TrainConfig(epochs=1, batch_size=32, max_steps=resume_from + 2, warmup_epochs=0.0, progress="off",
                         log_every=10**6, compile=args.variant != "eager", checkpoint_dir=args.checkpoint_dir,
                         checkpoint_every=2)
    trainer = hvdtrain.Trainer(model, optimizer, train_set, val_set, config, world=world)
    if trainer.global_step != resume_from:
        raise RuntimeError(f"{args.variant} started at step {trainer.global_step}, not {resume_from}: "
                           "the warm restart must resume the cold run's checkpoint")
    trainer.fit()
    trainer.close()
    if world.is_root:
        durations = CLOCK.durations()
        jobs.write_result(Path(args.out), {
            "np": world.size, "variant": args.variant, "total_s": CLOCK.total(),
            "process_started_at": CLOCK.started_at,
            **{record_key(phase): seconds for phase, seconds in durations.items()}})
    return 0


def main(argv: Sequence[str]) -> int:
    return jobs.driver_or_worker(argv, worker, add_arguments, run, __doc__, worker_flag="--variant")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
