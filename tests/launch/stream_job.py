"""A job over a stream read from files (a function that opens them per epoch, no len()), slow
enough per sample to be killed mid-epoch between two checkpoints.

    mpirun -np 2 python tests/launch/stream_job.py DATA_DIR CHECKPOINT_DIR
"""
import sys
import time
from pathlib import Path

import torch

import hvdtrain
from hvdtrain.config.train import TrainConfig
from hvdtrain.distributed import collectives

SAMPLES, FILES, FEATURES = 100, 4, 4
data_dir, checkpoint_dir = Path(sys.argv[1]), sys.argv[2]


def lines(epoch):
    """The files' samples, the files in an order seeded by the epoch (as a shuffled stream's shards)."""
    files = sorted(data_dir.glob("part-*.csv"))
    for index in torch.randperm(len(files), generator=torch.Generator().manual_seed(epoch)).tolist():
        for line in files[index].read_text().splitlines():
            time.sleep(0.02)  # a slow source: the kill lands between checkpoints
            *features, label = line.split(",")
            yield torch.tensor([float(f) for f in features], dtype=torch.float64), torch.tensor(int(label))


world = hvdtrain.init(seed=0)
if world.is_root and not data_dir.exists():
    data_dir.mkdir(parents=True)
    generator = torch.Generator().manual_seed(7)
    inputs = torch.randn(SAMPLES, FEATURES, generator=generator, dtype=torch.float64)
    labels = (inputs.sum(dim=1) > 0).long()
    for part in range(FILES):
        rows = range(part * SAMPLES // FILES, (part + 1) * SAMPLES // FILES)
        (data_dir / f"part-{part}.csv").write_text(
            "".join(",".join(repr(v) for v in inputs[i].tolist()) + f",{labels[i].item()}\n" for i in rows))
collectives.barrier()  # the files exist before any rank reads them
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).double()
config = TrainConfig(epochs=2, batch_size=4, max_steps=100, warmup_epochs=0, log_every=1, checkpoint_dir=checkpoint_dir,
                     checkpoint_every=5, progress="off", run_dir=None)
trainer = hvdtrain.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), lines, None, config,
                           world=world)
trainer.fit()
trainer.close()
print(f"trained to step {trainer.global_step}", flush=True)
