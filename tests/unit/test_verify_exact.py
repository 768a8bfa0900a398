"""hvdtrain.verify.exact: inside float64_throughout a float64 tensor is never rounded to float32."""
import torch
import torch.nn.functional as F

from hvdtrain.verify.exact import float64_throughout


def test_every_softmax_spelling_stays_float64_inside_and_rounds_outside():
    x = torch.randn(5, dtype=torch.float64)
    with float64_throughout():
        # F.softmax (eager attention) and the tensor method (a router's logits.softmax(dtype=...))
        assert F.softmax(x, dim=-1, dtype=torch.float32).dtype is torch.float64
        assert x.softmax(dim=-1, dtype=torch.float32).dtype is torch.float64
        assert x.log_softmax(-1, dtype=torch.float32).dtype is torch.float64
        assert x.float().dtype is torch.float64 and x.to(torch.float32).dtype is torch.float64
        assert torch.randn(2).softmax(-1, dtype=torch.float32).dtype is torch.float32  # other dtypes untouched
    assert x.softmax(dim=-1, dtype=torch.float32).dtype is torch.float32
    assert F.softmax(x, dim=-1, dtype=torch.float32).dtype is torch.float32


def test_a_tensor_made_like_a_float64_one_stays_float64_inside_and_rounds_outside():
    x = torch.randn(3, dtype=torch.float64)
    with float64_throughout():
        assert torch.zeros_like(x, dtype=torch.float32).dtype is torch.float64  # Inkling2's expert accumulator
        assert torch.full_like(x, 2.0, dtype=torch.float32).dtype is torch.float64
        assert torch.ones_like(x, dtype=torch.bool).dtype is torch.bool  # not a narrower float: untouched
        assert torch.zeros_like(torch.randn(3), dtype=torch.float16).dtype is torch.float16
    assert torch.zeros_like(x, dtype=torch.float32).dtype is torch.float32
