import pytest

from hvdtrain.data import ShardedSampler


def shards(dataset_size, world_size, epoch=0, seed=0, **kwargs):
    result = []
    for rank in range(world_size):
        sampler = ShardedSampler(dataset_size, rank, world_size, seed=seed, **kwargs)
        sampler.set_epoch(epoch)
        result.append(list(sampler))
    return result


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
def test_shards_are_disjoint_and_cover_when_the_size_divides(world_size):
    parts = shards(84, world_size)
    union = [i for part in parts for i in part]
    assert sorted(union) == list(range(84))
    assert {len(part) for part in parts} == {84 // world_size}


@pytest.mark.parametrize("dataset_size,world_size", [(10, 4), (7, 2), (3, 4)])
def test_uneven_training_shards_are_padded_to_equal_length_and_still_cover(dataset_size, world_size):
    parts = shards(dataset_size, world_size)
    # Equal lengths: ranks take equal step counts and never wait on each other forever.
    assert len({len(part) for part in parts}) == 1
    assert set(i for part in parts for i in part) == set(range(dataset_size))
    assert len(parts[0]) * world_size - dataset_size < world_size


def test_evaluation_shards_are_not_padded_and_count_every_sample_once():
    parts = shards(10, 4, shuffle=False, pad=False)
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
])
def test_bad_arguments_are_refused_with_a_clear_message(args, message):
    with pytest.raises(ValueError, match=message):
        ShardedSampler(*args)
