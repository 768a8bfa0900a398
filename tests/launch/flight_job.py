"""A job whose rank 1 skips a collective that rank 0 enters after step 3 (a callback's all-reduce
through hvdtrain's collectives): the ranks deadlock, the watchdog fires, every rank writes its
flight record into the run directory, and the verdict names rank 1 and the collective.

    mpirun -np 2 python tests/launch/flight_job.py RUN_PARENT STALL_TIMEOUT_SECONDS
"""
import sys

import torch
from torch.utils.data import TensorDataset

import hvdtrain
from hvdtrain.config.train import TrainConfig
from hvdtrain.distributed import collectives


class SkippedOnRankOne(hvdtrain.Callback):
    def on_step_end(self, trainer, step):
        if step == 3 and trainer.world.rank != 1:
            collectives.allreduce_sum(torch.ones(1), name="flight.extra")


world = hvdtrain.init(seed=0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
data = TensorDataset(torch.randn(256, 8, generator=torch.Generator().manual_seed(0)), torch.arange(256) % 2)
config = TrainConfig(epochs=100, batch_size=8, log_every=1000, stall_timeout=float(sys.argv[2]), run_dir=sys.argv[1],
                     run_name="flight", tensorboard=False, progress="off")
trainer = hvdtrain.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), data, None, config, world=world,
                           callbacks=[SkippedOnRankOne()])
trainer.fit()
