"""The worker of ``hvdtrain bench plan``: rank 0 writes the raw timings as JSON (``--out``); the driver
(hvdtrain.bench.plan.driver) calibrates plan's model with them and compares.

    python -m hvdtrain.bench.plan.worker --out FILE --mode single|world --layouts ddp/1/1/1,...

Every rank runs one thread (``torch.set_num_threads(1)``) on the example transformer
(TinyTransformerLM, float32, dropout 0, Adam) and synthetic token ids (nothing downloads).

  single  one process, no Horovod: the plain step (forward, backward, Adam's update) of the whole
          model on ``--compute-batches`` samples: what plan's compute term models, alone on the machine.
  world   every rank of the launch, in this order:
          1. compute under load: the same plain step on every rank at once (no communication), on
             the batch a ddp rank gets: the per-rank rate when all ranks share the cores;
          2. all-reduce: in-place ``hvd.allreduce_`` (sum) of float32 tensors of ``--sizes`` bytes,
             each call after a barrier, the slowest rank's time;
          3. layouts: one Trainer per layout (strategy, tensor T, pipeline P, micro-batches M), all
             built first, then ``--rounds`` rounds in a rotating order; per round and layout
             ``--warmup`` untimed steps, then ``--segments`` timed runs of ``--steps`` steps, each
             after a barrier, the slowest rank's time divided by the steps.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from hvdtrain.bench.common import jobs, lm_workload
from hvdtrain.bench.common.lm_workload import build_model, token_batch

MODES = ("single", "world")


def parse_layout(text: str) -> Dict[str, Any]:
    """'ddp/2/1/1' -> strategy ddp, tensor 2, pipeline 1, micro-batches 1."""
    parts = text.split("/")
    if len(parts) != 4 or not all(p.isdigit() for p in parts[1:]):
        raise argparse.ArgumentTypeError(f"a layout is strategy/T/P/M like ddp/2/1/1, not {text!r}")
    return {"strategy": parts[0], "tensor": int(parts[1]), "pipeline": int(parts[2]), "micro_batches": int(parts[3])}


def format_layout(strategy: str, tensor: int, pipeline: int, micro_batches: int) -> str:
    """A layout's label, strategy/T/P/M.

    Args:
        strategy: the data-parallel strategy.
        tensor: T, the tensor-parallel size.
        pipeline: P, the pipeline stages.
        micro_batches: M, micro-batches per batch.
    """
    return f"{strategy}/{tensor}/{pipeline}/{micro_batches}"


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--mode", required=True, choices=MODES)
    lm_workload.add_model_arguments(parser, d_model=128, layers=2)
    parser.add_argument("--batch", type=int, default=16, help="global batch, samples per step")
    parser.add_argument("--compute-batches", default="16,4", help="single mode: batch sizes of the plain step")
    parser.add_argument("--layouts", default="", help="world mode: strategy/T/P/M, comma-separated")
    parser.add_argument("--sizes", default="4096,65536,262144,1048576,4194304", help="all-reduce bytes")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--segments", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.layout_list = [parse_layout(t) for t in args.layouts.split(",") if t.strip()]
    return args


def token_data(args: argparse.Namespace, samples: int):
    from torch.utils.data import TensorDataset

    return TensorDataset(*token_batch(args, samples))


def plain_step_s(args: argparse.Namespace, batch: int,
                 barrier: Callable[[], None] = lambda: None) -> Dict[str, List[float]]:
    """Seconds per plain step (forward, backward, Adam) of the whole model on ``batch`` samples
    (``step_s``) and of its Adam update alone (``update_s``, inside the same steps), one value per
    timed segment (each after ``barrier``): plan models the two apart, compute by FLOPs and the
    update by the bytes it streams."""
    import torch

    from hvdtrain.examples.textlm import lm_loss

    model = build_model(args)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    inputs, targets = token_batch(args, batch)

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        lm_loss(model(inputs), targets).backward()
        start = time.perf_counter()
        optimizer.step()
        return time.perf_counter() - start

    for _ in range(args.warmup + 1):
        step()
    out: Dict[str, List[float]] = {"step_s": [], "update_s": []}
    for _ in range(args.segments * 2):
        barrier()
        start = time.perf_counter()
        update = sum(step() for _ in range(args.steps))
        out["step_s"].append((time.perf_counter() - start) / args.steps)
        out["update_s"].append(update / args.steps)
    return out


def run_single(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    batches = [int(b) for b in args.compute_batches.split(",")]
    jobs.write_result(args.out, {"mode": "single", "threads": torch.get_num_threads(),
                                 "plain_step_s": {str(b): plain_step_s(args, b) for b in batches}})


def allreduce_s(sizes: Sequence[int], repeats: int, hvd) -> Dict[str, List[float]]:
    """Per size, the slowest rank's seconds of each in-place all-reduce (after a barrier)."""
    import torch

    tensors = {size: torch.ones(max(1, size // 4), dtype=torch.float32) for size in sizes}
    for _ in range(5):  # untimed: first calls negotiate, allocate and fault pages in, for every size
        for size, tensor in tensors.items():
            hvd.allreduce_(tensor, op=hvd.Sum, name=f"plan_check.{size}")
    out = {}
    for size, tensor in tensors.items():
        times = []
        for _ in range(repeats):
            hvd.barrier()
            start = time.perf_counter()
            hvd.allreduce_(tensor, op=hvd.Sum, name=f"plan_check.{size}")
            times.append(time.perf_counter() - start)
        slowest = hvd.allreduce(torch.tensor(times, dtype=torch.float64), op=hvd.Max, name=f"plan_check.t{size}")
        out[str(size)] = slowest.tolist()
    return out


def build_trainer(args: argparse.Namespace, layout: Dict[str, Any], world):
    import torch

    from hvdtrain.config.train import TrainConfig
    from hvdtrain.examples.textlm import lm_loss
    from hvdtrain.examples.textlm_parallel import pipeline_layers, tensor_plan
    from hvdtrain.parallel.model_plan import ModelPlan
    from hvdtrain.trainer import Trainer

    data = world.size // (layout["tensor"] * layout["pipeline"])
    model = build_model(args)
    config = TrainConfig(epochs=10 ** 6, batch_size=args.batch // data, lr=1e-3, scale_lr=False, warmup_epochs=0,
                         max_steps=args.warmup, seed=args.seed, log_every=10 ** 9, strategy=layout["strategy"],
                         tensor_parallel=layout["tensor"], pipeline_parallel=layout["pipeline"],
                         micro_batches=layout["micro_batches"])
    trainer = Trainer(model, torch.optim.Adam(model.parameters(), lr=1e-3), token_data(args, 64 * args.batch),
                      None, config, world=world, loss_fn=lm_loss,
                      model_plan=ModelPlan(tensor_plan=tensor_plan(model), pipeline_layers=pipeline_layers))
    trainer.fit()  # set-up and the first warm-up steps, untimed
    return trainer


def run_steps(trainer, n: int) -> None:
    trainer.fit(until_step=trainer.global_step + n)  # n more steps, continuing where the last fit stopped


def run_world(args: argparse.Namespace) -> None:
    import horovod.torch as hvd
    import torch

    from hvdtrain.distributed import collectives

    from hvdtrain.distributed import startup
    world = startup.init(seed=args.seed, threads=1, dynamic_process_sets=True)
    # 1. the plain step on every rank at once, a ddp rank's batch: compute under this launch's load
    local = plain_step_s(args, max(1, args.batch // world.size), collectives.barrier)
    slowest = {key: hvd.allreduce(torch.tensor(values, dtype=torch.float64), op=hvd.Max,
                                  name=f"plan_check.local.{key}").tolist()
               for key, values in sorted(local.items())}
    # 2. all-reduce sizes over the whole world
    sizes = [int(s) for s in args.sizes.split(",")]
    reduce = allreduce_s(sizes, 25, hvd)
    # 3. the layouts through the Trainer, interleaved in rounds with a rotating start
    names = [format_layout(**layout) for layout in args.layout_list]
    trainers = {name: build_trainer(args, layout, world) for name, layout in zip(names, args.layout_list)}
    per_step: Dict[str, List[float]] = {name: [] for name in names}
    order: List[List[str]] = []
    for round_index in range(args.rounds):
        shift = round_index % max(1, len(names))
        this_round = names[shift:] + names[:shift]
        order.append(this_round)
        for name in this_round:
            trainer = trainers[name]
            run_steps(trainer, args.warmup)
            for _ in range(args.segments):
                collectives.barrier()
                start = time.perf_counter()
                run_steps(trainer, args.steps)
                mine = (time.perf_counter() - start) / args.steps
                worst = hvd.allreduce(torch.tensor([mine], dtype=torch.float64), op=hvd.Max,
                                      name="plan_check.step")
                per_step[name].append(float(worst[0]))
    if world.is_root:
        jobs.write_result(args.out, {
            "mode": "world", "size": world.size, "controller": world.controller, "threads": torch.get_num_threads(),
            "local_step_s": slowest["step_s"], "local_update_s": slowest["update_s"], "local_batch": max(1, args.batch // world.size),
            "allreduce_s": reduce, "layout_step_s": per_step, "order": order,
            "steps_taken": {name: trainers[name].global_step for name in names}})


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    (run_single if args.mode == "single" else run_world)(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
