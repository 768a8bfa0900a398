"""The parameter server against ddp: bytes per rank per step, counted, and samples/s, at 2, 3 and 4 ranks.

    python -m hvdtrain.bench.ps.driver [--workers 2,3,4] [--servers 1] [--width 512]

One mpirun job per worker count trains the same MLP (float32, synthetic data, the same batch per
worker) under strategy=ps and under ddp. The ps bytes are counted by the strategy itself from the
splits of the all-to-alls it issues and the received splits they return (PSStrategy.traffic(): to
and from other ranks; a rank's chunk to itself is a local copy). Beside them, the formulas with
Psi = the padded parameter bytes, N ranks, K servers, S = Psi / K:

  ps server     2 (N - 1) S + 2 (K - 1) S: a dedicated server's 2 x N x slice, less
                its own worker's slice, which never leaves the rank
  ps worker     2 K S = 2 Psi
  ddp (ring)    2 (N - 1) / N x Psi per rank, every rank alike

ddp's bytes are the ring's formula, not counted: Horovod's all-reduce runs inside its C++ engine
(Open MPI or Gloo choose the algorithm), where hvdtrain issues no splits to count. Samples/s are
the median of per-step rates over the measured steps, the job's every rank in lockstep (rank 0's clock).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Sequence

from hvdtrain.bench.common import jobs, report
from hvdtrain.launch.hostfile import Host
from hvdtrain.common.tables import format_table

WORKER = "hvdtrain.bench.ps.driver"
BATCH, FEATURES, CLASSES = 32, 64, 10


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", default="2,3,4", help="comma-separated worker counts, one job each (default: 2,3,4)")
    parser.add_argument("--servers", type=int, default=1, help="ps_servers of every job (default: 1)")
    parser.add_argument("--width", type=int, default=512, help="the MLP's hidden width (default: 512)")
    parser.add_argument("--steps", type=int, default=20, help="measured steps per strategy (default: 20)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per job (default: 300)")


def run(args: argparse.Namespace) -> int:
    results = []
    for np in [int(n) for n in args.workers.split(",")]:
        worker_args = ["--servers", str(args.servers), "--width", str(args.width), "--steps", str(args.steps)]
        hosts = [Host("localhost", np)] if np > (os.cpu_count() or 1) else []  # slots for np > cores
        results.append(jobs.run_job(WORKER, worker_args, np, "mpirun", args.timeout,
                                    env={"OMP_NUM_THREADS": "1"}, hosts=hosts))
    report.print_lines(table(results))
    return 0


def formulas(psi_bytes: int, np: int, servers: int, rank: int) -> int:
    """Bytes a rank sends plus receives per step under ps (see the module's text).

    Args:
        psi_bytes: the model's gradient bytes.
        np: ranks.
        servers: ranks that also serve.
        rank: the rank counted.
    """
    slice_bytes = psi_bytes // servers
    if rank < servers:
        return 2 * (np - 1) * slice_bytes + 2 * (servers - 1) * slice_bytes
    return 2 * servers * slice_bytes


def table(results: Sequence[Dict[str, Any]]) -> List[str]:
    rows = []
    for result in results:
        np, servers, psi = result["np"], result["servers"], result["psi_bytes"]
        ring = 2 * (np - 1) * psi / np
        for rank, (sent, received) in enumerate(result["traffic"]):
            role = "server" if rank < servers else "worker"
            rows.append([np, rank, role, sent, received, sent + received, formulas(psi, np, servers, rank),
                         2 * np * psi // servers if role == "server" else 2 * psi, round(ring),
                         result["samples_per_sec"]["ps"], result["samples_per_sec"]["ddp"]])
    headers = ["N", "rank", "ps role", "sent", "received", "ps total", "ps formula", "seed's 2N x slice / 2 Psi",
               "ddp ring 2(N-1)/N Psi", "ps samples/s", "ddp samples/s"]
    first = results[0] if results else {"psi_bytes": 0, "servers": 1}
    title = (f"Bytes per rank per step (ps: counted from the all-to-alls' splits; ddp: formula), Psi = "
             f"{first['psi_bytes']} bytes (padded, float32), {first['servers']} server(s)")
    return ["", format_table(headers, rows, title=title)]


# The worker: one job, every rank.

def measure(strategy, model, inputs, labels, steps: int) -> float:
    """Median samples/s of the job (global batch over rank 0's step time).

    Args:
        strategy: the ps strategy over ``model``.
        model: the model trained.
        inputs: one batch's inputs.
        labels: its labels.
        steps: timed steps.
    """
    import torch.nn.functional as F

    from hvdtrain.distributed import collectives

    rates = []
    for step in range(steps + 3):  # 3 warm-up steps
        collectives.barrier()
        started = time.perf_counter()
        strategy.zero_grad()
        strategy.backward(F.cross_entropy(model(inputs), labels))
        strategy.synchronize()
        strategy.step()
        if step >= 3:
            rates.append(BATCH * strategy.world.size / (time.perf_counter() - started))
    return sorted(rates)[len(rates) // 2]


def worker(argv: Sequence[str]) -> int:
    import torch
    from torch import nn

    from hvdtrain.distributed import collectives

    from hvdtrain.distributed import startup
    from hvdtrain.config.train import TrainConfig
    from hvdtrain.strategies import build_strategy

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--servers", type=int, default=1)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    world = startup.init(seed=0, threads=1)
    generator = torch.Generator().manual_seed(world.rank)
    inputs = torch.randn(BATCH, FEATURES, generator=generator)
    labels = torch.randint(0, CLASSES, (BATCH,), generator=generator)
    rates, traffic, psi = {}, [], 0
    for name in ("ps", "ddp"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(FEATURES, args.width), nn.Tanh(), nn.Linear(args.width, args.width),
                              nn.Tanh(), nn.Linear(args.width, CLASSES))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        options = {"ps_servers": args.servers} if name == "ps" else {}
        strategy = build_strategy(TrainConfig(strategy=name, **options), model, optimizer, world)
        strategy.broadcast_from_root()
        rates[name] = measure(strategy, model, inputs, labels, args.steps)
        if name == "ps":
            counted = strategy.traffic()
            rows = collectives.allgather_rows(torch.tensor([counted["sent"], counted["received"]]), name="bench.ps.traffic")
            traffic = [[int(v) for v in row] for row in rows]
            psi = sum(bucket.padded_numel * bucket.flat_param.element_size() for bucket in strategy.buckets)
    if world.is_root:
        jobs.write_result(Path(args.out), {"np": world.size, "servers": args.servers, "psi_bytes": psi,
                                           "traffic": traffic, "samples_per_sec": rates})
    return 0


def main(argv: Sequence[str]) -> int:
    return jobs.driver_or_worker(argv, worker, add_arguments, run, __doc__)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
