"""Each rank reads its own slice: disjoint, covering the data, reshuffled every epoch, reproducible."""
import pytest
import torch

from hvdtrain.distributed import collectives
from hvdtrain.config.train import TrainConfig
from hvdtrain.trainer import Trainer
from tests.mpi.helpers import small_mlp, synthetic_classification

pytestmark = pytest.mark.mpi


def epoch_indices(trainer: Trainer, epoch: int):
    trainer.parts.batching.sampler.set_epoch(epoch)
    return list(trainer.parts.batching.sampler)


def test_shards_are_disjoint_cover_the_data_and_reshuffle_per_epoch(world):
    samples = 96  # divisible by 1, 2, 3, 4: no padding, so shards must be exactly disjoint
    data = synthetic_classification(samples=samples)
    model = small_mlp(seed=1)
    # batch 8: the global batch (8 x workers) divides 96 at 1-4 workers, so nothing is left out.
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), data, None,
                      TrainConfig(seed=5, batch_size=8), world=world)
    mine = {epoch: epoch_indices(trainer, epoch) for epoch in (0, 1)}
    again = epoch_indices(trainer, 0)
    gathered = {epoch: collectives.allgather_object(mine[epoch], name=f"shard.{epoch}") for epoch in (0, 1)}

    for epoch, shards in gathered.items():
        assert len(shards) == world.size
        assert all(len(shard) == samples // world.size for shard in shards)
        union = [index for shard in shards for index in shard]
        assert sorted(union) == list(range(samples)), f"epoch {epoch}: shards overlap or miss samples"
    assert mine[0] != mine[1], "the order did not change between epochs"
    assert again == mine[0], "the same seed and epoch gave another order"
