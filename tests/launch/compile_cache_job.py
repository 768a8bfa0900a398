"""One process trains a small MLP with train.compile=true into a checkpoint directory, then prints
Inductor's cache counters as JSON (tests/launch/test_compile_cache.py runs it twice, as a restart).

    python tests/launch/compile_cache_job.py CHECKPOINT_DIR MAX_STEPS
"""
import json
import sys

import torch
from torch.utils.data import TensorDataset

import hvdtrain
from hvdtrain.config.train import TrainConfig


def main() -> int:
    directory, max_steps = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    data = TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
    config = TrainConfig(epochs=1, batch_size=8, max_steps=max_steps, compile=True, checkpoint_dir=directory,
                         checkpoint_every=1, warmup_epochs=0.0, progress="off", log_every=1000)
    trainer = hvdtrain.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), data, None, config)
    trainer.fit()
    trainer.close()
    from torch._dynamo.utils import counters

    print(json.dumps(dict(counters["inductor"])), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
