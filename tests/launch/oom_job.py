"""A training job whose ranks may each hold only BUDGET bytes per model parameter beyond what the
process holds before training (the runtime, the data, the model's parameters):

    mpirun -np 4 python tests/launch/oom_job.py STRATEGY BUDGET [--meta] [--tensor=T] [--pipeline=P]

The cap is RLIMIT_DATA (private memory: every tensor allocation counts), set after a warm-up,
so it measures what training adds: gradients, optimizer state and communication buffers. With
Adam in fp32, ddp adds 12 bytes per parameter (gradients 4, two moments 8) on every rank;
zero2 at 4 workers adds 3 (its 1/4 of the gradients and moments) plus transient buffers.

A rank that trained reports, after training (rank 0 prints one line per rank, "memory of rank R:
..."): its baseline (VmData and VmRSS when the cap was set), the cap, the peak RSS since then
(VmHWM, reset when the cap is set) against the cap counted as RSS (the RSS baseline plus the same
budget), and the most bytes the strategy counted in parameters, gradients and optimizer state
(``memory_bytes()``, sampled before every module's forward and at every gradient: each place where
a strategy allocates one of them) and what the Trainer's memory report counted after the first step.

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
from hvdtrain.distributed import collectives
from hvdtrain.trainer import Trainer

WIDTH, DEPTH = 2048, 6  # 25.2M parameters: 101 MB of fp32 weights


def status_bytes(field: str) -> int:
    """A size in /proc/self/status: VmData (the private memory RLIMIT_DATA counts), VmRSS (resident
    now), VmHWM (the peak resident since start, or since reset_peak_rss)."""
    for line in open("/proc/self/status"):
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak_rss() -> None:
    """VmHWM from now on (Linux >= 4.0): the warm-up's freed memory does not count."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


class CountedPeak:
    """The most bytes ``strategy.memory_bytes()`` counts during training: sampled after each module's
    pre-forward hooks (fsdp has gathered the unit and started the next one's gather) and at each
    parameter's gradient, before and after it is accumulated (fsdp has allocated the unit's full
    gradient; a mesh's .grad grows): the places where parameters, gradients or optimizer state
    (created in the first step, kept after) grow."""

    def __init__(self, strategy, model: nn.Module) -> None:
        self.strategy, self.peak = strategy, 0
        self.hooks = [module.register_forward_pre_hook(lambda *_: self.sample()) for module in model.modules()]
        for param in model.parameters():
            self.hooks.append(param.register_hook(lambda grad: self.sample()))
            self.hooks.append(param.register_post_accumulate_grad_hook(lambda param: self.sample()))

    def sample(self) -> None:
        self.peak = max(self.peak, sum(self.strategy.memory_bytes().values()))

    def close(self) -> None:
        for hook in self.hooks:
            hook.remove()


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
    budget = int(budget_per_parameter * parameters)
    reset_peak_rss()
    baseline = {"data": status_bytes("VmData"), "rss": status_bytes("VmRSS")}
    cap = baseline["data"] + budget
    resource.setrlimit(resource.RLIMIT_DATA, (cap, resource.RLIM_INFINITY))

    config = TrainConfig(strategy=strategy, epochs=1, batch_size=8, max_steps=3, lr=1e-4, warmup_epochs=0,
                         stall_timeout=120, progress="log", log_every=1, run_dir=None, tensor_parallel=tensor,
                         pipeline_parallel=pipeline, micro_batches=2 if pipeline > 1 else 1)
    optimizer = optimizer or torch.optim.Adam(model.parameters(), lr=config.lr)
    plan = hvdtrain.ModelPlan(tensor_plan=alternating_plan(depth) if tensor > 1 else None)
    trainer = Trainer(model, optimizer, data, None, config, world=world, model_plan=plan,
                      loss_fn=torch.nn.functional.cross_entropy)
    counted = CountedPeak(trainer.strategy, trainer.model)
    trainer.fit()
    counted.close()
    mine = {"baseline_data": baseline["data"], "baseline_rss": baseline["rss"], "cap": cap,
            "rss_cap": baseline["rss"] + budget, "peak_rss": status_bytes("VmHWM"), "peak_counted": counted.peak,
            "counted_after_first_step": trainer.parts.reporter.memory.per_rank[world.rank]["total"]}
    every = collectives.allgather_object(mine, name="oom_job.memory")
    if world.is_root:
        layout = f" x tensor {tensor} x pipeline {pipeline}" if tensor * pipeline > 1 else ""
        print(f"trained {trainer.global_step} steps under {strategy}{layout} within {budget_per_parameter:g} bytes "
              f"per parameter ({parameters} parameters)", flush=True)
        for rank, figures in enumerate(every):
            listed = ", ".join(f"{key} {value}" for key, value in figures.items())
            print(f"memory of rank {rank}: {listed}", flush=True)
    if tensor * pipeline > 1:
        trainer.close_mesh()


if __name__ == "__main__":
    flags = dict(arg.lstrip("-").split("=") for arg in sys.argv[3:] if "=" in arg)
    main(sys.argv[1], float(sys.argv[2]), "--meta" in sys.argv[3:], int(flags.get("tensor", 1)),
         int(flags.get("pipeline", 1)))
