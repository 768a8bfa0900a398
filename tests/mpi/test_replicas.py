"""After set-up and after training, every rank holds exactly the same model and optimizer state."""
import pytest
import torch

from hvdtrain.distributed import collectives
from hvdtrain.config.train import TrainConfig
from hvdtrain.trainer import Trainer
from tests.mpi.helpers import flat_parameters, small_mlp, synthetic_classification

pytestmark = pytest.mark.mpi


def flat_optimizer_state(optimizer: torch.optim.Optimizer) -> torch.Tensor:
    tensors = [value.reshape(-1).to(torch.float64)
               for state in optimizer.state_dict()["state"].values()
               for value in state.values() if isinstance(value, torch.Tensor)]
    return torch.cat(tensors) if tensors else torch.zeros(0, dtype=torch.float64)


def rows_identical(rows: torch.Tensor) -> bool:
    return all(torch.equal(rows[0], row) for row in rows)


@pytest.mark.parametrize("fp16_allreduce", [False, True])
def test_replicas_are_bitwise_identical_after_training(world, fp16_allreduce):
    data = synthetic_classification(samples=160, dtype=torch.float32)
    model = small_mlp(seed=7, dtype=torch.float32)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    config = TrainConfig(epochs=2, batch_size=8, fp16_allreduce=fp16_allreduce, seed=3, log_every=1000)
    trainer = Trainer(model, optimizer, data, None, config, world=world)
    history = trainer.fit()

    params = collectives.allgather_rows(flat_parameters(trainer.model), name=f"replicas.params.{fp16_allreduce}")
    state = collectives.allgather_rows(flat_optimizer_state(trainer.optimizer), name=f"replicas.state.{fp16_allreduce}")

    assert len(history) == 2 and history[-1]["train_loss"] < history[0]["train_loss"]
    assert rows_identical(params), "ranks hold different parameters after training"
    assert rows_identical(state), "ranks hold different optimizer states after training"


@pytest.mark.parametrize("optimizer_name", ["sgd_momentum", "adam"])
def test_setup_gives_every_rank_rank0_parameters_and_optimizer_state(world, optimizer_name):
    data = synthetic_classification(samples=64, dtype=torch.float32)
    model = small_mlp(seed=500 + world.rank, dtype=torch.float32)  # a different init on every rank
    if optimizer_name == "adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    # A local step with rank-specific gradients gives every rank its own optimizer state.
    torch.manual_seed(900 + world.rank)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    optimizer.zero_grad()

    before_params = collectives.allgather_rows(flat_parameters(model), name=f"bcast.before.p.{optimizer_name}")
    before_state = collectives.allgather_rows(flat_optimizer_state(optimizer), name=f"bcast.before.s.{optimizer_name}")
    trainer = Trainer(model, optimizer, data, None, TrainConfig(epochs=1, batch_size=8, scale_lr=False),
                      world=world)
    after_params = collectives.allgather_rows(flat_parameters(trainer.model), name=f"bcast.after.p.{optimizer_name}")
    after_state = collectives.allgather_rows(flat_optimizer_state(trainer.optimizer), name=f"bcast.after.s.{optimizer_name}")

    if world.size > 1:
        assert not rows_identical(before_params), "ranks started equal: the test proves nothing"
        assert not rows_identical(before_state)
    for row in after_params:
        assert torch.equal(row, before_params[0]), "a rank does not hold rank 0's parameters"
    for row in after_state:
        assert torch.equal(row, before_state[0]), "a rank does not hold rank 0's optimizer state"
