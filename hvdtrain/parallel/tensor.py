"""Megatron-LM tensor parallelism on a Horovod process set (the mesh's tensor group).

An MLP's first linear is split by output columns, its second by input rows; attention by heads. A
block then needs one all-reduce forward (g, after the row-parallel layer) and one backward (f,
before the column-parallel layer): x --f--> ColumnParallel --> RowParallel --g--> y. Everything else
is replicated, and its gradients agree on every tensor rank with no communication of their own.
A split parameter carries ``tensor_shard`` (which slice of the full parameter it is) under the full
state_dict key. Dropout on replicated activations needs one random stream per tensor group (the
Trainer seeds a group's ranks alike).
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch import nn


def _communicates(group: Any) -> bool:
    """Whether ``group`` (a mesh Group, or None for no parallelism) has anything to all-reduce."""
    if group is None or group.size == 1:
        return False
    if group.process_set is None:
        raise ValueError(f"{group!r} has {group.size} ranks but no Horovod process set: build it with Mesh.build")
    return True


def _allreduce_sum(tensor: torch.Tensor, group: Any, name: str) -> torch.Tensor:
    return hvd.allreduce(tensor.contiguous(), op=hvd.Sum, name=name, process_set=group.process_set)


class _CopyToTensorGroup(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce (sum) of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group, name):
        ctx.group, ctx.name = group, name
        return x

    @staticmethod
    def backward(ctx, grad):
        return _allreduce_sum(grad, ctx.group, ctx.name), None, None


class _ReduceFromTensorGroup(torch.autograd.Function):
    """Megatron's g: all-reduce (sum) forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group, name):
        return _allreduce_sum(x, group, name)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def copy_to_tensor_group(x: torch.Tensor, group: Any, name: str) -> torch.Tensor:
    """f: ``x`` unchanged; its gradient summed over the tensor group (collective ``name``.grad)."""
    return _CopyToTensorGroup.apply(x, group, f"{name}.grad") if _communicates(group) else x


def reduce_from_tensor_group(x: torch.Tensor, group: Any, name: str) -> torch.Tensor:
    """g: ``x`` summed over the tensor group (collective ``name``); its gradient unchanged."""
    return _ReduceFromTensorGroup.apply(x, group, name) if _communicates(group) else x


@dataclass(frozen=True)
class TensorShard:
    """A local parameter is slice ``index`` of ``parts`` of the full one along ``dim``. With
    ``groups`` > 1 the full dim is viewed as (groups, -1) and every group is cut alike: qkv's rows
    [q; k; v] give (q_i; k_i; v_i), the heads of rank i in each of the three."""

    dim: int
    parts: int
    index: int
    groups: int = 1

    def __post_init__(self) -> None:
        if self.parts < 1 or self.groups < 1 or not 0 <= self.index < self.parts:
            raise ValueError(f"{self}: needs parts >= 1, groups >= 1 and 0 <= index < parts")

    def _grouped(self, shape: torch.Size) -> Tuple[int, ...]:
        size = shape[self.dim]
        if size % (self.groups * self.parts):
            raise ValueError(f"{self}: dim {self.dim} of shape {tuple(shape)} does not split into "
                             f"{self.groups} groups x {self.parts} parts")
        return tuple(shape[:self.dim]) + (self.groups, size // self.groups) + tuple(shape[self.dim + 1:])

    def _slice(self, full: torch.Tensor) -> torch.Tensor:
        """This shard's elements of ``full``: a view (groups, chunk) along dim."""
        grouped = full.view(self._grouped(full.shape))
        return grouped.chunk(self.parts, dim=self.dim + 1)[self.index]

    def local_shape(self, full_shape: torch.Size) -> torch.Size:
        shape = list(full_shape)
        shape[self.dim] //= self.parts
        return torch.Size(shape)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of ``full`` (a contiguous copy)."""
        return self._slice(full).reshape(self.local_shape(full.shape)).clone()

    def place(self, full_out: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """Write ``local`` into its slice of the (contiguous) full-size ``full_out``; returns it."""
        if local.shape != self.local_shape(full_out.shape):
            raise ValueError(f"{self}: a local shape {tuple(local.shape)} is not a slice of {tuple(full_out.shape)}")
        target = self._slice(full_out)
        target.copy_(local.reshape(target.shape))
        return full_out


def _shard(parameter: torch.Tensor, shard: TensorShard) -> nn.Parameter:
    local = nn.Parameter(shard.take(parameter.detach()), requires_grad=parameter.requires_grad)
    local.tensor_shard = shard
    return local


class _SplitLinear(nn.Module):
    """A linear layer holding this rank's part of the weight (``in_features`` and ``out_features``:
    the local shape), named for its collectives."""

    def __init__(self, weight: nn.Parameter, bias: Optional[nn.Parameter], group: Any, name: str) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias
        self.group, self.name = group, name
        self.out_features, self.in_features = weight.shape


class ColumnParallelLinear(_SplitLinear):
    """y_i = x W_i^T + b_i: this rank's output columns (rows of ``weight``); the output stays split."""

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Any, groups: int = 1, name: str = "column") -> "ColumnParallelLinear":
        shard = TensorShard(dim=0, parts=group.size, index=group.index, groups=groups)
        bias = None if linear.bias is None else _shard(linear.bias, shard)
        return cls(_shard(linear.weight, shard), bias, group, name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tensor_group(x, self.group, f"tp.f.{self.name}"), self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features} (local), group={self.group}"


class RowParallelLinear(_SplitLinear):
    """y = sum_i x_i W_i^T + b: this rank's input rows (columns of ``weight``), summed over the
    group; the bias (replicated) is added once, after the sum."""

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Any, name: str = "row") -> "RowParallelLinear":
        shard = TensorShard(dim=1, parts=group.size, index=group.index)
        bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(),
                                                             requires_grad=linear.bias.requires_grad)
        return cls(_shard(linear.weight, shard), bias, group, name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tensor_group(F.linear(x, self.weight), self.group, f"tp.g.{self.name}")
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features} (local), out_features={self.out_features}, group={self.group}"


class ParallelSelfAttention(nn.Module):
    """Causal self-attention on this rank's heads / T heads (textlm's CausalSelfAttention split):
    qkv column-parallel in three groups [q; k; v], proj row-parallel. Same submodule names, so the
    same state_dict keys (``attention.qkv.weight``)."""

    def __init__(self, qkv: ColumnParallelLinear, proj: RowParallelLinear, heads: int, dropout: float,
                 residual_dropout: nn.Module) -> None:
        super().__init__()
        self.qkv, self.proj, self.residual_dropout = qkv, proj, residual_dropout
        self.heads, self.dropout = heads, dropout  # heads: the local count

    @classmethod
    def from_attention(cls, attention: nn.Module, group: Any, name: str = "attention") -> "ParallelSelfAttention":
        qkv = ColumnParallelLinear.from_linear(attention.qkv, group, groups=3, name=f"{name}.qkv")
        proj = RowParallelLinear.from_linear(attention.proj, group, name=f"{name}.proj")
        return cls(qkv, proj, attention.heads // group.size, attention.dropout, attention.residual_dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        width = self.qkv.out_features // 3  # the local width: heads / T heads
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.residual_dropout(self.proj(y.transpose(1, 2).reshape(batch, length, width)))


# Styles, named after torch.distributed.tensor.parallel's ColwiseParallel / RowwiseParallel.
STYLES = ("colwise", "rowwise", "attention")
ALIASES = {"column": "colwise", "row": "rowwise"}


def _check_module(path: str, module: nn.Module, style: str, size: int) -> None:
    """ValueError naming ``path`` when ``style`` cannot split ``module`` over ``size`` ranks."""
    if isinstance(module, (ColumnParallelLinear, RowParallelLinear, ParallelSelfAttention)):
        raise ValueError(f"tensor plan: {path} is an already split {type(module).__name__}: parallelize once")
    if style in ("colwise", "rowwise"):
        if not isinstance(module, nn.Linear):
            raise ValueError(f"tensor plan: {path} is {type(module).__name__}, but style {style!r} splits an nn.Linear")
        width, what = (module.out_features, "out_features") if style == "colwise" else (module.in_features, "in_features")
        if width % size:
            raise ValueError(f"tensor plan: {path} ({style}) has {what}={width}, not divisible by "
                             f"tensor_parallel={size}")
        return
    linear = lambda attr: isinstance(getattr(module, attr, None), nn.Linear)
    heads = getattr(module, "heads", None)
    if not (linear("qkv") and linear("proj") and isinstance(heads, int) and hasattr(module, "dropout")
            and hasattr(module, "residual_dropout")):
        raise ValueError(f"tensor plan: {path} is {type(module).__name__}, but style 'attention' splits a "
                         f"self-attention with nn.Linear qkv and proj, an int heads, dropout and residual_dropout")
    if module.qkv.out_features != 3 * module.proj.in_features:
        raise ValueError(f"tensor plan: {path}.qkv has {module.qkv.out_features} outputs, not 3 x "
                         f"{module.proj.in_features} (q, k and v of proj's width)")
    if heads % size:
        raise ValueError(f"tensor plan: {path} has heads={heads}, not divisible by tensor_parallel={size}")


def check_plan(model: nn.Module, plan: Mapping[str, str], size: int) -> List[Tuple[str, str]]:
    """The (module path, style) pairs ``plan`` applies to ``model`` split over ``size`` ranks, in the
    model's module order; ValueError naming the layer or the plan key when it cannot. Changes nothing
    and talks to no other rank: every rank holds the same model, so every rank decides alike."""
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor plan: tensor_parallel must be a whole number >= 1, got {size!r}")
    modules = dict(model.named_modules())
    chosen: Dict[str, str] = {}
    for key, style in plan.items():
        canonical = ALIASES.get(style, style)
        if canonical not in STYLES:
            raise ValueError(f"tensor plan: {key}: unknown style {style!r}; choose one of "
                             f"{', '.join(STYLES + tuple(ALIASES))}")
        matched = [path for path in modules if path and (path == key or fnmatch.fnmatchcase(path, key))]
        if not matched:
            some = ", ".join(p for p in list(modules)[1:9])
            raise ValueError(f"tensor plan: {key!r} matches no module of {type(model).__name__} "
                             f"(its modules include {some}, ...)")
        for path in matched:
            if chosen.setdefault(path, canonical) != canonical:
                raise ValueError(f"tensor plan: {path} is given two styles, {chosen[path]!r} and {canonical!r}")
    for path, style in chosen.items():
        nested = [other for other in chosen if other.startswith(path + ".")]
        if nested:
            raise ValueError(f"tensor plan: {path} ({style}) contains {nested[0]} ({chosen[nested[0]]}): "
                             f"give one of them")
        _check_module(path, modules[path], style, size)
    return [(path, chosen[path]) for path in modules if path in chosen]


def parallelize(model: nn.Module, plan: Mapping[str, str], group: Any) -> nn.Module:
    """Split ``model``'s layers in place over the tensor ``group`` (a mesh Group) as ``plan`` says:
    {dotted module path or fnmatch pattern: "colwise" | "rowwise" | "attention"}. Every layer is
    checked first (ValueError naming it; the model is then unchanged). Returns ``model``. Its
    collectives are named after the layers' paths, so every rank of the group matches them."""
    size = 1 if group is None else group.size
    if group is None:
        group = _Alone()
    for path, style in check_plan(model, plan, size):
        module = model.get_submodule(path)
        if style == "colwise":
            new = ColumnParallelLinear.from_linear(module, group, name=path)
        elif style == "rowwise":
            new = RowParallelLinear.from_linear(module, group, name=path)
        else:
            new = ParallelSelfAttention.from_attention(module, group, name=path)
        parent, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
    return model


class _Alone:
    """A tensor group of one rank (no parallelism): nothing to communicate."""

    ranks, index, size, process_set = (0,), 0, 1, None

    def __repr__(self) -> str:
        return "Group(alone)"


def full_tensor(local: torch.Tensor, shard: Optional[TensorShard], group: Any, name: str) -> torch.Tensor:
    """The full value of ``local`` (a parameter or its gradient), slice ``shard`` on this rank: every
    rank's slice placed and summed over the tensor group (collective ``name``, every rank of the
    group calls it). A replicated tensor (``shard`` None) comes back as is."""
    if shard is None or not _communicates(group):
        return local.detach().clone()
    full_shape = list(local.shape)
    full_shape[shard.dim] *= shard.parts
    full = shard.place(local.new_zeros(full_shape), local.detach())
    return _allreduce_sum(full, group, name)
