"""hsdp (train.strategy=hsdp) is right when N workers in shard groups of K take the same steps as one
process with the whole batch, hold 1/K of the model and its optimizer state, and write a full state
that fsdp and hsdp at another K continue.

K = train.hsdp_shard_size simulates hosts on one machine: at 4 ranks K=2 is two hosts of two (the
shard groups {0, 1} and {2, 3}, the replica groups {0, 2} and {1, 3}) and K=4 fsdp's layout (one shard
group, no replica group), as K=2 is at 2 ranks. K=1 is ddp's layout, refused (use ddp).

Float64, AdamW with weight decay, 2 micro-batches per step and clipping that bites (max_grad_norm below
the gradient's norm), bound 1e-10: hsdp differs from one process only in the order of float64
additions (the reduce-scatter's mean over the shard group, then the mean over the replica group),
roundings of 1e-16 relative per step, while a slice averaged over the wrong ranks, a shard group's mean
not averaged across groups, a gradient norm that counts a slice once per replica, or a slice of the
wrong rank moves the weights by more than 1e-4 (every weight moves by more than 1e-3 here).
"""
import pytest
import torch
import torch.nn.functional as F

from hvdtrain.distributed import collectives
from hvdtrain.strategies.fsdp.hybrid import HSDPStrategy
from hvdtrain.strategies.fsdp.strategy import FSDPStrategy
from tests.mpi.helpers import synthetic_classification
from tests.mpi.test_fsdp import CLASSES, FEATURES, Blocks, flat, model_difference, reference_from
from tests.mpi.test_zero import MICRO_BATCH, global_batch, state_difference

pytestmark = [pytest.mark.mpi, pytest.mark.process_sets,
              pytest.mark.np4(reason="2 simulated hosts x 2 ranks: shard groups and replica groups both of 2")]

ACCUMULATION, MAX_NORM = 2, 0.5


def make_optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)


def hsdp_steps(strategy, data, world, steps, first=0):
    """The Trainer's loop by hand, clipping included: rank r takes rows r::N of each global batch."""
    rows = MICRO_BATCH * ACCUMULATION * world.size
    norms = []
    for step in range(first, first + steps):
        inputs, labels = global_batch(data, step, rows)
        mine = inputs[world.rank::world.size], labels[world.rank::world.size]
        for x, y in zip(mine[0].chunk(ACCUMULATION), mine[1].chunk(ACCUMULATION)):
            strategy.backward(F.cross_entropy(strategy.model(x), y) / ACCUMULATION)
        strategy.synchronize()
        norms.append(strategy.clip_grad_norm_(MAX_NORM))
        strategy.step()
        strategy.zero_grad()
    return norms


def reference_steps(model, optimizer, data, steps, rows, first=0):
    """One process, no Horovod, the whole global batch, clipped alike."""
    norms = []
    for step in range(first, first + steps):
        inputs, labels = global_batch(data, step, rows)
        optimizer.zero_grad()
        F.cross_entropy(model(inputs), labels).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
    return norms


def shard_sizes(world):
    """The K that divide the world: 2 (a host split at 4 ranks) and the world (fsdp's layout)."""
    return [k for k in (2, 4) if k <= world.size and world.size % k == 0]


@pytest.mark.timeout(240)
def test_hsdp_takes_one_process_steps_and_holds_one_kth(world):
    if world.size % 2:
        pytest.skip("hsdp needs shard groups of 2 ranks or more")
    data = synthetic_classification(samples=192, features=FEATURES, classes=CLASSES)
    rows = MICRO_BATCH * ACCUMULATION * world.size
    results, labels, held = [], [], []
    for k in shard_sizes(world):
        model = Blocks(seed=100 + world.rank)  # different on every rank: set-up must fix that
        psi = sum(p.numel() for p in model.parameters())
        strategy = HSDPStrategy(model, make_optimizer(model), world, ACCUMULATION, False, shard_size=k)
        strategy.broadcast_from_root()
        initial = strategy.state_dict()["model"]
        norms = hsdp_steps(strategy, data, world, 3)
        memory = strategy.memory_bytes()
        state = strategy.state_dict()
        gathered = collectives.allgather_rows(flat(state["model"]), name=f"hsdp.test.gathered.{k}")
        labels.append(strategy.label)
        padded = sum(b.padded_numel for b in strategy.buckets)
        held.append((k, psi, padded, memory, sum(b.shard.numel() for b in strategy.buckets)))
        strategy.close()
        strategy.close_groups()
        reference, reference_optimizer = reference_from(initial, make_optimizer)
        reference_norms = reference_steps(reference, reference_optimizer, data, 3, rows)
        results.append(torch.tensor([
            model_difference(state["model"], reference.state_dict()),
            state_difference(state["optimizer"], reference_optimizer.state_dict()),
            (flat(state["model"]) - flat(initial)).abs().min().item(),
            max(abs(a - b) for a, b in zip(norms, reference_norms)),
            min(reference_norms),
            float(torch.equal(gathered, gathered[:1].expand_as(gathered))),
        ], dtype=torch.float64))
    everywhere = collectives.allgather_rows(torch.stack(results).reshape(-1), name="hsdp.test.results")
    everywhere = everywhere.reshape(world.size, len(results), -1)
    print(f"\nhsdp at {world.size} ranks, K={shard_sizes(world)}: max |param - one process| "
          f"{everywhere[..., 0].max():.2e}, max |optimizer state - one process| {everywhere[..., 1].max():.2e}")

    assert labels == [f"hsdp {k} x {world.size // k}" for k in shard_sizes(world)]
    assert (everywhere[..., 4] > MAX_NORM).all(), "the clipping never bit: the test proves nothing of the norm"
    assert (everywhere[..., 2] > 0).all() and (everywhere[..., 0] < 1e-10).all(), \
        f"max |hsdp - one process| per rank and K: {everywhere[..., 0].tolist()}"
    assert (everywhere[..., 1] < 1e-10).all(), \
        f"max |optimizer state difference| (inf: not the same structure): {everywhere[..., 1].tolist()}"
    assert (everywhere[..., 3] < 1e-10).all(), f"|gradient norm - one process's|: {everywhere[..., 3].tolist()}"
    assert (everywhere[..., 5] == 1).all(), "the ranks' gathered models differ"
    for k, psi, padded, memory, shard_elements in held:
        # Float64: each rank holds 8 bytes per element of its slices, 1/K of the padded buffers (padding: under K
        # elements per buffer), and AdamW's two moments of them plus a scalar step per buffer.
        assert shard_elements * k == padded and padded - psi < k * 8
        assert memory["parameters"] == 8 * padded // k, (k, memory)
        assert 16 * padded // k <= memory["optimizer_state"] <= 16 * padded // k + 8 * 8, (k, memory)
        assert abs(memory["parameters"] / (8 * psi / k) - 1) < 0.02


@pytest.mark.timeout(240)
def test_a_full_checkpoint_goes_from_hsdp_to_fsdp_and_back(world):
    """hsdp at K=2 two steps, its full state into fsdp over every rank for one, and that into hsdp at K=N
    for one: the same four steps as one process."""
    data = synthetic_classification(samples=192, features=FEATURES, classes=CLASSES)
    rows = MICRO_BATCH * ACCUMULATION * world.size
    if world.size % 2:
        pytest.skip("hsdp at K=2 needs an even world")

    def hsdp(shard_size, state=None):
        model = Blocks(seed=7 + world.rank)
        strategy = HSDPStrategy(model, make_optimizer(model), world, ACCUMULATION, False, shard_size=shard_size)
        if state is None:
            strategy.broadcast_from_root()
        else:
            strategy.load_state_dict(state)
        return strategy

    first = hsdp(2)
    initial = first.state_dict()["model"]
    hsdp_steps(first, data, world, 2)
    saved = first.state_dict()
    first.close()
    first.close_groups()
    model = Blocks(seed=7)
    middle = FSDPStrategy(model, make_optimizer(model), world, ACCUMULATION, False)
    middle.load_state_dict(saved)
    hsdp_steps(middle, data, world, 1, first=2)
    saved = middle.state_dict()
    middle.close()
    last = hsdp(world.size, saved)
    hsdp_steps(last, data, world, 1, first=3)
    state = last.state_dict()
    last.close()
    last.close_groups()
    reference, reference_optimizer = reference_from(initial, make_optimizer)
    reference_steps(reference, reference_optimizer, data, 4, rows)
    local = torch.tensor([model_difference(state["model"], reference.state_dict()),
                          state_difference(state["optimizer"], reference_optimizer.state_dict())], dtype=torch.float64)
    everywhere = collectives.allgather_rows(local, name="hsdp.test.resume")

    assert (everywhere < 1e-10).all(), f"max |resumed - one process| (model, optimizer) per rank: {everywhere.tolist()}"


def test_a_shard_size_that_does_not_divide_the_world_is_refused_on_every_rank(world):
    model = Blocks(seed=0)
    with pytest.raises(ValueError) as raised:
        HSDPStrategy(model, make_optimizer(model), world, 1, False, shard_size=world.size + 1)
    assert (f"{world.size + 1} ranks per shard group (train.hsdp_shard_size) does not divide the {world.size} "
            f"workers") in str(raised.value)


def test_one_rank_per_shard_group_is_refused_with_ddp_as_the_way_out(world):
    model = Blocks(seed=0)
    with pytest.raises(ValueError, match=r"train.hsdp_shard_size=1\) holds the whole model on every rank, as ddp "
                                         r"does: use train.strategy=ddp"):
        HSDPStrategy(model, make_optimizer(model), world, 1, False, shard_size=1)


def hsdp_trainer(world, strategy, directory, max_steps, checkpoint_format="full"):
    """test_sharded_checkpoint's Trainer (two AdamW groups, a buffer and a frozen parameter kept whole), at
    hsdp_shard_size=2 under hsdp."""
    from hvdtrain.config.train import TrainConfig
    from hvdtrain.trainer import Trainer
    from tests.mpi.test_sharded_checkpoint import WithExtras
    from tests.mpi.test_zero import two_groups

    model = WithExtras(99)
    config = TrainConfig(epochs=5, batch_size=MICRO_BATCH, accumulation=2, lr=0.01, warmup_epochs=0.5, seed=9,
                         strategy=strategy, max_steps=max_steps, checkpoint_dir=directory, log_every=1000,
                         checkpoint_format=checkpoint_format, progress="off",
                         hsdp_shard_size=2 if strategy == "hsdp" else 0)
    return Trainer(model, torch.optim.AdamW(two_groups(model)),
                   synthetic_classification(samples=192, features=FEATURES, classes=5), None, config, world=world)


@pytest.mark.timeout(300)
def test_the_trainer_reshards_fsdps_sharded_checkpoint_into_hsdp_and_writes_a_full_one(world, tmp_path):
    """fsdp's sharded checkpoint at step 3 resumed under hsdp (K=2) holds bitwise the state its consolidation
    holds; hsdp's own full checkpoint at step 6 is one file, written once, that fsdp resumes from."""
    import shutil
    from pathlib import Path

    from hvdtrain.checkpoint.consolidate import consolidate
    from hvdtrain.checkpoint.formats import full, sharded
    from hvdtrain.distributed import rng
    from tests.mpi.test_sharded_checkpoint import flat_state, on_root, shared_directory

    if world.size % 2:
        pytest.skip("hsdp at K=2 needs an even world")
    base = shared_directory(world, tmp_path, "hsdp.resharded")
    writer = hsdp_trainer(world, "fsdp", f"{base}/direct", 3, checkpoint_format="sharded")
    writer.fit()
    newest = sharded.directory_name(3)
    on_root(world, lambda: shutil.copytree(f"{base}/direct", f"{base}/consolidated"))
    on_root(world, lambda: torch.save(consolidate(Path(f"{base}/consolidated/{newest}")),
                                      f"{base}/consolidated/{newest}.pt"))  # the full file wins at the same step
    loaded, started, ended = [], [], []
    for directory in ("direct", "consolidated"):
        rng.seed_everything(rng.rank_seed(1, world.rank))
        run = hsdp_trainer(world, "hsdp", f"{base}/{directory}", 6)
        started.append(run.global_step)
        loaded.append(flat_state(run.strategy))
        run.fit()
        ended.append(flat_state(run.strategy))
        label = run.strategy.label
        run.close_mesh()
    rng.seed_everything(rng.rank_seed(1, world.rank))
    after = hsdp_trainer(world, "fsdp", f"{base}/direct", 6)  # resumes hsdp's full checkpoint at step 6
    resumed = flat_state(after.strategy)
    written = sorted(path.name for path in Path(f"{base}/direct").iterdir()) if world.rank == 0 else []
    rows = collectives.allgather_rows(torch.stack([(loaded[0] - loaded[1]).abs().max(),
                                                   (ended[0] - ended[1]).abs().max(),
                                                   (resumed - ended[0]).abs().max(),
                                                   (ended[0] - loaded[0]).abs().max()]), name="hsdp.test.resharded")

    assert label == f"hsdp 2 x {world.size // 2}" and started == [3, 3] and after.global_step == 6
    assert (rows[:, 3] > 1e-4).all(), "hsdp's steps did not move the state: the test proves nothing"
    assert (rows[:, 0] == 0).all(), f"max |resharded - consolidated| at load per rank: {rows[:, 0].tolist()}"
    assert (rows[:, 1] == 0).all(), f"max |resharded - consolidated| after hsdp's steps: {rows[:, 1].tolist()}"
    assert (rows[:, 2] == 0).all(), f"max |fsdp resumed from hsdp's checkpoint - hsdp's|: {rows[:, 2].tolist()}"
    if world.rank == 0:  # hsdp's step-6 checkpoint: the full format's one file beside fsdp's sharded step 3
        assert newest in written and full.checkpoint_name(6) in written, written


def test_by_default_a_shard_group_is_the_ranks_of_one_host(world):
    """One machine is one host: K = Horovod's local size, every rank in one shard group (fsdp's layout)."""
    if world.local_size < 2:
        pytest.skip("one rank per host is ddp's layout, refused")
    model = Blocks(seed=0)
    strategy = HSDPStrategy(model, make_optimizer(model), world, 1, False)
    label, shard, replica = strategy.label, strategy.groups.shard.ranks, strategy.groups.replica.ranks
    strategy.close()
    strategy.close_groups()
    assert label == f"hsdp {world.local_size} x 1" and shard == tuple(range(world.size)) and replica == (world.rank,)
