"""A training job whose ranks may each hold only BUDGET bytes per model parameter beyond what the
process holds before training (the runtime, the data, the model's parameters):

    mpirun -np 4 python tests/launch/oom_job.py STRATEGY BUDGET [--meta] [--tensor=T] [--pipeline=P]

The cap is RLIMIT_DATA (private memory: every tensor allocation counts), set after a warm-up,
so it measures what training adds: gradients, optimizer state and communication buffers. With
Adam in fp32, ddp adds 12 bytes per parameter (gradients 4, two moments 8) on every rank;
zero2 at 4 workers adds 3 (its 1/4 of the gradients and moments) plus transient buffers.

With --meta the model is built on the meta device, deeper and narrower (smaller fsdp units), and
trained with plain SGD: the cap then counts the parameters themselves too, from their first byte.
--tensor and --pipeline split it over a T x P mesh: its linears alternately by columns and by rows,
its layers cut into stages.
"""
import contextlib
import resource
import sys

import horovod.torch as hvd
import torch
from torch import nn
from torch.utils.data import TensorDataset

import hvdtrain
from hvdtrain.config.train import TrainConfig
from hvdtrain.trainer import Trainer

WIDTH, DEPTH = 2048, 6  # 25.2M parameters: 101 MB of fp32 weights


def private_bytes() -> int:
    """VmData: the private memory RLIMIT_DATA counts."""
    for line in open("/proc/self/status"):
        if line.startswith("VmData:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmData in /proc/self/status")


def build(width: int, depth: int) -> nn.Module:
    return nn.Sequential(*[layer for _ in range(depth) for layer in (nn.Linear(width, width), nn.Tanh())],
                         nn.Linear(width, 10))


def alternating_plan(depth: int) -> dict:
    """The hidden linears (every other child of build's Sequential) in column/row pairs; the head whole."""
    return {str(2 * k): "colwise" if k % 2 == 0 else "rowwise" for k in range(depth - depth % 2)}


def main(strategy: str, budget_per_parameter: float, meta: bool, tensor: int = 1, pipeline: int = 1) -> None:
    world = hvdtrain.init(seed=0, threads=1, dynamic_process_sets=tensor * pipeline > 1)
    torch.manual_seed(0)
    width, depth = (WIDTH // 2, DEPTH * 8) if meta else (WIDTH, DEPTH)  # meta: 50.4M parameters, 48 units of 4 MB
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = build(width, depth)
    # A model on the meta device holds nothing yet, nor does an optimizer over it: built before the
    # cap, since torch's first optimizer takes ~70 MB of interpreter state (its imports) on its own.
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4) if meta else None
    data = TensorDataset(torch.randn(256, width), torch.randint(0, 10, (256,)))
    # Warm-up: the runtime's own first allocations (Horovod's fusion buffer, allocator arenas,
    # autograd) happen before the baseline, with a model of the same shape.
    warm = nn.Sequential(nn.Linear(width, width), nn.Linear(width, 10))
    warm(data.tensors[0][:8]).sum().backward()
    handles = [hvd.allreduce_async(p.grad, name=f"warm.{i}") for i, p in enumerate(warm.parameters())]
    for handle in handles:
        hvd.synchronize(handle)
    del warm, handles
    parameters = sum(p.numel() for p in model.parameters())
    cap = private_bytes() + int(budget_per_parameter * parameters)
    resource.setrlimit(resource.RLIMIT_DATA, (cap, resource.RLIM_INFINITY))

    config = TrainConfig(strategy=strategy, epochs=1, batch_size=8, max_steps=3, lr=1e-4, warmup_epochs=0,
                         stall_timeout=120, progress="log", log_every=1, run_dir=None, tensor_parallel=tensor,
                         pipeline_parallel=pipeline, micro_batches=2 if pipeline > 1 else 1)
    optimizer = optimizer or torch.optim.Adam(model.parameters(), lr=config.lr)
    plan = hvdtrain.ModelPlan(tensor_plan=alternating_plan(depth) if tensor > 1 else None)
    trainer = Trainer(model, optimizer, data, None, config, world=world, model_plan=plan,
                      loss_fn=torch.nn.functional.cross_entropy)
    trainer.fit()
    if world.is_root:
        layout = f" x tensor {tensor} x pipeline {pipeline}" if tensor * pipeline > 1 else ""
        print(f"trained {trainer.global_step} steps under {strategy}{layout} within {budget_per_parameter:g} bytes "
              f"per parameter", flush=True)
    if tensor * pipeline > 1:
        trainer.close_mesh()


if __name__ == "__main__":
    flags = dict(arg.lstrip("-").split("=") for arg in sys.argv[3:] if "=" in arg)
    main(sys.argv[1], float(sys.argv[2]), "--meta" in sys.argv[3:], int(flags.get("tensor", 1)),
         int(flags.get("pipeline", 1)))
