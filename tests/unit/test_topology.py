"""The topology owns every process set: its group arithmetic (every group of every rank, named, for a few
shapes), and its sets made once each, in one order every rank computes alike, shared between live
topologies and all removed at the end (Horovod's add/remove_process_set replaced by a recorder)."""
import pytest
import torch

from hvdtrain.common.errors import LayoutError
from hvdtrain.distributed import startup
from hvdtrain.distributed.world import World
from hvdtrain.parallel import topology as topo
from hvdtrain.parallel.experts import ExpertGroups
from hvdtrain.parallel.mesh import Mesh, MeshShape
from hvdtrain.parallel.sequence.groups import group_ranks
from hvdtrain.parallel.topology import GROUP_NAMES, Dimensions, HybridGroups, Topology


def world(rank, size):
    return World(rank=rank, size=size, local_rank=rank, local_size=size, cross_rank=0, cross_size=1,
                 hostname="hostA", controller="gloo", launcher="test", threads=1, device=torch.device("cpu"))


class FakeHorovod:
    """Records every process set made and removed, as Horovod would number them."""

    global_process_set = "global"

    def __init__(self):
        self.added, self.removed = [], []

    def add_process_set(self, ranks):
        self.added.append(tuple(ranks))
        return ("set", tuple(ranks))

    def remove_process_set(self, process_set):
        self.removed.append(process_set[1])


@pytest.fixture
def hvd(monkeypatch):
    fake = FakeHorovod()
    monkeypatch.setattr(topo, "hvd", fake)
    monkeypatch.setattr(topo, "PROCESS_SETS", topo.ProcessSets())
    monkeypatch.setattr(startup, "dynamic_process_sets_enabled", lambda: True)
    return fake


SHAPES = [dict(world_size=8, tensor=2, pipeline=2), dict(world_size=8, tensor=2, sequence=2),
          dict(world_size=8, sequence=4), dict(world_size=8, experts=2), dict(world_size=8, shard=4),
          dict(world_size=4, pipeline=4), dict(world_size=4, tensor=4)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_every_group_of_every_rank_holds_it_and_is_among_all_groups(shape):
    dims = Dimensions(**shape)
    every = dims.all_groups()
    assert len({ranks for _, ranks in every}) == len(every)  # each distinct ranks once
    assert all(name in GROUP_NAMES and len(ranks) > 1 for name, ranks in every)
    distinct = {ranks for _, ranks in every}
    for rank in range(dims.world_size):
        for name, ranks in dims.groups_of(rank).items():
            assert rank in ranks and list(ranks) == sorted(ranks), (name, ranks)
            assert len(ranks) == 1 or ranks in distinct, (name, ranks)
    # Every dimension partitions the world: each rank in one group of each name.
    for name in ("tensor", "data", "pipeline", "sequence", "expert", "expert_replica", "shard", "replica"):
        groups = {dims.groups_of(r).get(name) for r in range(dims.world_size)} - {None}
        if groups:
            assert sorted(r for g in groups for r in g) == list(range(dims.world_size)), name


def test_the_mesh_groups_are_the_meshs_and_the_order_is_tensor_pipeline_data():
    dims, shape = Dimensions(8, tensor=2, pipeline=2), MeshShape.for_world(8, 2, 2)
    assert [ranks for _, ranks in dims.all_groups()[:len(list(shape.all_groups()))]] == list(shape.all_groups())
    assert dims.groups_of(5) == {"tensor": (4, 5), "data": (1, 5), "pipeline": (5, 7), "next pair": (5, 7),
                                 "ends": (5, 7)}
    assert dims.groups_of(7)["previous pair"] == (5, 7) and "next pair" not in dims.groups_of(7)
    assert dims.coordinates(6) == {"data": (1, 2), "stage": (1, 2), "tensor": (0, 2)}
    assert dims.sizes() == {"dp_replicate": 2, "dp_shard": 1, "tp": 2, "pp": 2, "sp": 1, "ep": 1}


def test_sequence_groups_sit_in_the_data_axis_around_the_tensor_groups():
    dims = Dimensions(8, tensor=2, sequence=2)
    assert [dims.groups_of(r)["sequence"] for r in range(4)] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert [g for name, g in dims.all_groups() if name == "sequence"] == group_ranks(8, 2, 2)
    assert dims.describe(3, "hostA") == "rank 3 on hostA: data 1/4, tensor 1/2, sequence 1/2"


def test_expert_and_hsdp_groups_are_consecutive_with_strided_replicas():
    experts = Dimensions(8, experts=4)
    assert experts.groups_of(5) == {"expert": (4, 5, 6, 7), "expert_replica": (1, 5)}
    shard = Dimensions(8, shard=2)
    assert shard.groups_of(5) == {"shard": (4, 5), "replica": (1, 3, 5, 7)}
    assert shard.sizes()["dp_shard"] == 2 and shard.sizes()["dp_replicate"] == 4


@pytest.mark.parametrize("shape, says", [
    (dict(world_size=8, tensor=2, experts=2), "expert parallelism does not combine with tensor"),
    (dict(world_size=8, pipeline=2, sequence=2), "a pipeline's stages pass whole micro-batches"),
    (dict(world_size=8, sequence=2, shard=2), "does not work with strategy=hsdp"),
    (dict(world_size=6, tensor=4), "does not divide the 6 workers"),
    (dict(world_size=6, sequence=4), "does not divide the 6 workers"),
    (dict(world_size=6, experts=4), "does not divide the 6 workers"),
    (dict(world_size=6, shard=4), "hsdp_shard_size to a divisor of 6"),
    (dict(world_size=4, experts=0), "expert_parallel must be a whole number >= 1"),
])
def test_dimensions_are_checked_once_with_the_rules_reason(shape, says):
    with pytest.raises(LayoutError, match=says):
        Dimensions(**shape)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_every_rank_makes_the_same_sets_once_in_one_order_and_closes_them_all(monkeypatch, shape):
    orders = []
    for rank in range(shape["world_size"]):
        fake = FakeHorovod()
        monkeypatch.setattr(topo, "hvd", fake)
        monkeypatch.setattr(topo, "PROCESS_SETS", topo.ProcessSets())
        monkeypatch.setattr(startup, "dynamic_process_sets_enabled", lambda: True)
        sizes = {k: v for k, v in shape.items() if k != "world_size"}
        topology = Topology(world(rank, shape["world_size"]), Dimensions(shape["world_size"], **sizes))
        assert len(fake.added) == len(set(fake.added))  # none twice
        assert set(fake.added) == {g for _, g in topology.dimensions.all_groups() if len(g) < shape["world_size"]}
        topology.close()
        topology.close()
        assert sorted(fake.removed) == sorted(fake.added) and topo.PROCESS_SETS.held() == {}
        orders.append(fake.added)
    assert all(order == orders[0] for order in orders)


def test_the_views_carry_the_topologys_sets(hvd):
    topology = Topology.build(world(5, 8), tensor_parallel=2, pipeline_parallel=2)
    assert topology.mesh.tensor.ranks == (4, 5) and topology.mesh.tensor.process_set == ("set", (4, 5))
    assert topology.group("data").process_set == ("set", (1, 5)) and topology.group("sequence") is None
    assert topology.mesh.ends.ranks == (5, 7) and topology.sequence is None and topology.experts is None
    whole = Topology.build(world(1, 2), tensor_parallel=2)  # a group of the whole world: Horovod's global set
    assert whole.mesh.tensor.process_set == "global" and whole.mesh.data.process_set is None
    sequence = Topology.build(world(3, 8), tensor_parallel=2, sequence_parallel=2)
    assert sequence.sequence.ranks == (1, 3) and sequence.sequence.process_set == ("set", (1, 3))
    assert sequence.data_world.size == 2 and sequence.data_world.rank == 0


def test_a_set_of_the_same_ranks_is_shared_by_live_topologies_and_the_thin_mesh_path(hvd):
    first = Topology.build(world(0, 4), pipeline_parallel=2)
    made = list(hvd.added)
    second = Topology.build(world(0, 4), pipeline_parallel=2)
    mesh = Mesh.build(4, 0, pipeline=2)  # a bench's or a test's mesh: through the same registry
    assert hvd.added == made and mesh.pipeline.process_set == first.mesh.pipeline.process_set
    first.close()
    mesh.close()
    assert hvd.removed == []
    second.close()
    assert sorted(hvd.removed) == sorted(made) and topo.PROCESS_SETS.held() == {}


def test_a_strategy_asks_the_topology_for_its_groups_or_makes_one_of_its_own(hvd):
    run = Topology.build(world(2, 4))
    experts = ExpertGroups.of(world(2, 4), 2, run)  # the run's topology extended: it closes them
    assert run.experts is experts and experts.expert.ranks == (2, 3) and experts.replica.ranks == (0, 2)
    assert run.dimensions.experts == 2 and run.group("expert_replica").process_set == ("set", (0, 2))
    experts.close()
    assert hvd.removed == []
    assert ExpertGroups.of(world(2, 4), 2, run) is run.experts  # asked again: the same, nothing made
    run.close()
    assert sorted(hvd.removed) == sorted(hvd.added)
    own = HybridGroups.of(world(1, 4), 2)  # no topology given (a unit test's strategy): its own, which it closes
    assert own.shard.ranks == (0, 1) and own.replica.ranks == (1, 3)
    own.close()
    assert topo.PROCESS_SETS.held() == {}


def test_extending_refuses_another_size_and_a_combination_the_rules_refuse(hvd):
    run = Topology.build(world(0, 4), expert_parallel=2)
    with pytest.raises(ValueError, match="expert_parallel is 2 already|experts is 2 already"):
        run.extend(experts=4)
    with pytest.raises(LayoutError, match="does not work with strategy=hsdp"):
        run.extend(shard=2)
    run.close()


def test_without_dynamic_process_sets_it_is_refused_before_any_set_is_made(hvd, monkeypatch):
    monkeypatch.setattr(startup, "dynamic_process_sets_enabled", lambda: False)
    with pytest.raises(ValueError):
        Topology.build(world(0, 4), tensor_parallel=2)
    assert hvd.added == []
    Topology.build(world(0, 4)).close()  # data parallelism alone makes none


def test_elastic_reform_is_refused_with_a_mesh_or_sequence_groups(hvd):
    with pytest.raises(RuntimeError, match="fixed at start"):
        Topology.build(world(0, 4), sequence_parallel=2).reform()
