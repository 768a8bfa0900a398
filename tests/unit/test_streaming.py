"""StreamShards alone (no MPI: rank and world size given): the slice of each rank, the dropped
tail, a seeking source, len(), and the refusals."""
import pytest
from torch.utils.data import DataLoader

from hvdtrain.data.streaming import StreamShards, is_stream, stream_length


def ranks(source, world_size, batch_size, global_batch=None, epoch=0, start=0):
    shards = [StreamShards(source, rank, world_size, batch_size, global_batch) for rank in range(world_size)]
    for shard in shards:
        shard.set_epoch(epoch, start)
    return [list(shard) for shard in shards]


def test_each_rank_takes_every_world_size_th_sample_and_training_drops_the_incomplete_global_batch():
    assert ranks(list(range(11)), 2, 2, global_batch=4) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert ranks(list(range(11)), 2, 2) == [[0, 2, 4, 6, 8, 10], [1, 3, 5, 7, 9]]
    assert ranks(list(range(11)), 2, 2, global_batch=4, start=4) == [[4, 6], [5, 7]]


def test_a_seeking_source_is_asked_for_the_epoch_from_its_start():
    class Seeking:
        def __iter__(self):
            raise AssertionError("a source with iter_from is not read from its beginning")

        def iter_from(self, epoch, start):
            return iter(range(100 * epoch + start, 100 * epoch + 10))

    assert ranks(Seeking(), 2, 1, global_batch=2, epoch=3, start=6) == [[306, 308], [307, 309]]


def test_len_counts_this_ranks_samples_and_is_a_type_error_without_one():
    shard = StreamShards(list(range(11)), 1, 2, 2, global_batch=4)
    assert len(shard) == 4
    shard.set_epoch(0, 8)
    assert len(shard) == 0
    with pytest.raises(TypeError, match="has no len"):
        len(StreamShards(lambda epoch: iter(()), 0, 1, 1))
    assert stream_length(lambda epoch: iter(())) is None


def test_what_is_a_stream_and_what_is_refused():
    assert is_stream(lambda epoch: iter(())) and is_stream({1, 2}) and not is_stream([1, 2])
    with pytest.raises(TypeError, match="DataLoader is not a dataset"):
        is_stream(DataLoader([1, 2]))
    with pytest.raises(TypeError, match="generator object"):
        StreamShards((i for i in range(3)), 0, 1, 1)
    with pytest.raises(TypeError, match="iterable or a function"):
        StreamShards(3, 0, 1, 1)
    with pytest.raises(ValueError, match="multiple of batch_size x world size"):
        StreamShards([1], 0, 2, 2, global_batch=6)
    with pytest.raises(ValueError, match="outside the world"):
        StreamShards([1], 2, 2, 1)
