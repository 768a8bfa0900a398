"""A job whose rank 1 hangs in its checkpoint write (a hung mount): its file moves 1000 bytes, then none.

    mpirun -np 2 python tests/launch/save_stall_job.py CHECKPOINT_DIR CHECKPOINT_TIMEOUT_SECONDS
"""
import io
import sys
import threading

import torch

import hvdtrain
from hvdtrain.config.train import TrainConfig

world = hvdtrain.init(seed=0)
if world.rank == 1:
    save_in_memory = torch.save

    def hanging_save(state, handle, *args, **kwargs):
        if isinstance(handle, io.BytesIO):  # the save's check that its state loads back: no file
            return save_in_memory(state, handle, *args, **kwargs)
        handle.write(b"x" * 1000)
        threading.Event().wait()  # never set: the write never returns, as on a dead file server
    torch.save = hanging_save

model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
config = TrainConfig(epochs=1, batch_size=8, log_every=1000, strategy="zero1", checkpoint_format="sharded",
                     checkpoint_dir=sys.argv[1], checkpoint_every=2, checkpoint_timeout=float(sys.argv[2]),
                     tensorboard=False)
trainer = hvdtrain.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), data, None, config, world=world)
trainer.fit()
