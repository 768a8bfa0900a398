"""Stopping after step k and resuming from the checkpoint gives bitwise the run that never stopped."""
import pytest
import torch
from torch import nn

from hvdtrain.distributed import collectives, rng
from hvdtrain.config.train import TrainConfig
from hvdtrain.trainer import Trainer
from tests.mpi.helpers import flat_parameters, synthetic_classification

pytestmark = pytest.mark.mpi


def dropout_mlp(seed):
    torch.manual_seed(seed)
    # Dropout draws from each rank's own generator: exact resume must restore every rank's state.
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4)).double()


def train(world, directory, max_steps, model_seed=0):
    model = dropout_mlp(model_seed)
    config = TrainConfig(epochs=5, batch_size=4, accumulation=2, lr=0.05, warmup_epochs=0.5, seed=9,
                         max_steps=max_steps, checkpoint_dir=directory, log_every=1000)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=config.lr, momentum=0.9),
                      synthetic_classification(samples=192), None, config, world=world)
    trainer.fit()
    return trainer


def test_resume_mid_epoch_continues_bitwise(world, tmp_path):
    base = collectives.allgather_object(str(tmp_path), name="resume.dir")[0]  # rank 0 writes and reads
    rng.seed_everything(rng.rank_seed(1, world.rank))
    whole = train(world, f"{base}/whole", max_steps=20)

    rng.seed_everything(rng.rank_seed(1, world.rank))
    stopped = train(world, f"{base}/stopped", max_steps=7)
    stopped_at = (stopped.parts.position.epoch, stopped.parts.position.epoch_position)
    rng.seed_everything(12345 + world.rank)  # the resumed run must not depend on the RNG it starts with
    resumed = train(world, f"{base}/stopped", max_steps=20, model_seed=99)

    rows = collectives.allgather_rows(flat_parameters(resumed.model) - flat_parameters(whole.model), name="resume.diff")
    assert stopped_at[1] != 0, "the stop must fall inside an epoch to test mid-epoch resume"
    assert resumed.global_step == whole.global_step == 20
    assert torch.count_nonzero(rows) == 0, f"max difference per rank: {rows.abs().max(dim=1).values.tolist()}"
