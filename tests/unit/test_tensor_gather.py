"""hvdtrain.parallel.tensor.layers: an activation gathered from the tensor group's ranks is laid out as the
whole layer's output would be, so a forward that views it as the whole model does still can."""
from types import SimpleNamespace

import torch

from hvdtrain.parallel.tensor import layers as tensor


def test_a_gathered_activation_is_laid_out_as_a_whole_linears_output(monkeypatch):
    mine, theirs = torch.arange(6.0).view(1, 3, 2), torch.arange(6.0).view(1, 3, 2) + 100
    # Horovod concatenates every rank's tensor along dim 0; the other rank sent its part so too.
    monkeypatch.setattr(tensor.hvd, "allgather",
                        lambda x, name, process_set: torch.cat([x, theirs.movedim(-1, 0).contiguous()]))
    group = SimpleNamespace(size=2, index=0, process_set=object(), ranks=[0, 1])
    whole = tensor._allgather_last_dim(mine, group, "test.gather")
    assert torch.equal(whole, torch.cat([mine, theirs], dim=-1))
    assert whole.is_contiguous()
    assert whole.view(2, 3, -1).shape == (2, 3, 2)  # doge's router views its gathered logits so
