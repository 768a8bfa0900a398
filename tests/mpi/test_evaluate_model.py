"""hvdtrain.evaluate_model: evaluation alone, no optimizer and no Trainer; every sample counted once
over uneven shards, the same numbers on every rank as one process over the whole set."""
import pytest
import torch
import torch.nn.functional as F

from hvdtrain import evaluate_model
from hvdtrain.distributed import collectives
from tests.mpi.helpers import small_mlp, synthetic_classification

pytestmark = pytest.mark.mpi


def test_the_sharded_evaluation_equals_one_process_over_the_whole_set(world):
    model = small_mlp(seed=4).double()
    data = synthetic_classification(samples=97)  # odd: the shards differ in size at 2 and 4 ranks
    metrics = evaluate_model(model, data, world=world, batch_size=8)
    every_rank = collectives.allgather_object(metrics, name="evaluate_model.metrics")

    inputs, labels = data.tensors
    with torch.no_grad():
        outputs = model(inputs.double())
    # float64, ~100 additions in another order: 1e-12 holds anywhere; a sample counted twice or
    # missed moves the mean by > 1e-3
    assert metrics["val_samples"] == 97
    assert abs(metrics["val_loss"] - F.cross_entropy(outputs, labels).item()) < 1e-12
    assert abs(metrics["val_accuracy"] - (outputs.argmax(dim=1) == labels).double().mean().item()) < 1e-12
    assert all(other == metrics for other in every_rank)
    with pytest.raises(ValueError, match="precision=...\\) must be one of fp32, bf16, fp16, got 'fp64'"):
        evaluate_model(model, data, world=world, precision="fp64")
