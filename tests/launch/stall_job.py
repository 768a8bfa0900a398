"""A job whose rank 1 stops calling collectives after a few steps: stuck in its data loading.

    mpirun -np 2 python tests/launch/stall_job.py STALL_TIMEOUT_SECONDS
"""
import sys
import time

import torch
from torch.utils.data import Dataset

import hvdtrain
from hvdtrain.config.train import TrainConfig


class StallsOnRankOne(Dataset):
    def __init__(self, rank: int) -> None:
        self.rank, self.served = rank, 0

    def __len__(self) -> int:
        return 512

    def __getitem__(self, index: int):
        self.served += 1
        if self.rank == 1 and self.served > 40:
            time.sleep(3600)  # a dead file system, a hung reader: this rank never reaches its step
        generator = torch.Generator().manual_seed(index)
        return torch.randn(8, generator=generator), index % 2


world = hvdtrain.init(seed=0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
config = TrainConfig(epochs=100, batch_size=8, log_every=1000, stall_timeout=float(sys.argv[1]))
trainer = hvdtrain.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), StallsOnRankOne(world.rank),
                           None, config, world=world)
trainer.fit()
