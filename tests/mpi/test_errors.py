"""Ranks that disagree on a collective get an error, not a hang; the job stays usable after it."""
import pytest
import torch

import horovod.torch as hvd

from hvdtrain.distributed import collectives
pytestmark = pytest.mark.mpi


def test_allreduce_with_different_shapes_raises_on_every_rank(world):
    if world.size < 2:
        pytest.skip("needs two ranks to disagree")
    mismatched = torch.ones(world.rank + 1, 3)
    with pytest.raises(RuntimeError, match="(?i)mismatched.*shape"):
        collectives.allreduce_sum(mismatched, name="errors.shape")
    # The failed collective must leave Horovod working: the next one succeeds everywhere.
    total = collectives.allreduce_sum(torch.ones(2), name="errors.after_shape")
    assert total.tolist() == [world.size, world.size]


def test_allreduce_with_different_dtypes_raises_on_every_rank(world):
    if world.size < 2:
        pytest.skip("needs two ranks to disagree")
    dtype = torch.float32 if world.rank == 0 else torch.float64
    with pytest.raises(RuntimeError, match="(?i)mismatched.*(type|dtype)"):
        collectives.allreduce_sum(torch.ones(4, dtype=dtype), name="errors.dtype")
    total = collectives.allreduce_sum(torch.ones(1), name="errors.after_dtype")
    assert total.item() == world.size


def test_broadcast_from_different_roots_raises_on_every_rank(world):
    if world.size < 2:
        pytest.skip("needs two ranks to disagree")
    with pytest.raises(RuntimeError, match="(?i)mismatched.*root"):
        hvd.broadcast(torch.ones(3), root_rank=world.rank, name="errors.root")
