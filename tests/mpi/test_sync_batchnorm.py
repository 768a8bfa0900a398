"""SyncBatchNorm is right when N workers, each with its own rows, take the same steps as one process
with all the rows: outputs, input gradients, running statistics, num_batches_tracked and parameters
after a few SGD steps. Plain BatchNorm (each rank's own statistics) does not, which the tests show too."""
from typing import Dict, List

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import horovod.torch as hvd

from hvdtrain.distributed import collectives
from hvdtrain.config.train import TrainConfig
from hvdtrain.strategies import build_strategy
from hvdtrain.components.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm

pytestmark = pytest.mark.mpi

# float64 throughout. Synchronized and one process compute the same formulas; only the order of the
# additions differs (per-rank partial sums added by the all-reduce, against one sum over the global
# batch): rounding of ~1e-16 relative per operation, which a few steps of this small net leave far
# below 1e-10 (measured: ~1e-15). A wrong statistic (one rank's instead of the global batch's) is off
# by more than 1e-3.
EXACT = 1e-10
DIFFERENT = 1e-3
STEPS = 3
CLASSES = 3


class TinyConvNet(nn.Module):
    """Conv -> BatchNorm2d -> ReLU -> Linear -> BatchNorm1d -> Tanh -> Linear, on 2x4x4 images."""

    def __init__(self, momentum):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, kernel_size=3, padding=1)
        self.bn2d = nn.BatchNorm2d(3, momentum=momentum)
        self.fc1 = nn.Linear(3 * 4 * 4, 6)
        self.bn1d = nn.BatchNorm1d(6, momentum=momentum)
        self.fc2 = nn.Linear(6, CLASSES)

    def forward(self, x):
        x = torch.relu(self.bn2d(self.conv(x)))
        return self.fc2(torch.tanh(self.bn1d(self.fc1(x.flatten(1)))))


def tiny_net(momentum=0.1, sync=False, device="cpu") -> nn.Module:
    torch.manual_seed(7)  # the same initial model on every rank and in the reference
    model = TinyConvNet(momentum).double().to(device)
    return convert_sync_batchnorm(model) if sync else model


def samples(count: int, device="cpu"):
    """The same rows on every rank; a mean and scale far from 0 and 1, so the statistics matter."""
    generator = torch.Generator().manual_seed(99)
    inputs = torch.randn(count, 2, 4, 4, generator=generator, dtype=torch.float64) * 3.0 + 1.5
    labels = torch.randint(0, CLASSES, (count,), generator=generator)
    return inputs.to(device), labels.to(device)


def rank_rows(sizes: List[int], rank: int, step: int) -> slice:
    """Rank ``rank``'s rows of step ``step``: the global batch of a step is the ranks' blocks in rank order."""
    start = step * sum(sizes) + sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def bn_layers(model: nn.Module) -> List[nn.Module]:
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def state(model: nn.Module) -> Dict[str, torch.Tensor]:
    layers = bn_layers(model)
    return {
        "parameters": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
        "running_mean": torch.cat([m.running_mean for m in layers]),
        "running_var": torch.cat([m.running_var for m in layers]),
        "num_batches_tracked": torch.stack([m.num_batches_tracked for m in layers]).double(),
    }


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() if a.numel() else 0.0


def train_distributed(model, inputs, labels, sizes, rank, tag, mean_loss=True):
    """STEPS SGD steps on this rank's rows. mean_loss: each rank's mean loss, gradients averaged
    (equal batches); else each rank's summed loss / the global batch, gradients summed (any batches).
    Either way the update is the gradient of the global batch's mean loss. Returns this rank's
    outputs of every step and its input gradient at the first step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.train()
    outputs, first_grad = [], None
    for step in range(STEPS):
        rows = rank_rows(sizes, rank, step)
        x = inputs[rows].clone().requires_grad_(step == 0)
        optimizer.zero_grad()
        out = model(x)
        if mean_loss:
            loss = F.cross_entropy(out, labels[rows])
        else:
            loss = F.cross_entropy(out, labels[rows], reduction="sum") / sum(sizes)
        loss.backward()
        # Data parallelism: every rank steps with the same (reduced) gradients.
        for i, p in enumerate(model.parameters()):
            p.grad = hvd.allreduce(p.grad, op=hvd.Average if mean_loss else hvd.Sum, name=f"sbn.{tag}.{step}.{i}")
        optimizer.step()
        outputs.append(out.detach())
        if step == 0:
            first_grad = x.grad.detach()
    return outputs, first_grad


def train_one_process(model, inputs, labels, global_batch):
    """The reference: the same model and steps, one process, each step on the whole global batch."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.train()
    outputs, first_grad = [], None
    for step in range(STEPS):
        x = inputs[step * global_batch:(step + 1) * global_batch].clone().requires_grad_(step == 0)
        optimizer.zero_grad()
        out = model(x)
        F.cross_entropy(out, labels[step * global_batch:(step + 1) * global_batch]).backward()
        optimizer.step()
        outputs.append(out.detach())
        if step == 0:
            first_grad = x.grad.detach()
    return outputs, first_grad


def differences(model, outputs, first_grad, reference, sizes, rank, grad_scale, probe):
    """Max |this rank - one process| of every checked quantity, as one row (for the gather)."""
    ref_model, ref_outputs, ref_grad = reference
    mine_in_step = rank_rows(sizes, rank, 0)  # this rank's rows within any step's global batch
    steps = max(max_abs(out, ref_outputs[s][mine_in_step]) for s, out in enumerate(outputs))
    mine, theirs = state(model), state(ref_model)
    model.eval()
    ref_model.eval()
    with torch.no_grad():  # eval: running statistics, no collective
        evaluated = max_abs(model(probe), ref_model(probe))
    return torch.tensor([
        steps,
        max_abs(first_grad / grad_scale, ref_grad[mine_in_step]),
        max_abs(mine["parameters"], theirs["parameters"]),
        max_abs(mine["running_mean"], theirs["running_mean"]),
        max_abs(mine["running_var"], theirs["running_var"]),
        max_abs(mine["num_batches_tracked"], theirs["num_batches_tracked"]),
        evaluated,
    ], dtype=torch.float64)


CHECKED = ["outputs", "input grad", "parameters", "running_mean", "running_var", "num_batches_tracked", "eval outputs"]


def gather_differences(rows: torch.Tensor, name: str) -> torch.Tensor:
    """(ranks, models, CHECKED): every rank's rows of differences, on every rank."""
    return collectives.allgather_rows(rows, name=name).reshape(-1, rows.shape[0], len(CHECKED))


def report(differences_per_rank: torch.Tensor) -> str:
    return "; ".join(f"{name} {differences_per_rank[:, i].max().item():.3g}" for i, name in enumerate(CHECKED))


def devices():
    gpu = torch.cuda.is_available() and hvd.nccl_built()  # the same answer on every rank of a uniform job
    return ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not gpu, reason="no GPU with NCCL here"))]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum", "cumulative"])
def test_n_workers_match_one_process_with_the_global_batch_where_plain_batchnorm_does_not(world, momentum, device):
    device = world.device if device == "cuda" else torch.device("cpu")
    sizes = [4] * world.size
    inputs, labels = samples(STEPS * sum(sizes) + 6, device)
    probe = inputs[-6:]  # rows no step trained on, for the eval-mode outputs (running statistics)
    reference_model = tiny_net(momentum, device=device)
    reference = (reference_model, *train_one_process(reference_model, inputs, labels, sum(sizes)))

    rows = []
    for sync in (True, False):
        model = tiny_net(momentum, sync=sync, device=device)
        outputs, first_grad = train_distributed(model, inputs, labels, sizes, world.rank,
                                                tag=f"even.{sync}.{momentum}.{device}")
        # Each rank's loss is the mean over its B rows, the reference's over N*B rows: the gradient a
        # rank's rows receive (through the all-reduces of the statistics) is N times the reference's.
        rows.append(differences(model, outputs, first_grad, reference, sizes, world.rank, world.size, probe))
    everywhere = gather_differences(torch.stack(rows).cpu(), name=f"sbn.even.{momentum}.{device}")
    synced, plain = everywhere[:, 0], everywhere[:, 1]

    assert (synced < EXACT).all(), f"max |synchronized - one process|: {report(synced)}"
    if world.size == 1:  # one rank's batch is the global batch: plain BatchNorm is exact as well
        assert (plain < EXACT).all(), f"max |plain - one process| at 1 rank: {report(plain)}"
    else:  # else each rank normalizes with its own statistics: the test would catch that
        for i, name in enumerate(CHECKED):
            if name != "num_batches_tracked":
                assert plain[:, i].max() > DIFFERENT, f"plain BatchNorm matched in {name}: {report(plain)}"


@pytest.mark.parametrize("layout", ["uneven", "one_rank_empty"])
def test_uneven_and_empty_local_batches_match_one_process_with_all_the_rows(world, layout):
    # Rank r holds 3 + r rows; with one_rank_empty, rank 0 holds none but still joins every collective.
    if layout == "one_rank_empty" and world.size == 1:
        pytest.skip("an empty rank needs another rank with rows: not at world size 1")
    sizes = [3 + r for r in range(world.size)]
    if layout == "one_rank_empty":
        sizes[0] = 0
    inputs, labels = samples(STEPS * sum(sizes) + 6)
    probe = inputs[-6:]
    reference_model = tiny_net()
    reference = (reference_model, *train_one_process(reference_model, inputs, labels, sum(sizes)))

    model = tiny_net(sync=True)
    # Summed loss / the global batch, gradients summed: the global mean's gradient with any batch sizes.
    outputs, first_grad = train_distributed(model, inputs, labels, sizes, world.rank,
                                            tag=f"uneven.{layout}", mean_loss=False)
    row = differences(model, outputs, first_grad, reference, sizes, world.rank, 1, probe)
    synced = gather_differences(row.unsqueeze(0), name=f"sbn.uneven.{layout}")[:, 0]

    assert (synced < EXACT).all(), f"sizes {sizes}, max |synchronized - one process|: {report(synced)}"


def test_through_the_ddp_strategy_hooks(world):
    """The Trainer's path: Horovod's DistributedOptimizer starts the gradients' all-reduces from hooks
    while backward runs this module's all-reduces; same result, no hang."""
    sizes = [4] * world.size
    inputs, labels = samples(STEPS * sum(sizes) + 6)
    reference_model = tiny_net()
    reference = (reference_model, *train_one_process(reference_model, inputs, labels, sum(sizes)))

    model = tiny_net(sync=True)
    strategy = build_strategy(TrainConfig(), model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                              world)
    strategy.broadcast_from_root()
    outputs, first_grad = [], None
    for step in range(STEPS):
        rows = rank_rows(sizes, world.rank, step)
        x = inputs[rows].clone().requires_grad_(step == 0)
        strategy.zero_grad()
        out = model(x)
        strategy.backward(F.cross_entropy(out, labels[rows]))
        strategy.synchronize()  # the gradients' average over the ranks
        strategy.step()
        outputs.append(out.detach())
        if step == 0:
            first_grad = x.grad.detach()
    row = differences(model, outputs, first_grad, reference, sizes, world.rank, world.size, inputs[-6:])
    synced = gather_differences(row.unsqueeze(0), name="sbn.ddp")[:, 0]

    assert (synced < EXACT).all(), f"max |ddp strategy - one process|: {report(synced)}"


def test_collective_names_are_the_layers_qualified_names_on_every_rank(world):
    names = [m.name for m in tiny_net(sync=True).modules() if isinstance(m, SyncBatchNorm)]
    everywhere = collectives.allgather_object(names, name="sbn.names")

    assert names == ["bn2d", "bn1d"]
    assert all(other == names for other in everywhere)


def test_one_value_per_channel_over_all_ranks_raises_on_every_rank(world):
    # One row in the whole job (rank 0's), through a BatchNorm1d: count 1, no variance to estimate.
    layer = convert_sync_batchnorm(nn.BatchNorm1d(3).double())
    x = torch.ones(1 if world.rank == 0 else 0, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        layer(x)
    collectives.barrier()  # every rank got here: none is left waiting in the layer's collectives
