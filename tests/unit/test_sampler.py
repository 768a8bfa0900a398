import resource
import tracemalloc

import pytest
import torch

from hvdtrain.data import sharding
from hvdtrain.data.sharding import FeistelOrder, ShardedSampler


@pytest.fixture(autouse=True, params=["listed", "computed"])
def order_kind(request, monkeypatch):
    """Every test here holds for both orders: torch.randperm's list, and the Feistel permutation that
    datasets past LISTED_ORDER_LIMIT get (here forced for every size)."""
    if request.param == "computed":
        monkeypatch.setattr(sharding, "LISTED_ORDER_LIMIT", 0)
    return request.param


def shards(dataset_size, world_size, epoch=0, seed=0, start=0, **kwargs):
    result = []
    for rank in range(world_size):
        sampler = ShardedSampler(dataset_size, rank, world_size, seed=seed, **kwargs)
        sampler.set_epoch(epoch, start=start)
        result.append(list(sampler))
    return result


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
def test_shards_are_disjoint_and_cover_when_the_size_divides(world_size):
    parts = shards(84, world_size)
    union = [i for part in parts for i in part]
    assert sorted(union) == list(range(84))
    assert {len(part) for part in parts} == {84 // world_size}


@pytest.mark.parametrize("dataset_size,world_size,global_batch", [(10, 4, 4), (7, 2, 2), (100, 3, 9), (64, 2, 64)])
def test_training_shards_hold_whole_global_batches_only(dataset_size, world_size, global_batch):
    parts = shards(dataset_size, world_size, global_batch=global_batch)
    kept = dataset_size // global_batch * global_batch
    # Equal lengths: ranks take equal step counts and never wait on each other forever.
    assert {len(part) for part in parts} == {kept // world_size}
    union = [i for part in parts for i in part]
    assert len(set(union)) == len(union) == kept, "a sample is repeated or missing"


def test_the_left_out_tail_changes_with_the_epoch():
    left_out = [set(range(10)) - set(i for part in shards(10, 2, epoch=e, global_batch=4) for i in part)
                for e in range(4)]
    assert all(len(tail) == 2 for tail in left_out)
    assert len({frozenset(tail) for tail in left_out}) > 1


def test_evaluation_shards_count_every_sample_once():
    parts = shards(10, 4, shuffle=False)
    assert sorted(i for part in parts for i in part) == list(range(10))
    assert [len(p) for p in parts] == [3, 3, 2, 2]


def test_order_changes_with_the_epoch_and_repeats_with_the_seed():
    assert shards(50, 2, epoch=0) != shards(50, 2, epoch=1)
    assert shards(50, 2, epoch=3, seed=9) == shards(50, 2, epoch=3, seed=9)
    assert shards(50, 2, epoch=0, seed=1) != shards(50, 2, epoch=0, seed=2)


@pytest.mark.parametrize("world_size,batch", [(1, 24), (2, 12), (4, 6), (3, 8)])
def test_global_batches_hold_the_same_samples_at_every_world_size(world_size, batch):
    """Batch k of all ranks together is the same set of samples whatever the worker count."""
    reference = shards(96, 1, epoch=2)[0]
    parts = shards(96, world_size, epoch=2)
    global_batch = batch * world_size
    for k in range(96 // global_batch):
        together = sorted(i for part in parts for i in part[k * batch:(k + 1) * batch])
        assert together == sorted(reference[k * global_batch:(k + 1) * global_batch])


@pytest.mark.parametrize("args,message", [
    ((0, 0, 1), "empty dataset"),
    ((10, 2, 2), "rank 2 is outside the world of size 2"),
    ((10, -1, 2), "rank -1 is outside"),
    ((10, 0, 0), "world_size must be >= 1"),
    ((10, 0, 4, 0, True, 6), "global_batch 6 must be a positive multiple of the world size 4"),
    ((10, 0, 4, 0, True, 12), "10 samples, fewer than one global batch of 12"),
])
def test_bad_arguments_are_refused_with_a_clear_message(args, message):
    with pytest.raises(ValueError, match=message):
        ShardedSampler(*args)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_a_resumed_epoch_continues_each_slice_exactly_where_it_stopped(world_size):
    full = shards(96, world_size, epoch=1)
    consumed = 24  # whole global batches of the global order
    for rank in range(world_size):
        sampler = ShardedSampler(96, rank, world_size)
        sampler.set_epoch(1, start=consumed)
        assert list(sampler) == full[rank][consumed // world_size:]
        assert len(sampler) == len(full[rank]) - consumed // world_size


@pytest.mark.parametrize("start,world_size,global_batch", [(24, 2, 8), (30, 3, 9), (16, 4, 12)])
def test_an_epoch_continued_at_another_world_size_takes_the_rest_in_whole_global_batches(
        start, world_size, global_batch):
    """An elastic job that shrinks or grows mid-epoch continues the same global order."""
    parts = shards(100, world_size, epoch=3, global_batch=global_batch, start=start)
    order = shards(100, 1, epoch=3)[0]
    taken = sorted(i for part in parts for i in part)
    expected_end = start + (100 - start) // global_batch * global_batch
    assert taken == sorted(order[start:expected_end])
    assert len({len(part) for part in parts}) == 1


def test_a_start_outside_the_epoch_is_refused():
    with pytest.raises(ValueError, match="start 101 is outside the epoch's 100 samples"):
        ShardedSampler(100, 0, 4).set_epoch(0, start=101)


@pytest.mark.parametrize("size", [1, 2, 3, 5, 16, 17, 100, 4097])
def test_the_computed_order_is_a_permutation_repeated_by_its_key(size):
    positions = torch.arange(size)
    order = FeistelOrder(size, key=7)(positions)
    assert sorted(order.tolist()) == list(range(size))
    assert torch.equal(FeistelOrder(size, key=7)(positions), order)
    if size >= 100:
        assert not torch.equal(FeistelOrder(size, key=8)(positions), order)
        assert (order != positions).double().mean() > 0.9  # shuffled, not a near-identity


def test_a_billion_samples_are_sharded_without_memory_that_grows_with_them(order_kind):
    """Rank 3 of 8 starts its epoch over 10^9 samples: the computed order takes a few MB where the
    listed one (torch.randperm) would take 8 GB of indices; its first samples are distinct and in range."""
    sampler = ShardedSampler(10 ** 9, rank=3, world_size=8, seed=1, global_batch=8 * 32)
    sampler.set_epoch(2, start=10 ** 6)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    tracemalloc.start()
    first = [index for index, _ in zip(sampler, range(100_000))]
    python_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - peak_rss

    assert len(set(first)) == len(first) == 100_000 and all(0 <= i < 10 ** 9 for i in first)
    assert python_peak < 64 * 2 ** 20, f"peak {python_peak / 2**20:.1f} MiB of Python allocations"
    assert grown < 2 ** 30, f"the process's peak grew by {grown / 2**20:.0f} MiB (randperm's would be 7.5 GiB)"
