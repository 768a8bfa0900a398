"""Validation metrics and the learning-rate schedule, as every rank sees them."""
import pytest
import torch
import torch.nn.functional as F

from hvdtrain.distributed import collectives
from hvdtrain.config.train import TrainConfig
from hvdtrain.trainer import Trainer
from tests.mpi.helpers import small_mlp, synthetic_classification

pytestmark = pytest.mark.mpi


def test_validation_metrics_cover_the_whole_validation_set(world):
    train = synthetic_classification(samples=64)
    val = synthetic_classification(samples=101)  # 101 is prime: shards are uneven at any size > 1
    model = small_mlp(seed=3)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), train, val,
                      TrainConfig(batch_size=8), world=world)
    metrics = trainer.evaluate()
    # Every rank holds rank 0's model after set-up: evaluate it on all of val, locally.
    with torch.no_grad():
        outputs = trainer.model(val.tensors[0])
        expected_loss = F.cross_entropy(outputs, val.tensors[1]).item()
        expected_accuracy = (outputs.argmax(1) == val.tensors[1]).double().mean().item()
    agreed = collectives.allgather_rows(torch.tensor([metrics["val_accuracy"], metrics["val_loss"]]), name="metrics.val")

    assert metrics["val_samples"] == 101
    assert metrics["val_accuracy"] == pytest.approx(expected_accuracy, abs=1e-12)
    assert metrics["val_loss"] == pytest.approx(expected_loss, rel=1e-9)
    assert all(torch.equal(agreed[0], row) for row in agreed)


def test_learning_rate_warms_up_to_base_times_workers_times_accumulation(world):
    data = synthetic_classification(samples=128)
    model = small_mlp(seed=4)
    config = TrainConfig(epochs=3, batch_size=4, accumulation=2, lr=0.01, warmup_epochs=1, log_every=1000)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=config.lr), data, None, config, world=world)
    first_lr = trainer.optimizer.param_groups[0]["lr"]
    trainer.fit()
    final_lr = trainer.optimizer.param_groups[0]["lr"]

    assert trainer.parts.batching.warmup_steps == trainer.parts.batching.steps_per_epoch
    assert first_lr == pytest.approx(0.01)
    assert final_lr == pytest.approx(0.01 * world.size * 2)
