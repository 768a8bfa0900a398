"""One process training with its checkpoints (and run directory) where a storage fault test puts them.

    python tests/launch/storage_fault_job.py CHECKPOINT_DIR [--run-dir DIR] [--max-steps N] [--every N]
        [--keep N] [--checkpoint-timeout S] [--stall-timeout S] [--step-seconds S]

Prints "checkpoint N" (flushed) once the save of step N returned, and "done N" at the end, so a
test can follow it; every other setting is TrainConfig's default. The lease's beat comes from
HVDTRAIN_LEASE_BEAT in the environment, as for any run.
"""
import argparse
import time

import torch

import hvdtrain
from hvdtrain import Callback
from hvdtrain.config.train import TrainConfig


class Told(Callback):
    """Says each checkpoint, and makes each step last ``seconds`` (a test's window to act in)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step_end(self, trainer, step):
        time.sleep(self.seconds)

    def on_checkpoint(self, trainer, step):
        print(f"checkpoint {step}", flush=True)


parser = argparse.ArgumentParser()
parser.add_argument("checkpoint_dir")
parser.add_argument("--run-dir", default=None)
parser.add_argument("--max-steps", type=int, default=12)
parser.add_argument("--every", type=int, default=2)
parser.add_argument("--keep", type=int, default=3)
parser.add_argument("--checkpoint-timeout", type=float, default=600.0)
parser.add_argument("--stall-timeout", type=float, default=600.0)
parser.add_argument("--step-seconds", type=float, default=0.0)
args = parser.parse_args()

world = hvdtrain.init(seed=0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
data = torch.utils.data.TensorDataset(torch.randn(256, 8), torch.randint(0, 2, (256,)))
config = TrainConfig(epochs=1, batch_size=8, log_every=1000, checkpoint_dir=args.checkpoint_dir,
                     run_dir=args.run_dir, max_steps=args.max_steps, checkpoint_every=args.every,
                     keep_checkpoints=args.keep, checkpoint_timeout=args.checkpoint_timeout,
                     stall_timeout=args.stall_timeout, tensorboard=False)
trainer = hvdtrain.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), data, None, config, world=world,
                           callbacks=[Told(args.step_seconds)])
trainer.fit()
trainer.close()
print(f"done {trainer.global_step}", flush=True)
