"""train.reduction=adasum through the Trainer equals Horovod's Adasum computed by hand, and differs from
averaging; what Horovod cannot do (Adasum over Gloo, on 3 ranks; a hierarchical all-reduce asked for
after hvd.init()) is refused at start, on every rank.

What Horovod 0.28.1 does, read in its source:
- horovod/torch/optimizer.py: with op=Adasum and more than one rank, DistributedOptimizer is its Adasum
  optimizer. Each parameter's gradient hook steps that parameter with this rank's own gradient, takes
  the update (new - old) and all-reduces it with Adasum; step() adds the combined update to the old
  parameter. At one rank it is the usual optimizer, and Adasum of one tensor is that tensor.
- horovod/common/ops/adasum/adasum.h (FusedPairwiseReduceWithComm): two vectors combine as
  (1 - a.b / (2|a|^2)) a + (1 - a.b / (2|b|^2)) b, a coefficient left at 1 where |a|^2 < sqrt(DBL_MIN).
  Per tensor: the tensors fused into one buffer keep their own dot products and norms
  (tensor_counts), summed over the ranks that hold pieces of them.
- adasum.h (FusedAllreduce): ranks combine in a binary tree by rank bits (vector halving, distance
  doubling): level 1 combines ranks r and r^1, level 2 the results of r and r^2, ... At 4 ranks:
  adasum(adasum(g0, g1), adasum(g2, g3)).
With plain SGD (no momentum) a rank's update is -lr g, and adasum(c a, c b) = c adasum(a, b): one step
is p - lr * tree(g_0, ..., g_{N-1}), each g_r the gradient of rank r's own samples.

Bounds: float64. Horovod's update is (p - lr g) - p, exact to ~1e-16 |p|, and its dot products are
summed in another order (one piece of the vector per rank); over 4 steps the difference stays below
1e-13, so 1e-10 is far above rounding and far below what the wrong combination changes: the test also
requires > 1e-3 from averaging, from the same tree over the whole model as one vector (what a
reading of Adasum per fused buffer, not per tensor, would give) and, at 4 ranks or more, from the
tree with its first two levels swapped.
"""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from hvdtrain.distributed import collectives

from hvdtrain.distributed import startup
from hvdtrain.config.train import TrainConfig
from hvdtrain.data.sharding import ShardedSampler
from hvdtrain.strategies.reduction import is_power_of_two
from hvdtrain.trainer import Trainer
from tests.mpi.helpers import agreed, flat_parameters, small_mlp, synthetic_classification

# The launches of scripts/run_tests.sh this file runs in besides the one at $NP ranks under MPI,
# each with what it shows there (the markers: setup.cfg).
pytestmark = [
    pytest.mark.mpi,
    pytest.mark.np1(reason="Adasum of one tensor is that tensor: the Trainer equals averaging at one rank"),
    pytest.mark.np4(reason="Adasum's tree of ranks has two levels only from 4 ranks: the order of its pairs shows"),
    pytest.mark.gloo_np4(reason="Adasum refused at start over Gloo at 4 ranks too"),
]

BOUND = 1e-10  # see the module's docstring
BATCH, STEPS, SEED, LR = 4, 4, 11, 0.5


def config(**overrides):
    settings = dict(epochs=1, batch_size=BATCH, reduction="adasum", warmup_epochs=0, max_steps=STEPS,
                    seed=SEED, log_every=1000)
    return TrainConfig(**{**settings, **overrides})


def adasum_pair(a, b):
    """Horovod's combination of two vectors (adasum.h, FusedPairwiseReduceWithComm)."""
    dot, a_sq, b_sq = (a * b).sum(), (a * a).sum(), (b * b).sum()
    tiny = torch.finfo(torch.float64).tiny ** 0.5  # sqrt(DBL_MIN)
    a_coeff = 1 - dot / (2 * a_sq) if a_sq >= tiny else 1.0
    b_coeff = 1 - dot / (2 * b_sq) if b_sq >= tiny else 1.0
    return a_coeff * a + b_coeff * b


def adasum_tree(vectors):
    """Ranks r and r^1 first, then r and r^2, ...: pairs of neighbours, level by level."""
    while len(vectors) > 1:
        vectors = [adasum_pair(vectors[i], vectors[i + 1]) for i in range(0, len(vectors), 2)]
    return vectors[0]


def rank_batches(samples, world_size, accumulation):
    """Rank r's samples at each step: its sampler's next batch x accumulation (one list per rank)."""
    per_step = BATCH * accumulation
    batches = []
    for rank in range(world_size):
        sampler = ShardedSampler(samples, rank=rank, world_size=world_size, seed=SEED,
                                 global_batch=per_step * world_size)
        sampler.set_epoch(0)
        order = list(sampler)
        batches.append([order[step * per_step:(step + 1) * per_step] for step in range(STEPS)])
    return batches


def by_hand(initial, data, world_size, accumulation, lr, combine):
    """Plain SGD from ``initial`` in one process: each step, every rank's gradient of its own samples,
    combined by ``combine`` (per rank, one gradient per parameter -> one update per parameter)."""
    model = small_mlp(seed=0)
    model.load_state_dict(initial)
    inputs, labels = data.tensors
    batches = rank_batches(len(data), world_size, accumulation)
    for step in range(STEPS):
        gradients = []  # per rank: one gradient per parameter
        for rank in range(world_size):
            model.zero_grad()
            samples = batches[rank][step]
            F.cross_entropy(model(inputs[samples]), labels[samples]).backward()
            gradients.append([p.grad.clone() for p in model.parameters()])
        with torch.no_grad():
            for p, update in zip(model.parameters(), combine(gradients)):
                p -= lr * update
    return flat_parameters(model)


def per_tensor(combine):
    return lambda gradients: [combine(list(per_rank)) for per_rank in zip(*gradients)]


def whole_model(gradients):
    """The tree over the model's gradient as one flat vector (not what Horovod does)."""
    shapes = [g.shape for g in gradients[0]]
    flat = adasum_tree([torch.cat([g.reshape(-1) for g in rank]) for rank in gradients])
    return [piece.reshape(shape) for piece, shape in zip(torch.split(flat, [s.numel() for s in shapes]), shapes)]


def swapped_levels(vectors):
    """The tree with its first two levels swapped (ranks r and r^2 first, then r and r^1): not
    Horovod's order; Adasum is not associative, so at 4 ranks or more this gives another result."""
    swap = lambda r: (r & ~3) | ((r & 1) << 1) | ((r >> 1) & 1)  # noqa: E731
    return adasum_tree([vectors[swap(r)] for r in range(len(vectors))])


def mean(vectors):
    return sum(vectors) / len(vectors)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_adasum_through_the_trainer_equals_horovods_tree_by_hand(world, accumulation):
    data = synthetic_classification(samples=192)
    model = small_mlp(seed=100 + world.rank)  # different on every rank: set-up broadcasts rank 0's
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    settings = config(accumulation=accumulation)
    if not collectives.mpi_enabled():  # horovodrun --gloo: Horovod has no Adasum there
        with pytest.raises(ValueError, match="needs Horovod's MPI operations, and this job runs on Gloo"):
            Trainer(model, optimizer, data, None, settings, world=world)
        return
    trainer = Trainer(model, optimizer, data, None, settings, world=world)
    initial = {k: v.clone() for k, v in trainer.strategy.state_dict()["model"].items()}
    trainer.fit()

    # Horovod's rule on CPUs over MPI: the LR is not scaled by the workers, only by this worker's
    # accumulation (averaging would scale it by workers x accumulation).
    lr = LR * accumulation
    adasum = by_hand(initial, data, world.size, accumulation, lr, per_tensor(adasum_tree))
    average = by_hand(initial, data, world.size, accumulation, lr, per_tensor(mean))
    one_vector = by_hand(initial, data, world.size, accumulation, lr, whole_model)
    other_tree = (by_hand(initial, data, world.size, accumulation, lr, per_tensor(swapped_levels))
                  if world.size >= 4 else adasum)
    ours = flat_parameters(trainer.model)
    rows = agreed([(ours - adasum).abs().max(), (ours - average).abs().max(), (ours - one_vector).abs().max(),
                   trainer.parts.lr.scale, trainer.strategy.optimizer.param_groups[0]["lr"],
                   (ours - other_tree).abs().max()], name=f"adasum.{accumulation}")

    print(f"\n[adasum x{world.size}, accumulation {accumulation}] max |Trainer - by hand| per rank "
          f"{rows[:, 0].tolist()}; from averaging {rows[:, 1].tolist()}; from the tree over the whole "
          f"model as one vector {rows[:, 2].tolist()}; from the tree with its levels swapped (4+ ranks) "
          f"{rows[:, 5].tolist()}")
    assert (rows[:, 0] < BOUND).all(), f"max |Trainer - Horovod's Adasum by hand| per rank: {rows[:, 0].tolist()}"
    assert (rows[:, 3] == accumulation).all() and (rows[:, 4] == lr).all(), \
        f"lr scale {rows[:, 3].tolist()} and lr {rows[:, 4].tolist()}: expected x{accumulation}, {lr}"
    if world.size == 1:  # Adasum of one tensor is that tensor: the same as averaging
        assert (rows[:, 1] < BOUND).all()
    else:
        assert (rows[:, 1] > 1e-3).all(), f"Adasum came out as averaging: {rows[:, 1].tolist()}"
        assert (rows[:, 2] > 1e-3).all(), f"per tensor and over the whole model agree: {rows[:, 2].tolist()}"
    if world.size >= 4:
        assert (rows[:, 5] > 1e-3).all(), f"the order of the tree made no difference: {rows[:, 5].tolist()}"


def test_adasum_with_fp16_compression_combines_the_fp16_updates(world):
    """fp16_allreduce: Horovod casts each update to fp16 and combines it in fp16 (its AVX/F16C path,
    dot products in double): the result is Adasum's to fp16 precision, not averaging."""
    data = synthetic_classification(samples=192)
    model = small_mlp(seed=100 + world.rank)
    if not collectives.mpi_enabled():
        pytest.skip("Horovod has no Adasum over Gloo (the refusal is tested above)")
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=LR), data, None,
                      config(fp16_allreduce=True), world=world)
    initial = {k: v.clone() for k, v in trainer.strategy.state_dict()["model"].items()}
    trainer.fit()
    adasum = by_hand(initial, data, world.size, 1, LR, per_tensor(adasum_tree))
    average = by_hand(initial, data, world.size, 1, LR, per_tensor(mean))
    ours, start = flat_parameters(trainer.model), torch.cat([v.reshape(-1) for v in initial.values()])
    rows = agreed([(ours - adasum).abs().max(), (ours - average).abs().max(), (adasum - start).abs().max()],
                  name="adasum.fp16")

    print(f"\n[adasum x{world.size}, fp16 compression] max |Trainer - by hand in float64| {rows[:, 0].tolist()}; "
          f"from averaging {rows[:, 1].tolist()}; largest total update {rows[:, 2].tolist()}")
    # fp16 keeps 11 bits: each update is rounded to ~5e-4 of itself, on each level of the tree.
    assert (rows[:, 0] < 1e-2 * rows[:, 2]).all()
    if world.size > 1:
        assert (rows[:, 1] > 10 * rows[:, 0]).all(), "with fp16 compression, Adasum came out as averaging"


def test_adasum_on_a_world_it_cannot_combine_is_refused_before_any_collective(world):
    model = small_mlp(seed=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    data = synthetic_classification(samples=192)
    if not collectives.mpi_enabled():
        match = "needs Horovod's MPI operations"
    else:  # this rank's world, as if the launch had started 3 workers (Horovod would fail in backward)
        world = dataclasses.replace(world, size=3)
        match = "needs a power-of-two number of workers .* this job has 3"
    assert not is_power_of_two(3)
    with pytest.raises(ValueError, match=match):
        Trainer(model, optimizer, data, None, config(), world=world)


def test_hierarchical_allreduce_asked_for_after_hvd_init_is_refused_with_what_to_do(world):
    if world.hierarchical_allreduce:
        pytest.skip("the launch set HOROVOD_HIERARCHICAL_ALLREDUCE: Horovod started with it")
    model = small_mlp(seed=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    data = synthetic_classification(samples=192)
    settings = config(reduction="average", hierarchical_allreduce=True)
    expected = r"started without HOROVOD_HIERARCHICAL_ALLREDUCE=1.*Set it before hvd.init\(\)"
    with pytest.raises(ValueError, match=expected):
        Trainer(model, optimizer, data, None, settings, world=world)
    with pytest.raises(ValueError, match=expected):  # hvdtrain.init itself, once Horovod runs
        startup.init(seed=1, threads=1, hierarchical_allreduce=True)
