"""zero1/zero2 x expert parallelism without MPI: the setting chooses its strategy (which users cannot
name), its capability record, and ZeRO's buckets leaving out the parameters a subclass keeps whole."""
from types import SimpleNamespace

import pytest
import torch

from hvdtrain.common.capabilities import (DECLARED, ELASTIC, EVERY_PART, EXPERT_PARALLEL, EXPERT_PARALLEL_ZERO,
                                          STRATEGY_NAMES)
from hvdtrain.strategies.registry import chosen_name, strategy_class
from hvdtrain.strategies.sharding import flat_buckets as fb


def settings(strategy, experts=2):
    """What chosen_name reads of a TrainConfig (built without its checks: they belong to the settings)."""
    return SimpleNamespace(strategy=strategy, expert_parallel=experts, model_parallel=False)


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_zero_under_expert_parallel_chooses_its_own_strategy(strategy):
    assert chosen_name(settings(strategy)) == EXPERT_PARALLEL_ZERO
    assert chosen_name(settings(strategy, experts=1)) == strategy
    cls = strategy_class(EXPERT_PARALLEL_ZERO)
    assert cls.__name__ == "ExpertParallelZeroStrategy" and cls.capabilities is DECLARED[EXPERT_PARALLEL_ZERO]


def test_its_record_refuses_what_expert_parallelism_refuses_and_reads_every_part():
    record = DECLARED[EXPERT_PARALLEL_ZERO]
    assert dict(record.refuses) == dict(DECLARED[EXPERT_PARALLEL].refuses) and not record.supports(ELASTIC)
    assert record.loads == EVERY_PART and record.shards_gradients and record.collective_forward
    assert EXPERT_PARALLEL_ZERO not in STRATEGY_NAMES


def test_the_buckets_leave_out_the_parameters_kept_whole():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)).double()
    optimizer = torch.optim.AdamW(model.parameters())
    kept = model[0].weight
    before = kept.detach().clone()
    buckets = fb.bucket_parameters(model, optimizer, 2**20, rank=0, world_size=2, whole={id(kept)})
    bucketed = [p for bucket in buckets for p in bucket.params]
    assert all(p is not kept for p in bucketed) and len(bucketed) == 3
    assert [i for bucket in buckets for i in bucket.param_indices] == [3, 2, 1]  # the user's numbering kept
    assert kept.untyped_storage().data_ptr() != buckets[0].flat_param.untyped_storage().data_ptr()
    assert torch.equal(kept, before)
