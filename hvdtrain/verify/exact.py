"""Float64 throughout: transformers' float32 steps made no-ops for float64 tensors.

transformers casts to float32 inside its RMSNorm (``hidden_states.to(torch.float32)``, Gemma's
``x.float()``) and its eager attention's softmax (``dtype=torch.float32``) even in a float64 model.
A layout changes how a value is computed (a batch split, a column split), which can move it across
one of those float32 roundings, and Adam turns a gradient element near its eps into a different
step: differences of 1e-7 that look like a wrong split and are not. Inside ``float64_throughout()``
a float64 tensor stays float64 where transformers would round it to float32, so a right layout is
within about 1e-13 of one process under AdamW and a wrong one stays orders of magnitude away.
Use it around both runs compared (the reference and the layout), never in training.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn.functional as F

_NARROWER = (torch.float32, torch.float16, torch.bfloat16)
# Tensors made like another: given a float64 one and a narrower dtype, made float64.
_MADE_LIKE = ("zeros_like", "ones_like", "empty_like", "full_like")


def _keep_float64(dtype: Any) -> Any:
    return torch.float64 if dtype in _NARROWER else dtype


@contextlib.contextmanager
def float64_throughout() -> Iterator[None]:
    """Within the block: a float64 tensor's ``.to(float32)`` / ``.float()`` / ``.type(float32)`` give
    it back as is, and ``softmax``/``log_softmax``/``sum(..., dtype=float32)`` of a float64 tensor
    computes in float64, as do the tensor methods (a router's ``logits.softmax(dim=-1,
    dtype=torch.float32)``, DeepSeek-V2's; DiffLlama sums its lambdas in float32: rounded so, their
    gradients differ with how the batch is cut, and Adam magnifies that near zero). A tensor made
    ``torch.zeros_like(x, dtype=torch.float32)`` of a float64 ``x`` is float64 too (Inkling2 sums
    its experts' outputs into such an accumulator: float32, it would round them, and index_add_ of
    the float64 outputs kept float64 above fails). Other dtypes are untouched (a float32 model
    rounds as it always does)."""
    to, float_, type_ = torch.Tensor.to, torch.Tensor.float, torch.Tensor.type
    softmax, log_softmax = F.softmax, F.log_softmax
    tensor_softmax, tensor_log_softmax = torch.Tensor.softmax, torch.Tensor.log_softmax
    sum_ = torch.sum
    made_like = {name: getattr(torch, name) for name in _MADE_LIKE}

    def patched_to(self, *args, **kwargs):
        if self.dtype is torch.float64:
            args = tuple(_keep_float64(a) if isinstance(a, torch.dtype) else a for a in args)
            if "dtype" in kwargs:
                kwargs["dtype"] = _keep_float64(kwargs["dtype"])
        return to(self, *args, **kwargs)

    def patched_float(self, *args, **kwargs):
        return self if self.dtype is torch.float64 else float_(self, *args, **kwargs)

    def patched_type(self, dtype=None, *args, **kwargs):
        if self.dtype is torch.float64 and dtype in _NARROWER + ("torch.FloatTensor",):
            return self
        return type_(self, dtype, *args, **kwargs) if dtype is not None else type_(self, *args, **kwargs)

    def widened(fn):
        def call(input, *args, **kwargs):
            if isinstance(input, torch.Tensor) and input.dtype is torch.float64 and "dtype" in kwargs:
                kwargs["dtype"] = _keep_float64(kwargs["dtype"])
            return fn(input, *args, **kwargs)
        return call

    torch.Tensor.to, torch.Tensor.float, torch.Tensor.type = patched_to, patched_float, patched_type
    F.softmax, F.log_softmax = widened(softmax), widened(log_softmax)
    torch.Tensor.softmax, torch.Tensor.log_softmax = widened(tensor_softmax), widened(tensor_log_softmax)
    torch.sum = widened(sum_)
    for name, fn in made_like.items():
        setattr(torch, name, widened(fn))
    try:
        yield
    finally:
        torch.Tensor.to, torch.Tensor.float, torch.Tensor.type = to, float_, type_
        F.softmax, F.log_softmax = softmax, log_softmax
        torch.Tensor.softmax, torch.Tensor.log_softmax = tensor_softmax, tensor_log_softmax
        torch.sum = sum_
        for name, fn in made_like.items():
            setattr(torch, name, fn)
