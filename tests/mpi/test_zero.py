"""ZeRO stages 1 and 2 are right when N workers take the same steps as one process with the whole
batch, hold the same full optimizer state, and each keep only their share of it."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hvdtrain.distributed import collectives
from hvdtrain.strategies.optimizers import ELEMENTWISE_OPTIMIZERS
from hvdtrain.strategies.zero import Zero1Strategy, Zero2Strategy
from tests.mpi.helpers import flat_parameters, small_mlp, synthetic_classification

# The launches of scripts/run_tests.sh this file runs in besides the one at $NP ranks under MPI,
# each with what it shows there (the markers: setup.cfg).
pytestmark = [
    pytest.mark.mpi,
    pytest.mark.np1(reason="one rank holds the whole optimizer state: ZeRO with a single shard and no padding"),
    pytest.mark.np4(reason="each rank's share of the optimizer state and its padding change with the world size"),
    pytest.mark.gloo_np4(reason="the same shares at 4 ranks over Gloo's reduce-scatter and all-gather"),
]

STAGES = {1: Zero1Strategy, 2: Zero2Strategy}
# 12 -> 16 -> 5: 293 parameters, an odd count, so every world size > 1 pads. At most 100 float64s
# per bucket cut them into three buckets (85 + 16 + 192, the last one parameter larger than a bucket).
CLASSES = 5
BUCKET_BYTES = 100 * 8
MICRO_BATCH = 3  # rows per rank and micro-batch
STEPS = 4


def two_groups(model: nn.Module):
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n.endswith("weight")], "lr": 0.02, "weight_decay": 0.1},
            {"params": [p for n, p in named if not n.endswith("weight")], "lr": 0.005, "weight_decay": 0.0}]


OPTIMIZERS = {
    "sgd_momentum": lambda model: torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3),
    "adamw": lambda model: torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1),
    "two_groups": lambda model: torch.optim.AdamW(two_groups(model)),
}


def global_batch(data, step: int, rows: int):
    inputs, labels = data.tensors
    return inputs[step * rows:(step + 1) * rows], labels[step * rows:(step + 1) * rows]


def zero_steps(strategy, data, steps, accumulation, world, first=0, after_step=lambda step: None):
    """The Trainer's loop, by hand: rank r takes rows r::N of each global batch, in micro-batches."""
    rows = MICRO_BATCH * accumulation * world.size
    for step in range(first, first + steps):
        inputs, labels = global_batch(data, step, rows)
        mine = inputs[world.rank::world.size], labels[world.rank::world.size]
        for x, y in zip(mine[0].chunk(accumulation), mine[1].chunk(accumulation)):
            strategy.backward(F.cross_entropy(strategy.model(x), y) / accumulation)
        strategy.synchronize()
        strategy.step()
        strategy.zero_grad()
        after_step(step)


def reference_steps(model, optimizer, data, steps, rows, first=0):
    """One process, no Horovod, the whole global batch; a parameter without a gradient is skipped."""
    for step in range(first, first + steps):
        inputs, labels = global_batch(data, step, rows)
        optimizer.zero_grad()
        F.cross_entropy(model(inputs), labels).backward()
        optimizer.step()


def reference_from(initial_state, make_optimizer, make_model=lambda: small_mlp(seed=0, classes=CLASSES)):
    model = make_model()
    model.load_state_dict(initial_state)
    return model, make_optimizer(model)


def state_difference(ours, theirs) -> float:
    """Max |difference| over the per-parameter state tensors; infinite when the two differ in
    anything else (hyperparameters, parameters with state, keys, shapes, dtypes, plain values)."""
    if ours["param_groups"] != theirs["param_groups"] or list(ours["state"]) != list(theirs["state"]):
        return float("inf")
    worst = 0.0
    for index, state in theirs["state"].items():
        if list(ours["state"][index]) != list(state):
            return float("inf")
        for key, value in state.items():
            mine = ours["state"][index][key]
            if not isinstance(value, torch.Tensor):
                worst = max(worst, 0.0 if mine == value else float("inf"))
            elif mine.shape != value.shape or mine.dtype != value.dtype:
                return float("inf")
            elif value.numel():
                worst = max(worst, (mine - value).abs().max().item())
    return worst


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("stage", sorted(STAGES))
def test_n_workers_match_one_process_with_the_whole_batch(world, stage, optimizer_name, accumulation):
    data = synthetic_classification(samples=192, classes=CLASSES)
    make_optimizer = OPTIMIZERS[optimizer_name]
    model = small_mlp(seed=100 + world.rank, classes=CLASSES)  # different on every rank: set-up must fix that
    strategy = STAGES[stage](model, make_optimizer(model), world, accumulation, False, bucket_bytes=BUCKET_BYTES)
    strategy.broadcast_from_root()
    initial = copy.deepcopy(model.state_dict())
    every_rank, idle = [], []

    def record(step):
        every_rank.append(collectives.allgather_rows(flat_parameters(model), name=f"zero.test.{step}"))
        idle.append(strategy.pending_communication() == [])

    zero_steps(strategy, data, STEPS, accumulation, world, after_step=record)
    state = strategy.state_dict()["optimizer"]
    reference, reference_optimizer = reference_from(initial, make_optimizer)
    reference_steps(reference, reference_optimizer, data, STEPS, rows=MICRO_BATCH * accumulation * world.size)
    local = torch.tensor([
        (flat_parameters(model) - flat_parameters(reference)).abs().max().item(),
        (flat_parameters(model) - torch.cat([v.reshape(-1) for v in initial.values()])).abs().max().item(),
        state_difference(state, reference_optimizer.state_dict()),
    ], dtype=torch.float64)
    everywhere = collectives.allgather_rows(local, name="zero.test.result")

    padding = sum(b.padded_numel for b in strategy.buckets) - sum(p.numel() for p in model.parameters())
    assert len(strategy.buckets) >= 3
    assert padding > 0 or world.size == 1
    assert all(idle), "collectives still pending after the step"
    for step, rows in enumerate(every_rank):
        assert torch.equal(rows, rows[:1].expand_as(rows)), f"ranks' parameters differ after step {step}"
    assert (everywhere[:, 1] > 1e-3).all(), "training did not move the parameters: the test proves nothing"
    assert (everywhere[:, 0] < 1e-10).all(), f"max |zero - one process| per rank: {everywhere[:, 0].tolist()}"
    assert (everywhere[:, 2] < 1e-10).all(), \
        f"max |optimizer state difference| (inf: not the same structure): {everywhere[:, 2].tolist()}"


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_every_accepted_optimizer_matches_one_process(world, stage):
    """Each accepted class is elementwise: stepping flat slices equals stepping whole tensors."""
    data = synthetic_classification(samples=192, classes=CLASSES)
    differences = []
    for optimizer_class in ELEMENTWISE_OPTIMIZERS:
        def make_optimizer(model, optimizer_class=optimizer_class):
            return optimizer_class(model.parameters(), lr=0.01)

        model = small_mlp(seed=0, classes=CLASSES)
        initial = copy.deepcopy(model.state_dict())
        strategy = STAGES[stage](model, make_optimizer(model), world, 2, False, bucket_bytes=BUCKET_BYTES)
        zero_steps(strategy, data, 2, 2, world)
        state = strategy.state_dict()["optimizer"]
        reference, reference_optimizer = reference_from(initial, make_optimizer)
        reference_steps(reference, reference_optimizer, data, 2, rows=MICRO_BATCH * 2 * world.size)
        differences.append([(flat_parameters(model) - flat_parameters(reference)).abs().max().item(),
                            state_difference(state, reference_optimizer.state_dict())])
    everywhere = collectives.allgather_rows(torch.tensor(differences, dtype=torch.float64), name="zero.test.classes")

    worst = everywhere.reshape(world.size, len(ELEMENTWISE_OPTIMIZERS), 2).amax(dim=0)
    failing = {cls.__name__: row.tolist() for cls, row in zip(ELEMENTWISE_OPTIMIZERS, worst) if (row >= 1e-10).any()}
    assert not failing, f"max |parameters|, |state| differences: {failing}"


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_a_checkpoint_resumes_under_zero_and_under_one_plain_optimizer(world, stage):
    data = synthetic_classification(samples=192, classes=CLASSES)
    make_optimizer, rows = OPTIMIZERS["two_groups"], MICRO_BATCH * world.size
    model = small_mlp(seed=0, classes=CLASSES)
    initial = copy.deepcopy(model.state_dict())
    original = STAGES[stage](model, make_optimizer(model), world, 1, False, bucket_bytes=BUCKET_BYTES)
    zero_steps(original, data, 2, 1, world)
    checkpoint = copy.deepcopy(original.state_dict())
    # The other way round: a checkpoint of one plain optimizer (as ddp writes it) resumed under zero.
    plain, plain_optimizer = reference_from(initial, make_optimizer)
    reference_steps(plain, plain_optimizer, data, 2, rows)
    plain_checkpoint = copy.deepcopy({"model": plain.state_dict(), "optimizer": plain_optimizer.state_dict()})

    resumed = []
    for state in (checkpoint, plain_checkpoint):
        fresh_model = small_mlp(seed=7, classes=CLASSES)
        fresh = STAGES[stage](fresh_model, make_optimizer(fresh_model), world, 1, False, bucket_bytes=BUCKET_BYTES)
        fresh.load_state_dict(state)
        zero_steps(fresh, data, 2, 1, world, first=2)
        resumed.append(flat_parameters(fresh_model))
    zero_steps(original, data, 2, 1, world, first=2)
    plain_optimizer.load_state_dict(checkpoint["optimizer"])  # zero's checkpoint, one plain process
    plain.load_state_dict(checkpoint["model"])
    reference_steps(plain, plain_optimizer, data, 2, rows, first=2)
    continued = flat_parameters(model)
    local = torch.tensor([(resumed[0] - continued).abs().max(), (resumed[1] - continued).abs().max(),
                          (flat_parameters(plain) - continued).abs().max()], dtype=torch.float64)
    everywhere = collectives.allgather_rows(local, name="zero.test.resume")

    assert (everywhere[:, 0] == 0).all(), f"zero -> zero: {everywhere[:, 0].tolist()}"
    assert (everywhere[:, 1] < 1e-10).all(), f"plain -> zero: {everywhere[:, 1].tolist()}"
    assert (everywhere[:, 2] < 1e-10).all(), f"zero -> plain: {everywhere[:, 2].tolist()}"


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_after_a_world_change_the_buckets_are_cut_anew_and_a_checkpoint_continues_them(world, stage):
    """What Horovod elastic does to a ZeRO strategy (here re-formed at the same world, the one a
    test process can re-form to): follow_world cuts new buckets, the same optimizer object steps
    them with its state dropped, and the checkpoint loaded then continues exactly as before."""
    data = synthetic_classification(samples=192, classes=CLASSES)
    make_optimizer = OPTIMIZERS["two_groups"]
    model = small_mlp(seed=0, classes=CLASSES)
    strategy = STAGES[stage](model, make_optimizer(model), world, 1, False, bucket_bytes=BUCKET_BYTES)
    zero_steps(strategy, data, 2, 1, world)
    checkpoint = copy.deepcopy(strategy.state_dict())
    zero_steps(strategy, data, 2, 1, world, first=2)
    continued = flat_parameters(model)

    optimizer, old_buckets, values = strategy.optimizer, strategy.buckets, flat_parameters(model)
    strategy.follow_world(world)
    relaid = [strategy.optimizer is optimizer, not optimizer.state,
              not {id(b) for b in strategy.buckets} & {id(b) for b in old_buckets},
              [p for g in optimizer.param_groups for p in g["params"]] == [b.shard for b in strategy.buckets],
              torch.equal(flat_parameters(model), values)]
    strategy.load_state_dict(checkpoint)
    zero_steps(strategy, data, 2, 1, world, first=2)
    difference = (flat_parameters(model) - continued).abs().max().reshape(1).double()
    everywhere = collectives.allgather_rows(difference, name=f"zero.test.relaid.{stage}")

    assert relaid == [True] * 5, "same optimizer, state dropped, new buckets, stepping them, values kept"
    assert (everywhere == 0).all(), f"max |continued after the re-cut - continued| per rank: {everywhere.tolist()}"


def test_broadcast_from_root_spreads_rank_0s_optimizer_state(world):
    data = synthetic_classification(samples=192, classes=CLASSES)
    model = small_mlp(seed=100 + world.rank, classes=CLASSES)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    reference_steps(model, optimizer, data, 1, rows=8, first=world.rank)  # a different state on every rank
    root_state = collectives.broadcast_state(copy.deepcopy(optimizer.state_dict()), root_rank=0, name="zero.test.root")
    strategy = Zero1Strategy(model, optimizer, world, 1, False, bucket_bytes=BUCKET_BYTES)
    strategy.broadcast_from_root()
    state = strategy.state_dict()["optimizer"]
    local = torch.tensor([state_difference(state, root_state)], dtype=torch.float64)
    everywhere = collectives.allgather_rows(local, name="zero.test.root.result")

    assert (everywhere == 0).all(), f"max |state - rank 0's| per rank: {everywhere.tolist()}"


def test_an_optimizer_that_looks_at_whole_tensors_is_refused(world):
    model = small_mlp(seed=0, classes=CLASSES)
    with pytest.raises(ValueError, match=r"LBFGS.*look at whole tensors.*--train\.strategy=ddp"):
        Zero1Strategy(model, torch.optim.LBFGS(model.parameters()), world, 1, False)


class WithUnusedLayer(nn.Module):
    """The unused layer shares the first bucket with the last layer, so that bucket never fills."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.first = nn.Linear(12, 16).double()
        self.unused = nn.Linear(3, 3).double()
        self.last = nn.Linear(16, CLASSES).double()

    def forward(self, x):
        return self.last(torch.tanh(self.first(x)))


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_an_unused_parameter_does_not_hang_the_step(world, stage):
    data = synthetic_classification(samples=192, classes=CLASSES)
    make_optimizer = OPTIMIZERS["sgd_momentum"]
    model = WithUnusedLayer(seed=0)
    initial = copy.deepcopy(model.state_dict())
    strategy = STAGES[stage](model, make_optimizer(model), world, 2, False, bucket_bytes=BUCKET_BYTES)
    zero_steps(strategy, data, 2, 2, world)
    reference, reference_optimizer = reference_from(initial, make_optimizer, lambda: WithUnusedLayer(seed=1))
    reference_steps(reference, reference_optimizer, data, 2, rows=MICRO_BATCH * 2 * world.size)
    local = torch.tensor([(flat_parameters(model) - flat_parameters(reference)).abs().max(),
                          (model.unused.weight.detach() - initial["unused.weight"]).abs().max()], dtype=torch.float64)
    everywhere = collectives.allgather_rows(local, name="zero.test.unused")

    assert (everywhere[:, 1] == 0).all(), f"the unused layer moved (weight decay, momentum): {everywhere[:, 1].tolist()}"
    assert (everywhere[:, 0] < 1e-10).all(), f"max |zero - one process| per rank: {everywhere[:, 0].tolist()}"


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_fp16_reduction_stays_close_to_full_precision(world, stage):
    data = synthetic_classification(samples=192, classes=CLASSES, dtype=torch.float32)
    make_optimizer = OPTIMIZERS["sgd_momentum"]
    model = small_mlp(seed=0, classes=CLASSES, dtype=torch.float32)
    initial = copy.deepcopy(model.state_dict())
    strategy = STAGES[stage](model, make_optimizer(model), world, 1, True, bucket_bytes=BUCKET_BYTES)
    zero_steps(strategy, data, 2, 1, world)
    reference, reference_optimizer = reference_from(
        initial, make_optimizer, lambda: small_mlp(seed=0, classes=CLASSES, dtype=torch.float32))
    reference_steps(reference, reference_optimizer, data, 2, rows=MICRO_BATCH * world.size)
    local = torch.stack([(flat_parameters(model) - flat_parameters(reference)).abs().max(),
                         (flat_parameters(model) - torch.cat([v.reshape(-1) for v in initial.values()])).abs().max()])
    everywhere = collectives.allgather_rows(local.double(), name="zero.test.fp16")

    assert (everywhere[:, 1] > 1e-3).all(), "training did not move the parameters: the test proves nothing"
    assert (everywhere[:, 0] < 1e-3).all(), f"max |fp16 zero - fp32 one process| per rank: {everywhere[:, 0].tolist()}"


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_each_rank_holds_its_share_of_the_state(world, stage):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1000, 1000), nn.ReLU(), nn.Linear(1000, 24))  # float32
    psi, n = sum(p.numel() for p in model.parameters()), world.size
    strategy = STAGES[stage](model, torch.optim.Adam(model.parameters(), lr=1e-3), world, 1, False,
                             bucket_bytes=2**20)
    inputs, labels = torch.randn(4, 1000), torch.arange(4)
    strategy.backward(F.cross_entropy(model(inputs), labels))
    strategy.synchronize()
    strategy.step()
    strategy.zero_grad()
    held = strategy.memory_bytes()
    keys = ("parameters", "gradients", "optimizer_state")
    everywhere = collectives.allgather_rows(torch.tensor([held[k] for k in keys], dtype=torch.float64),
                                            name="zero.test.memory")

    # ZeRO's figures in fp32 with Adam: parameters 4 Psi; exp_avg and exp_avg_sq 8 Psi / N; gradients
    # 4 Psi (stage 1) or 4 Psi / N (stage 2). The rest is padding (under N elements a bucket) and
    # Adam's scalar step per shard: far below the 10% allowed.
    expected = torch.tensor([4 * psi, 4 * psi / (n if stage == 2 else 1), 8 * psi / n], dtype=torch.float64)
    ratio = everywhere / expected
    assert ((ratio - 1).abs() < 0.1).all(), f"held / expected per rank ({', '.join(keys)}): {ratio.tolist()}"
