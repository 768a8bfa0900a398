"""BatchNorm over the global batch on every device Horovod runs on (CPU over MPI or Gloo, GPU over NCCL).

N workers x batch B normalize with the statistics one process with the N*B batch computes: two
all-reduces per layer forward (sum and count, then the squared deviations: exact up to summation
order) and two backward. Horovod's own ``hvd.SyncBatchNorm`` refuses CPU tensors, so this one is
plain tensor operations and Horovod all-reduces. Each training forward and backward of every layer
is a collective: every rank runs them, in the same order (a rank with an empty batch adds count 0).
In eval mode, or without Horovod, the layer is torch's own BatchNorm.
"""
from __future__ import annotations

import itertools
from typing import Optional

import torch
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin

import horovod.torch as hvd

from hvdtrain.distributed import collectives
CONVERTIBLE = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d)
# Half-precision statistics would lose the sums: they are computed and all-reduced in float32.
_LOW_PRECISION = (torch.float16, torch.bfloat16)


class _AllreduceSum(torch.autograd.Function):
    """y = sum over ranks of x_r, differentiable.

    Every rank uses the same y, so the global loss L = sum_s L_s depends on x_r through y on every
    rank: dL/dx_r = sum_s dL_s/dy, i.e. the backward is the same all-reduce(Sum) of the gradients.
    (``hvd.allreduce`` has that backward too, but leaves the backward's collective unnamed, named
    by a per-process counter; a name of our own matches on every rank whatever else each ran.)
    """

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, name: str) -> torch.Tensor:
        ctx.name = name
        return collectives.allreduce_sum(tensor.contiguous(), name=name)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return collectives.allreduce_sum(grad.contiguous(), name=f"{ctx.name}.grad"), None


def _distributed() -> bool:
    """More than one rank to synchronize with (like torch.nn.SyncBatchNorm: without an initialized
    world, a plain BatchNorm)."""
    return hvd.is_initialized() and hvd.size() > 1


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over inputs (N, C, ...) of any rank >= 2 whose training statistics cover every rank.

    Parameters, buffers and state_dict keys are BatchNorm's, so checkpoints load either way.

    Args:
        num_features: C, the channels.
        eps: added to the variance.
        momentum: the running statistics' update factor (None: a cumulative average).
        affine: learn a scale and a shift per channel.
        track_running_stats: keep running statistics for evaluation.
        device: where the parameters and buffers are made.
        dtype: their dtype.
        name: names this layer's collectives: the same on every rank, different between layers.
            ``convert_sync_batchnorm`` gives each layer its qualified name in the model; None numbers a layer in
            construction order (so every rank must build the same layers in the same order).
    """

    _numbered = itertools.count()

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 affine: bool = True, track_running_stats: bool = True, device=None, dtype=None,
                 name: Optional[str] = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.name = name if name is not None else f"layer{next(SyncBatchNorm._numbered)}"

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, name={self.name!r}"

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected an input (N, C, ...) of at least 2 dimensions, got {input.dim()}D")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        batch_statistics = self.training or (self.running_mean is None and self.running_var is None)
        if not batch_statistics or not _distributed():
            return super().forward(input)  # torch's BatchNorm: running stats, or one process
        return self._synchronized(input)

    def _synchronized(self, input: torch.Tensor) -> torch.Tensor:
        # The running statistics' update, as torch's _BatchNorm.forward decides it.
        factor = 0.0 if self.momentum is None else self.momentum
        update = self.training and self.track_running_stats
        if update and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative average
                factor = 1.0 / float(self.num_batches_tracked)

        x = input.float() if input.dtype in _LOW_PRECISION else input
        dims = [0] + list(range(2, x.dim()))  # every dimension but the channels
        shape = [1, x.size(1)] + [1] * (x.dim() - 2)
        local_count = x.numel() // x.size(1) if x.size(1) else 0
        # 1. Global mean. The count rides along in the statistics' dtype: exact up to 2^24 values per
        # channel in float32, beyond that rounded at float32's own precision, like the sums.
        local = torch.cat([x.sum(dim=dims), x.new_full((1,), float(local_count))])
        totals = _AllreduceSum.apply(local, f"sync_batchnorm.{self.name}.mean")
        count = int(round(totals[-1].item()))
        if count <= 1:  # the same count on every rank: every rank raises here, none is left waiting
            raise ValueError(f"SyncBatchNorm {self.name!r}: expected more than 1 value per channel over all "
                             f"ranks when training, got {count} (this rank's input: {tuple(input.shape)})")
        mean = totals[:-1] / count
        # 2. Global variance, from the deviations from the global mean (second pass over x).
        centered = x - mean.reshape(shape)
        squares = _AllreduceSum.apply((centered * centered).sum(dim=dims), f"sync_batchnorm.{self.name}.var")
        var = squares / count
        out = centered * torch.rsqrt(var + self.eps).reshape(shape)
        if self.weight is not None:
            out = out * self.weight.reshape(shape)
        if self.bias is not None:  # (newer torch has weight without bias: bias=False)
            out = out + self.bias.reshape(shape)

        if update and self.running_mean is not None:
            with torch.no_grad():
                self.running_mean.mul_(1.0 - factor).add_(mean.detach().to(self.running_mean.dtype), alpha=factor)
                unbiased = squares.detach() / (count - 1)
                self.running_var.mul_(1.0 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)
        return out.to(input.dtype)


def convert_sync_batchnorm(module: torch.nn.Module, prefix: str = "") -> torch.nn.Module:
    """``module`` with every BatchNorm1d/2d/3d replaced by a SyncBatchNorm (converted in place below
    the top; returns the top, itself replaced when it is a BatchNorm).

    The new layers hold the very same parameter and buffer tensors (values, device, dtype,
    requires_grad; an optimizer built before still updates them), the same eps, momentum and
    training flag; each is named by its qualified name in ``module`` (after ``prefix``, to tell
    two converted models apart). Layers already synchronized, here or elsewhere, are left alone.
    """
    return _convert(module, prefix)


def _convert(module: torch.nn.Module, qualified: str) -> torch.nn.Module:
    converted = module
    if isinstance(module, _BatchNorm) and isinstance(module, LazyModuleMixin):  # becomes BatchNorm*d at its 1st forward
        raise ValueError(f"BatchNorm {qualified or 'at the top'} is lazy and not initialized yet: run one "
                         "forward pass before convert_sync_batchnorm")
    if isinstance(module, CONVERTIBLE):
        converted = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                                  module.track_running_stats, device="meta", name=qualified or "top")
        # The same tensors, not copies (every one the original has is set, so none stays on "meta").
        for key in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked"):
            setattr(converted, key, getattr(module, key))
        converted.train(module.training)
        if hasattr(module, "qconfig"):
            converted.qconfig = module.qconfig
    for child_name, child in module.named_children():
        converted.add_module(child_name, _convert(child, f"{qualified}.{child_name}" if qualified else child_name))
    return converted
