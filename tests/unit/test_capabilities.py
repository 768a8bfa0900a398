"""Every strategy's capabilities come from one table (hvdtrain.common.capabilities): each registered
class holds its record, and the settings' checks and the classes read the same one."""
import pytest

from hvdtrain.common import capabilities as caps
from hvdtrain.config.train import TrainConfig
from hvdtrain.strategies import registry


def test_every_registered_strategy_is_declared_and_its_class_holds_its_record_under_its_name():
    assert set(registry.STRATEGIES) == set(caps.DECLARED)
    for name in registry.STRATEGIES:
        cls = registry.strategy_class(name)
        assert cls.name == name
        assert cls.capabilities is caps.DECLARED[name]


def test_the_model_parallel_layout_is_registered_but_not_a_value_of_train_strategy():
    assert caps.MODEL_PARALLEL in registry.STRATEGIES and caps.MODEL_PARALLEL not in caps.STRATEGY_NAMES
    with pytest.raises(ValueError, match="strategy"):
        TrainConfig(strategy=caps.MODEL_PARALLEL)


def test_a_capability_nobody_knows_is_an_error_and_a_record_cannot_be_changed():
    with pytest.raises(ValueError, match="unknown capabilities"):
        caps.Capabilities(refuses={"teleport": "no"})
    with pytest.raises(TypeError):
        caps.DECLARED["ddp"].refuses[caps.COMPILE] = "changed"


@pytest.mark.parametrize("capability", [caps.COMPILE, caps.ADASUM, caps.SHARDED_CHECKPOINTS, caps.ELASTIC, caps.MESH])
def test_supporting_lists_exactly_the_strategies_that_do_not_refuse(capability):
    expected = [name for name in caps.STRATEGY_NAMES if capability not in caps.DECLARED[name].refuses]
    assert caps.supporting(capability) == expected


def test_a_strategy_of_ones_own_declares_its_record_and_keeps_it():
    from hvdtrain.strategies.base import Strategy

    mine = caps.Capabilities(refuses={caps.COMPILE: "not tried"})

    class Mine(Strategy):
        name = "mine"
        capabilities = mine

    class Plain(Strategy):
        name = "plain"

    assert Mine.capabilities is mine and Plain.capabilities == caps.Capabilities()


def test_how_a_strategy_declares_it_loads_is_what_its_class_implements():
    """The checkpoint layer reads ``loads`` instead of asking which class it holds: the declaration
    must name the methods the class has (own shards: the flat buckets' shard state); every strategy
    reads any tensor source (load_from)."""
    from hvdtrain.strategies.sharding.sliced import ShardedStrategy, SlicedStateStrategy

    for name in registry.STRATEGIES:
        cls = registry.strategy_class(name)
        loads = cls.capabilities.loads
        # fsdp x experts is fsdp's class, but its files are a mesh's (its experts lie outside the units):
        # it refuses to read one rank's file alone, as its declaration (every part) says
        own_shards = (issubclass(cls, ShardedStrategy) and cls.capabilities.supports(caps.SHARDED_CHECKPOINTS)
                      and cls.load_shard_state_dict is ShardedStrategy.load_shard_state_dict)
        assert own_shards == (loads == caps.OWN_SHARD), name
        # every strategy reads a source through load_from; a mesh reads every rank's file even at its own layout
        assert callable(getattr(cls, "load_from", None)) and callable(getattr(cls, "read_part", None)), name
        # every strategy whose optimizer steps slices (or split experts) clips a gradient norm as a collective
        if issubclass(cls, SlicedStateStrategy) or loads == caps.EVERY_PART or name == caps.EXPERT_PARALLEL:
            assert cls.capabilities.shards_gradients, name
        else:
            assert not cls.capabilities.shards_gradients, name
