"""A job whose checkpoints are large enough (about 400 MB of model and Adam state) that a
background write lasts long enough to be killed in the middle of it.

    mpirun -np 2 python tests/launch/async_save_job.py CHECKPOINT_DIR STRATEGY FORMAT MAX_STEPS
"""
import sys

import torch
from torch.utils.data import TensorDataset

import hvdtrain
from hvdtrain.config.train import TrainConfig

directory, strategy, checkpoint_format, max_steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
world = hvdtrain.init(seed=0)
torch.manual_seed(0)
WIDTH = 4096  # two 4096 x 4096 layers: 33.6M float32 parameters, 134 MB, and Adam's two moments
model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH),
                            torch.nn.ReLU(), torch.nn.Linear(WIDTH, 2))
generator = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(256, WIDTH, generator=generator), torch.randint(0, 2, (256,), generator=generator))
config = TrainConfig(epochs=100, batch_size=8, log_every=1, max_steps=max_steps, checkpoint_dir=directory,
                     checkpoint_every=2, checkpoint_async=True, checkpoint_format=checkpoint_format,
                     strategy=strategy, progress="off", run_dir=None)
trainer = hvdtrain.Trainer(model, torch.optim.Adam(model.parameters(), lr=1e-4), data, None, config, world=world)
trainer.fit()
trainer.close()
print(f"trained to step {trainer.global_step}", flush=True)
