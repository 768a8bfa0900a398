"""The worker of ``hvdtrain bench sequence``: one training step of the example transformer on
sequences of ``--length`` tokens, each rank capped at ``--cap-mib`` of memory beyond what it holds
before training (RLIMIT_DATA: every tensor allocation counts; set after a warm-up, as
tests/launch/oom_job.py does). S = 1 is data parallelism (each rank its own whole sequences), S > 1
sequence parallelism. Rank 0 writes, per rank, the activation bytes autograd saved for backward in
the step (saved_tensors_hooks; each storage once; parameters it keeps, a linear's weight, are not
activations) and the peak resident growth. A step that does not fit ends with hvdtrain's
out-of-memory report (non-zero exit).
"""
from __future__ import annotations

import argparse
import resource
import sys
from typing import Sequence

import horovod.torch as hvd
import torch

import hvdtrain
from hvdtrain.bench.common import jobs
from hvdtrain.config.train import TrainConfig
from hvdtrain.distributed import collectives
from hvdtrain.examples.textlm import TinyTransformerLM, lm_loss
from hvdtrain.trainer import Trainer

VOCAB, HEADS = 96, 8


def status_bytes(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


class SavedActivations:
    """Bytes autograd keeps for backward, each storage counted once; the model's parameters excluded."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.seen, self.bytes = {p.untyped_storage().data_ptr() for p in model.parameters()}, 0

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.seen:
            self.seen.add(storage.data_ptr())
            self.bytes += storage.nbytes()
        return tensor


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--sequence", type=int, required=True)
    parser.add_argument("--length", type=int, required=True)
    parser.add_argument("--cap-mib", type=float, required=True)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args(argv)
    world = hvdtrain.init(seed=0, threads=1, dynamic_process_sets=args.sequence > 1)
    torch.manual_seed(0)
    model = TinyTransformerLM(VOCAB, seq_len=args.length, d_model=args.d_model, layers=args.layers, heads=HEADS)
    ids = torch.randint(0, VOCAB, (8, args.length + 1), generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.TensorDataset(ids[:, :-1], ids[:, 1:])
    # Warm-up: the runtime's first allocations (autograd, allocator arenas, Horovod's fusion buffer).
    warm = TinyTransformerLM(VOCAB, seq_len=64, d_model=args.d_model, layers=1, heads=HEADS)
    lm_loss(warm(ids[:1, :64]), ids[:1, 1:65]).backward()
    handles = [hvd.allreduce_async(p.grad, name=f"warm.{i}") for i, p in enumerate(warm.parameters())]
    for handle in handles:
        hvd.synchronize(handle)
    del warm, handles
    with open("/proc/self/clear_refs", "w") as clear_refs:  # VmHWM from now on
        clear_refs.write("5")
    baseline = status_bytes("VmRSS")
    resource.setrlimit(resource.RLIMIT_DATA, (status_bytes("VmData") + int(args.cap_mib * 2**20), resource.RLIM_INFINITY))
    config = TrainConfig(epochs=1, batch_size=1, max_steps=1, lr=1e-3, warmup_epochs=0, stall_timeout=120,
                         progress="off", run_dir=None, tensorboard=False, sequence_parallel=args.sequence)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=1e-3), data, None, config, world=world,
                      loss_fn=lm_loss)
    saved = SavedActivations(trainer.model)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda tensor: tensor):
        trainer.fit()
    mine = {"activations": saved.bytes, "peak_rss_growth": status_bytes("VmHWM") - baseline}
    every = collectives.allgather_object(mine, name="bench.sequence.memory")
    if world.is_root:
        jobs.write_result(args.out, {"steps": trainer.global_step, "ranks": every})
    trainer.close_mesh()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
