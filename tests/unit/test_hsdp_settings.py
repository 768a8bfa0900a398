"""train.strategy=hsdp's settings: what it refuses, with the way out, before any collective (the settings'
checks on a login node, the launch's on every rank alike)."""
import pytest
import torch

from hvdtrain.common.capabilities import DECLARED, ELASTIC, EVERY_PART, SHARDED_CHECKPOINTS, STRATEGY_NAMES
from hvdtrain.config.train import TrainConfig
from hvdtrain.distributed.world import World
from hvdtrain.strategies import registry
from hvdtrain.strategies.fsdp.hybrid import hosts_refusal, refusal, replica_group_ranks, shard_group_ranks


def world(size, local_size):
    return World(rank=0, size=size, local_rank=0, local_size=local_size, cross_rank=0, cross_size=size // local_size,
                 hostname="h", controller="mpi", launcher="test", threads=1, device=torch.device("cpu"))


def test_hsdp_is_a_strategy_that_needs_process_sets():
    assert "hsdp" in STRATEGY_NAMES and registry.strategy_class("hsdp").__name__ == "HSDPStrategy"
    config = TrainConfig(strategy="hsdp", hsdp_shard_size=2)
    assert config.needs_process_sets and not TrainConfig(strategy="fsdp").needs_process_sets


@pytest.mark.parametrize("setting, size, local, message", [
    (3, 4, 4, "train.strategy=hsdp with 3 ranks per shard group (train.hsdp_shard_size) does not divide the 4 "
              "workers: run 3 or 6 or 9 workers, or set train.hsdp_shard_size to a divisor of 4"),
    (0, 6, 4, "train.strategy=hsdp with 4 ranks per shard group (the ranks of one host) does not divide the 6 "
              "workers"),
    (1, 4, 4, "train.strategy=hsdp with one rank per shard group (train.hsdp_shard_size=1) holds the whole model "
              "on every rank, as ddp does: use train.strategy=ddp, or set train.hsdp_shard_size > 1"),
    (0, 4, 1, "with one rank per shard group (each host runs one rank)"),
    (-2, 4, 4, "train.hsdp_shard_size must be a whole number >= 0"),
])
def test_a_shard_group_that_does_not_fit_the_world_is_refused(setting, size, local, message):
    assert message in refusal(setting, size, local, homogeneous=True)


def test_uneven_hosts_are_refused_unless_the_size_is_given():
    assert "the hosts run different numbers of ranks" in refusal(0, 6, 2, homogeneous=False)
    assert refusal(2, 6, 2, homogeneous=False) is None and refusal(0, 8, 4, homogeneous=True) is None


def test_host_sized_groups_must_be_hosts():
    assert hosts_refusal(["a", "a", "b", "b"], 2) is None
    assert "ranks 0..1 run on a, b: place ranks host by host" in hosts_refusal(["a", "b", "a", "b"], 2)


def test_the_launch_refuses_it_on_every_rank_alike():
    config = TrainConfig(strategy="hsdp", hsdp_shard_size=3)
    assert "does not divide the 4 workers" in registry.launch_refusal(config, world(4, 4), elastic=False)
    assert registry.launch_refusal(TrainConfig(strategy="hsdp", hsdp_shard_size=2), world(4, 4), False) is None
    assert "does not support Horovod elastic" in registry.launch_refusal(config, world(4, 4), elastic=True)


def test_its_groups_are_consecutive_shards_and_strided_replicas():
    assert [shard_group_ranks(8, r, 4) for r in (0, 5)] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert [replica_group_ranks(8, r, 4) for r in (0, 5)] == [(0, 4), (1, 5)]


@pytest.mark.parametrize("settings, message", [
    (dict(hsdp_shard_size=2), "hsdp_shard_size=2 applies to strategy=hsdp only"),
    (dict(strategy="hsdp", expert_parallel=2), "expert_parallel=2 does not work with strategy=hsdp"),
    (dict(strategy="hsdp", tensor_parallel=2), "does not work with strategy=hsdp"),
    (dict(strategy="hsdp", sequence_parallel=2), "does not work with strategy=hsdp"),
])
def test_the_settings_it_does_not_combine_with_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**settings)
    assert not DECLARED["hsdp"].supports(ELASTIC)


def test_its_sharded_checkpoints_are_a_meshs_read_from_every_part():
    """hsdp writes the sharded format (the first shard group's slices, each element once), read from every
    rank's file (hvdtrain.strategies.fsdp.hybrid)."""
    TrainConfig(strategy="hsdp", checkpoint_format="sharded")
    assert DECLARED["hsdp"].supports(SHARDED_CHECKPOINTS) and DECLARED["hsdp"].loads == EVERY_PART
