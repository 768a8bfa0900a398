"""Data parallelism is right when N workers x batch B take the same steps as one process x batch N*B,
under every strategy (replicated, or with the optimizer state and gradients sharded)."""
import copy

import pytest
import torch
import torch.nn.functional as F

from hvdtrain.distributed import collectives
from hvdtrain.config.train import TrainConfig
from hvdtrain.data.sharding import ShardedSampler
from hvdtrain.trainer import Trainer
from tests.mpi.helpers import flat_parameters, small_mlp, synthetic_classification

pytestmark = pytest.mark.mpi

def two_groups(params):
    """Weights and biases with their own rates and weight decay (params: the model's, in order)."""
    params = list(params)
    return [{"params": [p for p in params if p.dim() > 1], "lr": 0.02, "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() == 1], "lr": 0.005, "weight_decay": 0.0}]


OPTIMIZERS = {
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
    "adamw_two_groups": lambda params: torch.optim.AdamW(two_groups(params)),
}
STRATEGIES = ["ddp", "zero1", "zero2", "fsdp"]


def reference_run(initial_state, make_optimizer, data, seed, global_batch, steps):
    """One process, no Horovod: the same samples, taken global_batch at a time."""
    model = small_mlp(seed=0)
    model.load_state_dict(initial_state)
    optimizer = make_optimizer(model.parameters())
    sampler = ShardedSampler(len(data), rank=0, world_size=1, seed=seed)
    sampler.set_epoch(0)
    order = list(sampler)
    inputs, labels = data.tensors
    for step in range(steps):
        batch = order[step * global_batch:(step + 1) * global_batch]
        assert len(batch) == global_batch, "the reference ran out of samples: shrink the test"
        optimizer.zero_grad()
        F.cross_entropy(model(inputs[batch]), labels[batch]).backward()
        optimizer.step()
    return flat_parameters(model)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
def test_n_workers_match_one_process_with_n_times_the_batch(world, optimizer_name, accumulation, strategy):
    data = synthetic_classification(samples=192)
    batch, steps, seed = 4, 5, 11
    make_optimizer = OPTIMIZERS[optimizer_name]
    model = small_mlp(seed=100 + world.rank)  # different on every rank: set-up must fix that
    config = TrainConfig(epochs=1, batch_size=batch, accumulation=accumulation, strategy=strategy,
                         scale_lr=False, warmup_epochs=0, max_steps=steps, seed=seed, log_every=1000)
    # No train.lr: the optimizer's own rates, which the Trainer scales.
    trainer = Trainer(model, make_optimizer(model.parameters()), data, None, config, world=world)
    initial = copy.deepcopy(trainer.strategy.state_dict()["model"])  # the full model, whatever the strategy
    trainer.fit()
    trainer.strategy.whole_model()  # fsdp: parameters hold no memory between uses until made whole

    expected = reference_run(initial, make_optimizer, data, seed,
                             global_batch=batch * accumulation * world.size, steps=steps)
    difference = (flat_parameters(trainer.model) - expected).abs().max()
    moved = (flat_parameters(trainer.model) - torch.cat([v.reshape(-1) for v in initial.values()])).abs().max()
    name = f"equiv.{strategy}.{optimizer_name}.{accumulation}"
    everywhere = collectives.allgather_rows(torch.stack([difference, moved]), name=name)
    replicas = collectives.allgather_rows(flat_parameters(trainer.model), name=f"{name}.params")

    assert trainer.global_step == steps
    assert all(torch.equal(replicas[0], row) for row in replicas), "ranks hold different parameters"
    assert (everywhere[:, 1] > 1e-3).all(), "training did not move the parameters: the test proves nothing"
    assert (everywhere[:, 0] < 1e-10).all(), f"max |distributed - single| per rank: {everywhere[:, 0].tolist()}"
