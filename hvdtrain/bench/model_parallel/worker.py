"""The worker of ``hvdtrain bench model-parallel``: one mpirun job, every rank; rank 0 writes the
raw per-step figures as JSON (``--out``), the driver (hvdtrain.bench.model_parallel.driver) summarises.

    python -m hvdtrain.bench.model_parallel.worker --out FILE --mode pipeline|tensor|memory [...]

Every mode builds the example transformer (TinyTransformerLM, float32, dropout 0) through the
Trainer's ModelParallelStrategy, on synthetic token ids (nothing downloads). Steps are driven here,
not by ``fit()``, so that each one can be timed alone: a world barrier, then the timed part.

  pipeline  P stages (world = P). Per configuration (schedule x micro-batches M, the same batch per
            worker: a micro-batch shrinks as M grows) and step: the schedule's wall time (the
            PipelinedModel's train_batch: every forward, backward and exchange of the step, the
            tied gradients' sum and the loss broadcast), and the stage's ScheduleStats (compute_s,
            wait_s, max_in_flight). Configurations interleave in rounds with a rotating start.
            The optimizer's update is not run: it is no part of the bubble.
  schedules P stages (world = P). Each schedule variant (``--variants``: 1f1b, 1f1b:v2 the
            interleaved 1F1B with 2 chunks per stage, zb-h1) on its own stages of a fresh copy of
            the model, over one mesh, at every M (interleaved: M a multiple of P), interleaved in
            rounds as above; per step the wall time and the ScheduleStats, whose wait_s is the
            time the stage waited in receives (and for its sends to be taken).
  tensor    T = world. Per step: wall time of forward + backward, and the time and bytes of the
            tensor group's all-reduces (Megatron's f and g), timed by wrapping the one function
            through which they all go (hvdtrain.parallel.tensor.layers._allreduce_sum; hvd.allreduce
            returns when the reduction is done, so its time is the step's time in it, waiting for
            the peer included). Interleaved with steps of the whole, unsplit model on each rank
            alone (no communication): the T = 1 reference under the same load; and with steps of
            the same all-reduces alone (count and size), each after a barrier: their transfer
            time without the wait for a peer that is still computing.
  memory    For each layout (T, P) at this world size: parameter bytes per rank from
            ``strategy.memory_bytes()["parameters"]`` (counted from storages), with the layers the
            rank's stage holds, so the driver can account for every byte.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from hvdtrain.bench.common import jobs, lm_workload
from hvdtrain.bench.common.lm_workload import build_model, dims, token_batch

MODES = ("pipeline", "schedules", "tensor", "memory")
SCHEDULES = ("gpipe", "1f1b")
# What shapes the timings besides the model: recorded with them (hvdtrain's startup.init sets the first).
ENVIRONMENT = ("OMPI_MCA_mpi_yield_when_idle", "HOROVOD_CYCLE_TIME", "HOROVOD_FUSION_THRESHOLD", "OMP_NUM_THREADS")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--mode", required=True, choices=MODES)
    lm_workload.add_model_arguments(parser, d_model=256, layers=4)
    parser.add_argument("--batch", type=int, default=16, help="samples per worker (per model replica) per step")
    parser.add_argument("--micro-batches", default="1,2,4,8")
    parser.add_argument("--layouts", default="1x1,2x1,1x2,2x2,4x1,1x4", help="memory mode: TxP, comma-separated")
    parser.add_argument("--variants", default="1f1b,1f1b:v2,zb-h1",
                        help="schedules mode: schedule[:vN] (N chunks per stage), comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="measured steps per configuration per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before each configuration's")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def make_trainer(args: argparse.Namespace, world, tensor: int, pipeline: int):
    """A Trainer of the benchmark's model over a T x P mesh of ``world``, with its plan.

    Args:
        args: the worker's options (the model's size, batch, schedule).
        world: this rank's World.
        tensor: T, the tensor-parallel size.
        pipeline: P, the pipeline stages.
    """
    import torch
    from torch.utils.data import TensorDataset

    from hvdtrain.config.train import TrainConfig
    from hvdtrain.examples.textlm import lm_loss
    from hvdtrain.examples.textlm_parallel import pipeline_layers, tensor_plan
    from hvdtrain.parallel.model_plan import ModelPlan
    from hvdtrain.trainer import Trainer

    model = build_model(args)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    dataset = TensorDataset(*token_batch(args, args.batch * world.size))
    config = TrainConfig(epochs=1, batch_size=args.batch, lr=1e-3, max_steps=1, log_every=10**9, progress="off",
                         seed=args.seed, tensor_parallel=tensor, pipeline_parallel=pipeline)
    return Trainer(model, optimizer, dataset, config=config, loss_fn=lm_loss, world=world,
                   model_plan=ModelPlan(tensor_plan=tensor_plan(model) if tensor > 1 else None,
                                        pipeline_layers=pipeline_layers if pipeline > 1 else None))


def rotated(items: List[Any], start: int) -> List[Any]:
    start %= len(items)
    return items[start:] + items[:start]


# ---- the modes --------------------------------------------------------------------------------

def run_pipeline(args: argparse.Namespace, world) -> Dict[str, Any]:
    from hvdtrain.distributed import collectives
    trainer = make_trainer(args, world, tensor=1, pipeline=world.size)
    strategy, pipeline = trainer.strategy, trainer.strategy.pipeline
    batch = token_batch(args, args.batch)
    configs = [(schedule, m) for m in (int(v) for v in args.micro_batches.split(",")) for schedule in SCHEDULES]
    steps: Dict[str, List[List[float]]] = {f"{s}/{m}": [] for s, m in configs}
    for round_ in range(args.rounds):
        for schedule, m in rotated(configs, round_):
            pipeline.schedule, pipeline.micro_batches = schedule, m
            steps[f"{schedule}/{m}"] += timed_steps(pipeline, strategy.zero_grad, batch, args.warmup, args.steps)
    mine = {"rank": world.rank, "stage": strategy.mesh.stage, "layers": list(pipeline.module.indices),
            "steps": steps}
    return {"pipeline": world.size, "per_rank": collectives.allgather_object(mine, name="bench.mp.pipeline")}


def parse_variant(text: str) -> Tuple[str, int]:
    """``1f1b:v2`` -> ("1f1b", 2); ``zb-h1`` -> ("zb-h1", 1)."""
    schedule, _, virtual = text.strip().partition(":v")
    return schedule, int(virtual) if virtual else 1


def schedule_configs(variants: Sequence[str], micro_batches: Sequence[int], stages: int) -> List[Tuple[str, int]]:
    """(variant, M) pairs to run: an interleaved variant only at M a multiple of P (it refuses others)."""
    return [(variant, m) for m in micro_batches for variant in variants
            if parse_variant(variant)[1] == 1 or m % stages == 0]


def run_schedules(args: argparse.Namespace, world) -> Dict[str, Any]:
    from hvdtrain.distributed import collectives
    from hvdtrain.examples.textlm import lm_loss
    from hvdtrain.examples.textlm_parallel import pipeline_layers
    from hvdtrain.parallel.mesh import Mesh
    from hvdtrain.parallel.pipeline.schedule import PipelineStage
    from hvdtrain.parallel.pipeline.stage import PipelinedModel

    mesh = Mesh.build(world.size, world.rank, pipeline=world.size)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    pipelines = {}
    for variant in variants:  # each on its own copy of the model: a stage keeps its layers' parameters
        schedule, virtual = parse_variant(variant)
        model = build_model(args)
        stage = PipelineStage(pipeline_layers(model), mesh, virtual=virtual)
        pipelines[variant] = PipelinedModel(stage, mesh, lm_loss, 1, schedule, model)
    batch = token_batch(args, args.batch)
    configs = schedule_configs(variants, [int(v) for v in args.micro_batches.split(",")], world.size)
    steps: Dict[str, List[List[float]]] = {f"{v}/{m}": [] for v, m in configs}
    for round_ in range(args.rounds):
        for variant, m in rotated(configs, round_):
            pipeline = pipelines[variant]
            pipeline.micro_batches = m
            steps[f"{variant}/{m}"] += timed_steps(pipeline, lambda: pipeline.module.zero_grad(set_to_none=True), batch,
                                                   args.warmup, args.steps)
    mine = {"rank": world.rank, "stage": mesh.stage, "steps": steps}
    gathered = collectives.allgather_object(mine, name="bench.mp.schedules")
    mesh.close()
    return {"pipeline": world.size, "variants": variants, "per_rank": gathered}


class AllreduceTimer:
    """Wraps hvdtrain.parallel.tensor.layers's one all-reduce function: seconds, bytes and calls."""

    def __init__(self) -> None:
        import hvdtrain.parallel.tensor.layers as tensor_module

        if not callable(getattr(tensor_module, "_allreduce_sum", None)):
            raise RuntimeError("hvdtrain.parallel.tensor.layers has no _allreduce_sum for f and g to route through: "
                               "time its all-reduces where it issues them")
        self.module, self.original = tensor_module, tensor_module._allreduce_sum
        self.seconds, self.bytes, self.calls = 0.0, 0, 0

        def timed(tensor, group, name):
            started = time.perf_counter()
            out = self.original(tensor, group, name)
            self.seconds += time.perf_counter() - started
            self.bytes += tensor.numel() * tensor.element_size()
            self.calls += 1
            return out

        tensor_module._allreduce_sum = timed

    def take(self) -> List[float]:
        figures = [self.seconds, self.bytes, self.calls]
        self.seconds, self.bytes, self.calls = 0.0, 0, 0
        return figures

    def close(self) -> None:
        self.module._allreduce_sum = self.original


def run_tensor(args: argparse.Namespace, world) -> Dict[str, Any]:
    import torch

    from hvdtrain.distributed import collectives

    from hvdtrain.examples.textlm import lm_loss

    timer = AllreduceTimer()
    trainer = make_trainer(args, world, tensor=world.size, pipeline=1)
    split, whole = trainer.model, build_model(args)  # whole: the T = 1 reference, on each rank alone
    inputs, targets = token_batch(args, args.batch)
    variants = {"tensor": split, "whole": whole, "isolated": None}
    steps: Dict[str, List[List[float]]] = {name: [] for name in variants}
    group, step_calls = trainer.parts.topology.mesh.tensor, 4 * args.layers
    payload = torch.randn(args.batch, args.seq_len, args.d_model)
    timer.take()
    for round_ in range(args.rounds):
        for name in rotated(list(variants), round_):
            model = variants[name]
            for i in range(args.warmup + args.steps):
                if model is None:
                    # A step's all-reduces alone (same count and size), each after a barrier: the
                    # transfer without the wait for a peer still computing.
                    seconds = 0.0
                    for call in range(step_calls):
                        collectives.barrier()
                        started = time.perf_counter()
                        timer.original(payload, group, f"bench.mp.isolated.{call}")
                        seconds += time.perf_counter() - started
                    if i >= args.warmup:
                        steps[name].append([seconds, seconds, payload.numel() * payload.element_size() * step_calls,
                                             step_calls])
                    continue
                model.zero_grad(set_to_none=True)
                collectives.barrier()
                timer.take()
                started = time.perf_counter()
                lm_loss(model(inputs), targets).backward()
                wall = time.perf_counter() - started
                seconds, moved, calls = timer.take()
                if i >= args.warmup:
                    steps[name].append([wall, seconds, moved, calls])
    timer.close()
    mine = {"rank": world.rank, "steps": steps}
    return {"tensor": world.size, "per_rank": collectives.allgather_object(mine, name="bench.mp.tensor")}


def run_memory(args: argparse.Namespace, world) -> Dict[str, Any]:
    from hvdtrain.distributed import collectives
    layouts = []
    for text in args.layouts.split(","):
        tensor, pipeline = (int(v) for v in text.lower().split("x"))
        trainer = make_trainer(args, world, tensor, pipeline)
        strategy = trainer.strategy
        pipelined = getattr(strategy, "pipeline", None)
        held = list(pipelined.module.indices) if pipelined is not None else list(range(args.layers + 2))
        mesh = getattr(strategy, "mesh", None)
        coordinates = list(mesh.coordinates) if mesh is not None else [world.rank, 0, 0]
        mine = {"rank": world.rank, "coordinates": coordinates, "layers": held,
                "parameters": strategy.memory_bytes()["parameters"]}
        layouts.append({"tensor": tensor, "pipeline": pipeline,
                        "per_rank": collectives.allgather_object(mine, name=f"bench.mp.memory.{text}")})
        trainer.close()
        if mesh is not None:
            mesh.close()
    return {"layouts": layouts}


def main(argv: Optional[Sequence[str]] = None) -> int:
    from hvdtrain.distributed import startup
    args = parse_args(argv)
    world = startup.init(seed=args.seed, threads=1, dynamic_process_sets=True)
    result = {"pipeline": run_pipeline, "schedules": run_schedules, "tensor": run_tensor,
              "memory": run_memory}[args.mode](args, world)
    if world.is_root:
        jobs.write_result(args.out, {"mode": args.mode, "np": world.size, "dims": dims(args), "batch": args.batch,
                                     "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup,
                                     "environment": {key: os.environ.get(key) for key in ENVIRONMENT}, **result})
    return 0

def timed_steps(pipeline, zero_grad, batch, warmup: int, steps: int) -> list:
    """``warmup`` then ``steps`` training steps of ``pipeline``, each started together on every rank
    (a barrier); per timed step [wall s, compute s, wait s, most micro-batches held].

    Args:
        pipeline: the pipeline strategy's step (train_batch) and module (its stats).
        zero_grad: clears the gradients before each step.
        batch: the step's batch.
        warmup: untimed steps first.
        steps: timed steps.
    """
    from hvdtrain.distributed import collectives

    rows = []
    for i in range(warmup + steps):
        zero_grad()
        collectives.barrier()
        started = time.perf_counter()
        pipeline.train_batch(batch, contextlib.nullcontext, 1)
        wall = time.perf_counter() - started
        stats = pipeline.module.stats
        if i >= warmup:
            rows.append([wall, stats.compute_s, stats.wait_s, stats.max_in_flight])
    return rows


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))

