"""The worker of ``hvdtrain doctor --gpu``: one mpirun job with a rank per GPU. Every check runs on
the device hvdtrain's start-up pins the rank to (``cuda:<local rank>``, or ``cuda:0`` when a task
sees one GPU), through Horovod on that device's tensors (NCCL on a GPU). Rank 0 writes the raw
figures as JSON (``--out``); hvdtrain.launch.gpu_selftest turns them into verdicts.

Nothing here names a device: the same code runs on the CPU when no GPU is visible, which is how
the tests run every check on this machine (tests/launch/test_gpu_selftest.py).

    python -m hvdtrain.bench.gpu.worker --out FILE [--sizes 1048576,33554432] [--iters 10]
    python -m hvdtrain.bench.gpu.worker --out FILE --one-gpu-per-rank

``--one-gpu-per-rank``: the other way sites hand out GPUs (srun --gpus-per-task=1, or a wrapper
setting CUDA_VISIBLE_DEVICES per rank). Before Horovod or CUDA start, each rank keeps only its local
rank's entry of the GPUs the launch left visible, so it sees one GPU; then start-up and the pinning
check alone (every rank on cuda:0, each on its own GPU). A job of its own: CUDA reads
CUDA_VISIBLE_DEVICES once, when it starts.

Checks, in order (each one's failure is recorded, and the next still runs):
  pinning         each rank's device, its current CUDA device and its GPU's UUID
  allreduce       a Sum all-reduce per size, checked for the right sum, then timed (slowest rank's
                  mean per call, the device synchronized before the clock stops)
  strategies      ddp, zero1, zero2, fsdp, ps: N ranks x batch B against one process x batch N*B,
                  in float64 (tests/mpi/test_equivalence.py's comparison; ps with one server, rank 0)
  model_parallel  T=2 and P=2 (where the world divides): the example transformer against one
                  process (tests/mpi/test_model_parallel.py's comparison)
  precision       bf16 and fp16 steps against the same steps in fp32
  memory          the CUDA allocator's peaks per rank after all the above, and the peak RSS
"""
from __future__ import annotations

import argparse
import copy
import os
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, MutableMapping, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from hvdtrain.bench.common.jobs import write_result
from hvdtrain.common.units import MiB

DEFAULT_SIZES = (1 * MiB, 32 * MiB, 256 * MiB)
STRATEGIES = ("ddp", "zero1", "zero2", "fsdp", "ps")
MESHES = {"T=2": (2, 1), "P=2": (1, 2)}
PRECISIONS = ("bf16", "fp16")
BATCH, STEPS, SEED = 4, 5, 11


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--sizes", default=",".join(str(s) for s in DEFAULT_SIZES),
                        help="all-reduce sizes in bytes per rank, comma-separated")
    parser.add_argument("--iters", type=int, default=10, help="timed all-reduces per size")
    parser.add_argument("--warmup", type=int, default=3, help="untimed all-reduces per size")
    parser.add_argument("--one-gpu-per-rank", action="store_true",
                        help="each rank sees only its local rank's GPU; start-up and the pinning check alone")
    return parser.parse_args(argv)


def gpu_of_local_rank(local_rank: Optional[int], visible: Optional[str]) -> str:
    """The CUDA_VISIBLE_DEVICES of one rank given one GPU: its local rank's entry of ``visible``
    (the launch's CUDA_VISIBLE_DEVICES, indices or UUIDs), or its local rank when the launch set none."""
    if local_rank is None:
        raise ValueError("--one-gpu-per-rank needs the launcher's local rank (OMPI_COMM_WORLD_LOCAL_RANK, "
                         "HOROVOD_LOCAL_RANK, SLURM_LOCALID...): start the worker under mpirun, horovodrun or srun")
    if visible is None:
        return str(local_rank)
    entries = [entry.strip() for entry in visible.split(",") if entry.strip()]
    if local_rank >= len(entries):
        raise ValueError(f"local rank {local_rank} has no GPU of its own: CUDA_VISIBLE_DEVICES={visible!r} lists "
                         f"{len(entries)}; start at most one rank per listed GPU")
    return entries[local_rank]


def keep_one_gpu(environ: MutableMapping[str, str]) -> None:
    """What a site's wrapper does before the program starts: this rank's GPU alone in CUDA_VISIBLE_DEVICES.
    Only before CUDA starts (it reads the variable once); torch starts it lazily, at the first query."""
    from hvdtrain.distributed import environments

    if torch.cuda.is_initialized():
        raise RuntimeError("CUDA started before --one-gpu-per-rank could set CUDA_VISIBLE_DEVICES")
    environ["CUDA_VISIBLE_DEVICES"] = gpu_of_local_rank(environments.detect(environ).local_rank(),
                                                        environ.get("CUDA_VISIBLE_DEVICES"))


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work: a GPU's kernels run after the call that queued them returns."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def max_difference(found: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor]) -> float:
    return max((found[name].detach().double().cpu() - expected[name].detach().double().cpu()).abs().max().item()
               for name in expected)


def guarded(check: Callable[[], Dict[str, Any]]) -> Dict[str, Any]:
    """A check's figures, or its error: one broken check must not hide the others' results."""
    try:
        return check()
    except Exception as error:  # the verdict is FAIL with this message; the traceback goes to the log
        traceback.print_exc()
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"}


# ---- pinning ----------------------------------------------------------------------------------

def pinning(world) -> Dict[str, Any]:
    from hvdtrain.distributed import collectives
    from hvdtrain.distributed.devices import shared_gpus

    device = world.device
    mine = {"rank": world.rank, "host": world.hostname, "device": str(device), "local_rank": world.local_rank,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "current": torch.cuda.current_device() if device.type == "cuda" else None,
            "uuid": str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else None,
            "visible": torch.cuda.device_count() if torch.cuda.is_available() else 0}
    ranks = collectives.allgather_object(mine, name="selftest.pinning")
    return {"pinning": ranks,
            "shared": shared_gpus([(r["rank"], r["host"], r["uuid"]) for r in ranks if r["uuid"]])}


# ---- all-reduce -------------------------------------------------------------------------------

def allreduce(world, size_bytes: int, iters: int, warmup: int) -> Dict[str, Any]:
    """One size: the sum checked once, then ``iters`` calls timed (the slowest rank's mean).

    Args:
        world: this rank's World.
        size_bytes: the tensor's size in bytes.
        iters: timed calls.
        warmup: untimed calls first.
    """
    import horovod.torch as hvd

    from hvdtrain.distributed import collectives

    device, name = world.device, f"selftest.allreduce.{size_bytes}"
    elements = max(1, size_bytes // 4)
    tensor = torch.full((elements,), float(world.rank + 1), dtype=torch.float32, device=device)
    expected = world.size * (world.size + 1) / 2  # exact in float32 at any sane world size
    reduced = hvd.allreduce(tensor, op=hvd.Sum, name=name)
    wrong = int((reduced != expected).sum().item())
    for _ in range(warmup):
        hvd.allreduce(tensor, op=hvd.Sum, name=name)
    collectives.barrier()
    synchronize(device)
    started = time.perf_counter()
    for _ in range(iters):
        hvd.allreduce(tensor, op=hvd.Sum, name=name)
    synchronize(device)
    mean = (time.perf_counter() - started) / iters
    everyone = collectives.allgather_object((mean, wrong), name=f"{name}.result")
    errors = [f"rank {rank}: {count} of {elements} elements not {expected:g}"
              for rank, (_, count) in enumerate(everyone) if count]
    return {"bytes": elements * 4, "seconds": max(seconds for seconds, _ in everyone), "iters": iters,
            "correct": not errors, "detail": "; ".join(errors)}


# ---- data parallel strategies -----------------------------------------------------------------

def classification_data(samples: int = 192, features: int = 12, classes: int = 4,
                        dtype: torch.dtype = torch.float64) -> TensorDataset:
    """A fixed, learnable data set, the same on every rank (tests/mpi/helpers.py's).

    Args:
        samples: samples in the set.
        features: input features per sample.
        classes: label classes.
        dtype: the inputs' dtype.
    """
    generator = torch.Generator().manual_seed(2024)
    inputs = torch.randn(samples, features, generator=generator, dtype=dtype)
    labels = (inputs @ torch.randn(features, classes, generator=generator, dtype=dtype)).argmax(dim=1)
    return TensorDataset(inputs, labels)


def small_mlp(seed: int, dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 4)).to(dtype)


def one_process(initial: Dict[str, torch.Tensor], model: nn.Module, optimizer: torch.optim.Optimizer,
                data: TensorDataset, loss_fn, global_batch: int, steps: int, device: torch.device) -> List[float]:
    """The reference: the same samples in the samplers' global order, a global batch at a time,
    on this rank's device, without Horovod. Returns the per-step losses.

    Args:
        initial: the parameters' starting values, loaded into ``model`` first.
        model: the model to train.
        optimizer: its optimizer.
        data: the whole data set.
        loss_fn: loss(outputs, labels).
        global_batch: samples per step (every rank's together).
        steps: optimizer steps.
        device: where to compute.
    """
    from hvdtrain.data.sharding import ShardedSampler

    model.load_state_dict(initial)
    sampler = ShardedSampler(len(data), rank=0, world_size=1, seed=SEED)
    sampler.set_epoch(0)
    order = list(sampler)
    inputs, targets = (t.to(device) for t in data.tensors)
    losses = []
    for step in range(steps):
        batch = torch.tensor(order[step * global_batch:(step + 1) * global_batch], device=device)
        if len(batch) != global_batch:
            raise ValueError(f"the reference ran out of samples at step {step}: shrink the check")
        optimizer.zero_grad()
        loss = loss_fn(model(inputs[batch]), targets[batch])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def spread(world, result: Dict[str, Any], name: str) -> Dict[str, Any]:
    """The worst figures over every rank (each rank compares what it holds)."""
    from hvdtrain.distributed import collectives

    everyone = collectives.allgather_object(result, name=name)
    return {"worst": max(r["worst"] for r in everyone), "moved": min(r["moved"] for r in everyone),
            "where": f"{world.size} ranks"}


def strategy_equivalence(world, strategy: str) -> Dict[str, Any]:
    from hvdtrain.config.train import TrainConfig
    from hvdtrain.trainer import Trainer

    data = classification_data()
    model = small_mlp(seed=100 + world.rank)  # different on every rank: the set-up must broadcast rank 0's
    config = TrainConfig(epochs=1, batch_size=BATCH, lr=0.01, strategy=strategy, scale_lr=False, warmup_epochs=0,
                         max_steps=STEPS, seed=SEED, log_every=10**9, progress="off")
    trainer = Trainer(model, torch.optim.Adam(model.parameters(), lr=0.01), data, None, config, world=world)
    initial = copy.deepcopy(trainer.strategy.state_dict()["model"])
    trainer.fit()
    final = trainer.strategy.state_dict()["model"]
    trainer.close()
    reference = small_mlp(seed=0).to(world.device)
    one_process(initial, reference, torch.optim.Adam(reference.parameters(), lr=0.01), data, F.cross_entropy,
                BATCH * world.size, STEPS, world.device)
    expected = reference.state_dict()
    return spread(world, {"worst": max_difference(final, expected), "moved": max_difference(expected, initial)},
                  name=f"selftest.strategy.{strategy}")


# ---- model parallel ---------------------------------------------------------------------------

VOCAB, SEQ, WIDTH, HEADS, BLOCKS = 11, 8, 16, 4, 2


def transformer(seed: int) -> nn.Module:
    from hvdtrain.examples.textlm import TinyTransformerLM

    torch.manual_seed(seed)
    return TinyTransformerLM(VOCAB, seq_len=SEQ, d_model=WIDTH, layers=BLOCKS, heads=HEADS).double()


def token_data(samples: int = 96) -> TensorDataset:
    ids = torch.randint(0, VOCAB, (samples, SEQ + 1), generator=torch.Generator().manual_seed(3))
    return TensorDataset(ids[:, :-1], ids[:, 1:])


def mesh_equivalence(world, tensor: int, pipeline: int) -> Dict[str, Any]:
    from hvdtrain.config.train import TrainConfig
    from hvdtrain.examples.textlm import lm_loss
    from hvdtrain.examples.textlm_parallel import pipeline_layers, tensor_plan
    from hvdtrain.parallel.model_plan import ModelPlan
    from hvdtrain.trainer import Trainer

    if world.size % (tensor * pipeline):
        return {"skipped": f"T={tensor} x P={pipeline} needs a multiple of {tensor * pipeline} GPUs, "
                           f"{world.size} visible", "where": f"{world.size} ranks"}
    data = token_data()
    model = transformer(seed=100 + world.rank)
    config = TrainConfig(epochs=1, batch_size=BATCH, lr=0.01, scale_lr=False, warmup_epochs=0, max_steps=STEPS,
                         seed=SEED, log_every=10**9, progress="off", tensor_parallel=tensor,
                         pipeline_parallel=pipeline, micro_batches=2 if pipeline > 1 else 1)
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=0.01), data, None, config, world=world,
                      loss_fn=lm_loss, model_plan=ModelPlan(tensor_plan=tensor_plan(model),
                                                            pipeline_layers=pipeline_layers))
    initial = copy.deepcopy(trainer.strategy.state_dict()["model"])
    trainer.fit()
    final = trainer.strategy.state_dict()["model"]  # gathered whole from every rank's part
    data_width = trainer.parts.topology.mesh.shape.data
    trainer.close()
    trainer.close_mesh()
    reference = transformer(seed=0).to(world.device)
    one_process(initial, reference, torch.optim.AdamW(reference.parameters(), lr=0.01), data, lm_loss,
                BATCH * data_width, STEPS, world.device)
    expected = reference.state_dict()
    return spread(world, {"worst": max_difference(final, expected), "moved": max_difference(expected, initial)},
                  name=f"selftest.mesh.{tensor}x{pipeline}")


# ---- mixed precision --------------------------------------------------------------------------

def train_in(world, precision: str, steps: int = 8):
    from hvdtrain.config.train import TrainConfig
    from hvdtrain.trainer import Trainer

    model = small_mlp(seed=0, dtype=torch.float32)
    config = TrainConfig(epochs=1, batch_size=BATCH, lr=0.1, scale_lr=False, warmup_epochs=0, max_steps=steps,
                         seed=SEED, log_every=10**9, progress="off", precision=precision)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                      classification_data(dtype=torch.float32), None, config, world=world)
    initial = copy.deepcopy(trainer.strategy.state_dict()["model"])
    trainer.fit()
    final = trainer.strategy.state_dict()["model"]
    trainer.close()
    return initial, final, trainer.parts.precision.skipped_steps, steps


def precision_steps(world, precision: str) -> Dict[str, Any]:
    from hvdtrain.distributed import collectives

    initial, baseline, _, _ = train_in(world, "fp32")
    _, final, skipped, steps = train_in(world, precision)
    mine = {"worst": max_difference(final, baseline), "moved": max_difference(baseline, initial),
            "finite": all(torch.isfinite(t).all().item() for t in final.values()), "skipped": skipped}
    everyone = collectives.allgather_object(mine, name=f"selftest.precision.{precision}")
    return {"worst": max(r["worst"] for r in everyone), "moved": min(r["moved"] for r in everyone),
            "finite": all(r["finite"] for r in everyone), "skipped_steps": max(r["skipped"] for r in everyone),
            "steps": steps, "where": f"{world.size} ranks"}


# ---- memory -----------------------------------------------------------------------------------

def memory_peaks(world) -> List[Dict[str, Any]]:
    from hvdtrain.distributed import collectives
    from hvdtrain.distributed.devices import device_peaks
    from hvdtrain.observability.memory import peak_rss_bytes

    mine = {"rank": world.rank, "peak_rss": peak_rss_bytes(), **device_peaks(world.device)}
    if world.device.type == "cuda":
        mine["total"] = torch.cuda.get_device_properties(world.device).total_memory
    return collectives.allgather_object(mine, name="selftest.memory")


# ---- the job ----------------------------------------------------------------------------------

def run_one_gpu_per_rank() -> Dict[str, Any]:
    """Start-up and the pinning check, each rank seeing one GPU (``keep_one_gpu`` ran first)."""
    from hvdtrain.distributed import startup

    world = startup.init(seed=SEED)
    return {"ranks": world.size, **pinning(world)}


def run(args: argparse.Namespace) -> Dict[str, Any]:
    import horovod
    import horovod.torch as hvd

    from hvdtrain.distributed import startup

    world = startup.init(seed=SEED, dynamic_process_sets=True)  # process sets: the T=2 / P=2 meshes
    found: Dict[str, Any] = {
        "ranks": world.size, "horovod": horovod.__version__, "torch": torch.__version__,
        "torch_cuda": torch.version.cuda, "nccl_built": bool(hvd.nccl_built()),
        "gpu_name": torch.cuda.get_device_name(world.device) if world.device.type == "cuda" else None,
    }
    found.update(pinning(world))
    found["allreduce"] = []
    for size in (int(part) for part in args.sizes.split(",")):
        measured = guarded(lambda: allreduce(world, size, args.iters, args.warmup))
        if "error" in measured:
            measured = {"bytes": size, "seconds": 0.0, "correct": False, "detail": measured["error"]}
        found["allreduce"].append(measured)
    found["strategies"] = {name: guarded(lambda: strategy_equivalence(world, name)) for name in STRATEGIES}
    found["model_parallel"] = {name: guarded(lambda: mesh_equivalence(world, *layout))
                               for name, layout in MESHES.items()}
    found["precision"] = {name: guarded(lambda: precision_steps(world, name)) for name in PRECISIONS}
    found["memory"] = memory_peaks(world)
    return found


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.one_gpu_per_rank:
        keep_one_gpu(os.environ)  # first: before Horovod and CUDA start
    import horovod.torch as hvd

    found = run_one_gpu_per_rank() if args.one_gpu_per_rank else run(args)
    if hvd.rank() == 0:  # rank 0 owns the result file
        write_result(args.out, found)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
