"""A parameter that no rank's backward reaches is left as one process leaves it (torch's optimizer
skips a parameter whose .grad is None: no weight decay, no momentum, no state), under every
data-parallel strategy; a branch that only some ranks use this step is averaged as one process
over the global batch averages it (the other ranks contribute zeros)."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hvdtrain.distributed import collectives
from hvdtrain.strategies.ddp import DDPStrategy
from hvdtrain.strategies.fsdp.strategy import FSDPStrategy
from hvdtrain.strategies.zero import Zero1Strategy, Zero2Strategy
from tests.mpi.helpers import synthetic_classification

pytestmark = pytest.mark.mpi

CLASSES = 5
ROWS_PER_RANK = 3
STEPS = 4
BUCKET_BYTES = 100 * 8  # several zero buckets, the unused layer sharing one with used ones


class RoutedModel(nn.Module):
    """``never`` is in no forward; ``routed`` only sees the rows whose last feature is positive,
    and only the global batch's first row is routed (rank 0's, whatever the world size), so on the
    other ranks its backward never reaches it. ``frozen`` does not train."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.first = nn.Linear(12, 16).double()
        self.never = nn.Linear(16, 7).double()
        self.routed = nn.Linear(16, CLASSES).double()
        self.frozen = nn.Linear(16, CLASSES).double().requires_grad_(False)
        self.last = nn.Linear(16, CLASSES).double()

    def forward(self, x):
        hidden = torch.tanh(self.first(x))
        out = self.last(hidden) + self.frozen(hidden)
        chosen = x[:, -1] > 0
        if chosen.any():
            out = out.index_add(0, chosen.nonzero().squeeze(1), self.routed(hidden[chosen]))
        return out


def global_batch(data, step: int, world_size: int):
    """Step ``step``'s rows for the whole world; only its first row routed."""
    rows = ROWS_PER_RANK * world_size
    inputs, labels = data.tensors
    inputs = inputs[step * rows:(step + 1) * rows].clone()
    inputs[:, -1] = -1.0
    inputs[0, -1] = 1.0
    return inputs, labels[step * rows:(step + 1) * rows]


def make_optimizer(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01, weight_decay=0.1)


def distributed_run(strategy, data, world):
    """The Trainer's loop, by hand: rank r takes rows r::N of each global batch. Returns the
    global batch's loss per step (the ranks' means averaged: their row counts are equal)."""
    losses = []
    for step in range(STEPS):
        inputs, labels = global_batch(data, step, world.size)
        loss = F.cross_entropy(strategy.model(inputs[world.rank::world.size]), labels[world.rank::world.size])
        strategy.backward(loss)
        strategy.synchronize()
        strategy.step()
        strategy.zero_grad()
        losses.append(loss.detach())
    return collectives.allgather_rows(torch.stack(losses), name="unused.test.losses").mean(dim=0)


def one_process_run(initial, data, world_size):
    model = RoutedModel(seed=1)
    model.load_state_dict(initial)
    optimizer = make_optimizer(model)
    losses = []
    for step in range(STEPS):
        inputs, labels = global_batch(data, step, world_size)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(inputs), labels)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return model, torch.stack(losses)


STRATEGIES = {
    "ddp": lambda model, world: DDPStrategy(model, make_optimizer(model), world, 1, False),
    "zero1": lambda model, world: Zero1Strategy(model, make_optimizer(model), world, 1, False,
                                                bucket_bytes=BUCKET_BYTES),
    "zero2": lambda model, world: Zero2Strategy(model, make_optimizer(model), world, 1, False,
                                                bucket_bytes=BUCKET_BYTES),
    "fsdp": lambda model, world: FSDPStrategy(model, make_optimizer(model), world, 1, False),
}


@pytest.mark.parametrize("strategy_name", sorted(STRATEGIES))
def test_a_parameter_no_rank_used_is_not_stepped_and_a_routed_one_is_averaged(world, strategy_name):
    data = synthetic_classification(samples=96, classes=CLASSES)
    model = RoutedModel(seed=0)
    initial = copy.deepcopy(model.state_dict())
    strategy = STRATEGIES[strategy_name](model, world)
    losses = distributed_run(strategy, data, world)
    strategy.whole_model()  # fsdp: the parameters hold memory again
    reference, reference_losses = one_process_run(initial, data, world.size)
    ours, theirs = dict(model.named_parameters()), dict(reference.named_parameters())
    local = torch.tensor([
        max((ours[name].detach() - theirs[name].detach()).abs().max().item() for name in theirs),
        (losses - reference_losses).abs().max().item(),
        (ours["never.weight"].detach() - initial["never.weight"]).abs().max().item(),
        (ours["routed.weight"].detach() - initial["routed.weight"]).abs().max().item(),
    ], dtype=torch.float64)
    everywhere = collectives.allgather_rows(local, name=f"unused.test.{strategy_name}")
    print(f"{strategy_name}: max |ours - one process| per rank {everywhere[:, 0].tolist()}, "
          f"losses {everywhere[:, 1].tolist()}")

    assert (everywhere[:, 3] > 1e-3).all(), "the routed layer did not train: the test proves nothing"
    assert (everywhere[:, 2] == 0).all(), f"the unused layer moved: {everywhere[:, 2].tolist()}"
    assert (everywhere[:, 0] < 1e-10).all(), f"max |parameters - one process| per rank: {everywhere[:, 0].tolist()}"
    assert (everywhere[:, 1] < 1e-10).all(), f"max |step loss - one process| per rank: {everywhere[:, 1].tolist()}"
