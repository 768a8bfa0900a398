"""The mesh's arithmetic (no Horovod): coordinates, groups, the layout lines and the settings that
choose a layout, each refused with a message that says what to change."""
import pytest

from hvdtrain.config.train import TrainConfig
from hvdtrain.strategies.model_parallel.strategy import deal_out
from hvdtrain.parallel.mesh import MeshShape, layout_lines


def test_tensor_is_innermost_then_stages_then_data():
    shape = MeshShape.for_world(8, tensor=2, pipeline=2)
    assert (shape.data, shape.pipeline, shape.tensor) == (2, 2, 2)
    assert [tuple(shape.coordinates(r)) for r in range(8)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert all(shape.rank_of(*shape.coordinates(r)) == r for r in range(8))


def test_groups_partition_the_world_along_each_axis():
    shape = MeshShape.for_world(8, tensor=2, pipeline=2)
    for group_of in (shape.tensor_group, shape.data_group, shape.pipeline_group):
        groups = {group_of(r) for r in range(8)}
        assert sorted(r for g in groups for r in g) == list(range(8)), "each rank in exactly one group"
        assert all(r in group_of(r) for r in range(8))
    assert shape.tensor_group(5) == (4, 5)
    assert shape.data_group(5) == (1, 5)
    assert shape.pipeline_group(5) == (5, 7)
    assert shape.stage_pair(5, 0) == (5, 7) and shape.stage_pair(5, 1) is None
    assert shape.ends(2) == (0, 2)


def test_every_group_is_listed_once_in_one_order():
    shape = MeshShape.for_world(8, tensor=2, pipeline=2)
    groups = list(shape.all_groups())
    assert len(groups) == len(set(groups))
    assert groups == list(MeshShape.for_world(8, tensor=2, pipeline=2).all_groups())
    assert all(len(g) > 1 for g in groups), "a group of one rank has nothing to communicate"


def test_a_layout_that_does_not_divide_the_world_says_which_would():
    with pytest.raises(ValueError, match=r"tensor_parallel=3 x train.pipeline_parallel=1 = 3 ranks per model "
                                         r"replica does not divide the 2 workers: run 3 or 6 or 9 workers"):
        MeshShape.for_world(2, tensor=3)
    with pytest.raises(ValueError, match="pipeline_parallel must be a whole number >= 1"):
        MeshShape.for_world(4, pipeline=0)


def test_the_start_lines_say_where_every_rank_is():
    lines = layout_lines(MeshShape.for_world(4, tensor=2, pipeline=2), ["hostA", "hostA", "hostB", "hostB"])
    assert lines[1] == "rank 1 on hostA: data 0/1, stage 0/2, tensor 1/2"
    assert lines[2] == "rank 2 on hostB: data 0/1, stage 1/2, tensor 0/2"


@pytest.mark.parametrize("settings, message", [
    (dict(micro_batches=2), "micro_batches=2 cuts the batch for a pipeline, but pipeline_parallel=1"),
    (dict(pipeline_parallel=2, micro_batches=3, batch_size=16), "micro_batches=3 does not divide batch_size=16"),
    (dict(tensor_parallel=2, strategy="zero2"), "does not work with strategy=zero2.*or zero1"),
    (dict(pipeline_parallel=2, strategy="fsdp"), "does not work with strategy=fsdp"),
    (dict(pipeline_parallel=2, precision="fp16"), "does not work with precision=fp16"),
    (dict(tensor_parallel=2, compile=True), "does not work with compile"),
    (dict(tensor_parallel=2, sync_batchnorm=True), "does not work with sync_batchnorm"),
    (dict(pipeline_parallel=2, pipeline_schedule="interleaved"), "pipeline_schedule must be one of gpipe, 1f1b, zb-h1"),
    (dict(pipeline_parallel=2, pipeline_virtual_stages=0), "pipeline_virtual_stages must be a whole number >= 1"),
    (dict(pipeline_virtual_stages=2), "set pipeline_parallel > 1, or pipeline_virtual_stages=1"),
    (dict(pipeline_parallel=2, micro_batches=2, pipeline_virtual_stages=2, pipeline_schedule="zb-h1"),
     "interleaves the 1f1b schedule; pipeline_schedule=zb-h1 runs one chunk per stage"),
    (dict(pipeline_parallel=2, micro_batches=3, batch_size=6, pipeline_virtual_stages=2),
     "micro_batches=3 is not a multiple of it; choose micro_batches a multiple of 2"),
    (dict(tensor_parallel=0), "tensor_parallel must be a whole number >= 1"),
])
def test_model_parallel_settings_refused_with_the_reason(settings, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**settings)


def test_a_valid_layout_is_model_parallel():
    assert TrainConfig(tensor_parallel=2, pipeline_parallel=2, micro_batches=4, precision="bf16").model_parallel
    assert TrainConfig(pipeline_parallel=2, strategy="zero1").model_parallel
    assert TrainConfig(pipeline_parallel=2, micro_batches=4, pipeline_virtual_stages=2).pipeline_virtual_stages == 2
    assert TrainConfig(pipeline_parallel=4, micro_batches=2, pipeline_schedule="zb-h1").pipeline_schedule == "zb-h1"
    # A mesh writes its own slices and stages: sharded checkpoints under ddp or zero1 data groups.
    assert TrainConfig(tensor_parallel=2, strategy="zero1", checkpoint_format="sharded").model_parallel
    assert TrainConfig(pipeline_parallel=2, checkpoint_format="sharded").model_parallel
    assert not TrainConfig().model_parallel


def test_zero1_deals_out_whole_parameters_evenly_and_alike_on_every_rank():
    sizes = [("a", 10), ("b", 40), ("c", 30), ("d", 20), ("e", 5), ("f", 5)]
    owner = deal_out(sizes, 2)
    loads = [sum(n for name, n in sizes if owner[name] == r) for r in range(2)]
    # b (40) to rank 0, c (30) to 1, d (20) to 1, a (10) to 0, e (5) to 0, f (5) to 1
    assert loads == [55, 55]
    assert deal_out(list(reversed(sizes)), 2) == owner  # the order they are listed in does not matter
    assert set(deal_out(sizes, 1).values()) == {0}  # ddp: one owner, every rank steps everything
    assert sorted(deal_out(sizes, 4).values()).count(3) >= 1  # every rank gets a share when there are enough
