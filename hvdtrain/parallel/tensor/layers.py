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

import copy
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch import nn

from hvdtrain.parallel.tensor.shard import TensorShard  # noqa: F401  (re-exported: a split parameter's slice)


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


class SumOutput:
    """A forward hook applying g: the module's one output tensor summed over the tensor group (each
    rank's is a part: split experts' intermediate slices, an all_reduce module's cut parameters)."""

    def __init__(self, group: Any, name: str) -> None:
        self.group, self.name = group, name

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> torch.Tensor:
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"{self.name} ({type(module).__name__}) returned {type(output).__name__}: hvdtrain sums "
                            f"a split module's one output tensor")
        return reduce_from_tensor_group(output, self.group, f"tp.g.{self.name}")


def own_copy(module: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` (its class, its forward) with tables of its own: parameters,
    children and hooks set on the copy leave the module as built as it was (a model built on the
    meta device initializes that one whole, then keeps the copy's slices)."""
    copied = copy.copy(module)
    for attribute, value in vars(module).items():
        if isinstance(value, dict):
            setattr(copied, attribute, type(value)(value))
    return copied


def is_placeholder(tensor: torch.Tensor) -> bool:
    """A tensor of a model built on the meta device that has no values yet (its storage holds no
    memory: hvdtrain.strategies.deferred_init), so it can be split before it is initialized."""
    return not tensor.is_meta and tensor.numel() > 0 and tensor.untyped_storage().nbytes() == 0


def _shard(parameter: torch.Tensor, shard: TensorShard) -> nn.Parameter:
    """This rank's slice of ``parameter``; of a placeholder, a placeholder of the slice's shape that
    remembers its whole (``deferred_whole``): its values come when the whole is initialized."""
    if is_placeholder(parameter):
        local = torch.empty(shard.local_shape(parameter.shape), dtype=parameter.dtype, device=parameter.device)
        local.untyped_storage().resize_(0)
        local = nn.Parameter(local, requires_grad=parameter.requires_grad)
        local.deferred_whole = parameter
    else:
        local = nn.Parameter(shard.take(parameter.detach()), requires_grad=parameter.requires_grad)
    local.tensor_shard = shard
    return local


def _replicated(parameter: nn.Parameter) -> nn.Parameter:
    """A split layer's whole parameter (a row-parallel bias): its own copy; a placeholder stays itself."""
    if is_placeholder(parameter):
        return parameter
    return nn.Parameter(parameter.detach().clone(), requires_grad=parameter.requires_grad)


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
        """This rank's output slice of ``linear`` (its weight's rows and its bias).

        Args:
            linear: the whole layer.
            group: the tensor group.
            groups: output blocks each cut alike (3 for a fused [q; k; v]).
            name: names its collectives.
        """
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
        bias = None if linear.bias is None else _replicated(linear.bias)
        return cls(_shard(linear.weight, shard), bias, group, name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tensor_group(F.linear(x, self.weight), self.group, f"tp.g.{self.name}")
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features} (local), out_features={self.out_features}, group={self.group}"


class ParallelSelfAttention(nn.Module):
    """Causal self-attention on this rank's heads / T heads (textlm's CausalSelfAttention split):
    qkv column-parallel in three groups [q; k; v], proj row-parallel. Same submodule names, so the
    same state_dict keys (``attention.qkv.weight``).

    Args:
        qkv: the split [q; k; v] projection.
        proj: the split output projection.
        heads: this rank's heads (the whole layer's / T).
        dropout: attention dropout probability.
        residual_dropout: the output's dropout module, kept.
    """

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
        y = self.attend(q, k, v)
        return self.residual_dropout(self.proj(y.transpose(1, 2).reshape(batch, length, width)))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of this rank's heads, (B, heads / T, T, C / heads) tensors: sequence
        parallelism runs it on whole sequences of part of them (hvdtrain.parallel.sequence.modules).

        Args:
            q: queries.
            k: keys, alike.
            v: values, alike.
        """
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)


# --- The styles of Hugging Face's tensor-parallel plans (transformers' ParallelInterface) ---------
# An activation's last dim, cut among the group's ranks in rank order (TensorShard's order: the
# mesh's groups list their ranks ascending, as Horovod's process sets order them).

def _allgather_last_dim(x: torch.Tensor, group: Any, name: str) -> torch.Tensor:
    """Every rank's ``x`` concatenated along the last dim, in rank order (collective ``name``)."""
    gathered = hvd.allgather(x.movedim(-1, 0).contiguous(), name=name, process_set=group.process_set)
    # Contiguous, as the whole layer's output is: a forward may view it (doge's router views its
    # logits as (2, tokens, keys)), which a strided view of the gathered tensor refuses.
    return gathered.movedim(0, -1).contiguous()


def _own_last_dim(x: torch.Tensor, group: Any) -> torch.Tensor:
    """This rank's part of ``x``'s last dim."""
    return x.chunk(group.size, dim=-1)[group.index].contiguous()


class _GatherLastDim(torch.autograd.Function):
    """Forward: the full activation from every rank's part; backward: this rank's part of the
    gradient (every rank computes the same loss from the same full activation)."""

    @staticmethod
    def forward(ctx, x, group, name):
        ctx.group = group
        return _allgather_last_dim(x, group, name)

    @staticmethod
    def backward(ctx, grad):
        return _own_last_dim(grad, ctx.group), None, None


class _SplitLastDim(torch.autograd.Function):
    """Forward: this rank's part of a replicated activation; backward: the full gradient, every
    rank's part gathered (the replicated producer needs all of it on every rank)."""

    @staticmethod
    def forward(ctx, x, group, name):
        ctx.group, ctx.name = group, name
        return _own_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _allgather_last_dim(grad, ctx.group, ctx.name), None, None


def _check_rank_order(group: Any) -> None:
    if list(group.ranks) != sorted(group.ranks):
        raise ValueError(f"{group!r}: a gathered activation needs the group's ranks in ascending order")


class GatheredColumnParallelLinear(ColumnParallelLinear):
    """Hugging Face's ``colwise_gather_output`` (a causal LM's head): column-parallel, then the
    output columns all-gathered, so that what follows sees the whole output on every rank.
    ``out_features`` is that whole width: a model may read it (Apertus 1.5's loss views its logits
    by ``lm_head.out_features``).

    Args:
        weight: this rank's rows of the weight.
        bias: this rank's part of the bias, or None.
        group: the tensor group.
        name: names its collectives.
    """

    def __init__(self, weight: nn.Parameter, bias: Optional[nn.Parameter], group: Any, name: str) -> None:
        super().__init__(weight, bias, group, name)
        self.out_features = weight.shape[0] * group.size

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (gathered; "
                f"{self.weight.shape[0]} local), group={self.group}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = super().forward(x)
        if not _communicates(self.group):
            return local
        _check_rank_order(self.group)
        return _GatherLastDim.apply(local, self.group, f"tp.gather.{self.name}")


class SplitInputRowParallelLinear(RowParallelLinear):
    """Hugging Face's ``rowwise_split_input``: row-parallel over an input every rank holds whole
    (after a ``colwise_gather_output`` layer): each rank takes its part of the input first.
    ``in_features`` is the whole width it takes.

    Args:
        weight: this rank's columns of the weight.
        bias: the whole bias, or None.
        group: the tensor group.
        name: names its collectives.
    """

    def __init__(self, weight: nn.Parameter, bias: Optional[nn.Parameter], group: Any, name: str) -> None:
        super().__init__(weight, bias, group, name)
        self.in_features = weight.shape[1] * group.size

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (split here; {self.weight.shape[1]} local), "
                f"out_features={self.out_features}, group={self.group}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _communicates(self.group):
            _check_rank_order(self.group)
            x = _SplitLastDim.apply(x, self.group, f"tp.split.{self.name}.grad")
        return super().forward(x)


class VocabParallelEmbedding(nn.Module):
    """Hugging Face's ``embedding_rowwise`` (Megatron's vocabulary-parallel embedding): this rank
    holds rows [start, end) of the table; ids outside them look up nothing here (zeros), and the
    sum over the group gives every id its one row. Same state_dict key (``weight``).

    An embedding of a class of its own whose forward wraps nn.Embedding's (Gemma's scales the
    lookup by sqrt(hidden)) keeps its forward: the split layer is that class with this lookup put
    in place of nn.Embedding's (``split_class``), so what the family does around the lookup still
    happens. hvdtrain.parallel.own_forward decides which forwards can be kept.

    Args:
        weight: this rank's rows of the table.
        padding_idx: the whole table's padding id, or None.
        group: the tensor group.
        name: names its collectives.
    """

    def __init__(self, weight: nn.Parameter, padding_idx: Optional[int], group: Any, name: str) -> None:
        super().__init__()
        self._take(weight, padding_idx, group, name)

    def _take(self, weight: nn.Parameter, padding_idx: Optional[int], group: Any, name: str) -> None:
        self.weight, self.group, self.name = weight, group, name
        self.num_embeddings, self.embedding_dim = weight.shape  # local
        self.start = group.index * self.num_embeddings
        self.end = self.start + self.num_embeddings
        # nn.Embedding's padding_idx (a row that gets no gradient), when it is one of ours.
        self.padding_idx = padding_idx - self.start if padding_idx is not None and self.start <= padding_idx < self.end else None

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group: Any, name: str = "embedding") -> "VocabParallelEmbedding":
        shard = TensorShard(dim=0, parts=group.size, index=group.index)
        weight = _shard(embedding.weight, shard)
        if type(embedding).forward is nn.Embedding.forward:
            return cls(weight, embedding.padding_idx, group, name)
        split_class = _own_forward_split_class(type(embedding))
        split = split_class.__new__(split_class)
        # The family's module as it is (its buffers, such as Gemma's embed_scale, and attributes),
        # then this rank's rows in place of the whole table.
        split.__dict__.update(embedding.__dict__)
        for registry in ("_parameters", "_buffers", "_modules"):
            split.__dict__[registry] = dict(embedding.__dict__[registry])
        split._non_persistent_buffers_set = set(embedding._non_persistent_buffers_set)
        split._take(weight, embedding.padding_idx, group, name)
        return split

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        local = F.embedding((ids - self.start).masked_fill(outside, 0), self.weight, self.padding_idx)
        local = local.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_group(local, self.group, f"tp.g.{self.name}")

    def extra_repr(self) -> str:
        return f"rows {self.start}:{self.end} of the vocabulary, embedding_dim={self.embedding_dim}, group={self.group}"


class _SplitLookup(VocabParallelEmbedding, nn.Embedding):
    """The split lookup placed before nn.Embedding in a class's method order: a family's forward
    that calls ``super().forward(ids)`` reaches it instead of nn.Embedding's."""


_SPLIT_CLASSES: Dict[type, type] = {}


def _own_forward_split_class(own: type) -> type:
    """``own`` (an nn.Embedding subclass with a forward of its own) with the split lookup beneath it:
    method order own -> _SplitLookup -> VocabParallelEmbedding -> nn.Embedding. One class per family."""
    if own not in _SPLIT_CLASSES:
        _SPLIT_CLASSES[own] = type(f"VocabParallel{own.__name__}", (own, _SplitLookup), {"__module__": __name__})
    return _SPLIT_CLASSES[own]


def sum_gradients_over_group(module: nn.Module, group: Any, name: str,
                             observe: Optional[Callable[[str, torch.Tensor], None]] = None) -> None:
    """Hugging Face's ``replicated_with_grad_allreduce`` (Qwen3's per-head q_norm/k_norm): the
    module stays whole on every rank but sees only this rank's heads, so each rank's gradient of
    its parameters is a part: summed over the group as soon as it is computed.

    Args:
        module: the whole module.
        group: the tensor group.
        name: names the collectives.
        observe: ``observe(name, part)`` sees each part first (hvdtrain.parallel.tensor.audit's first-step check).
    """
    sum_parameter_gradients([(f"{name}.{path}", parameter) for path, parameter in module.named_parameters()],
                            group, observe)


def sum_parameter_gradients(parameters: Sequence[Tuple[str, nn.Parameter]], group: Any,
                            observe: Optional[Callable[[str, torch.Tensor], None]] = None) -> None:
    """Each of ``parameters`` (name, parameter), kept whole, gets its gradient summed over the
    tensor group as soon as it is computed (collective ``tp.gradsum.<name>``): each rank's is a
    part. ``observe(name, part)`` sees each part first."""
    if not _communicates(group):
        return

    def summed(grad: torch.Tensor, name: str) -> torch.Tensor:
        if observe is not None:
            observe(name, grad)
        return _allreduce_sum(grad, group, f"tp.gradsum.{name}")

    for name, parameter in parameters:
        if parameter.requires_grad:
            parameter.register_hook(lambda grad, name=name: summed(grad, name))


def full_tensor(local: torch.Tensor, shard: Optional[TensorShard], group: Any, name: str) -> torch.Tensor:
    """The full value of a split tensor: every rank's slice placed and summed over the tensor group (every
    rank of the group calls it). A replicated tensor (``shard`` None) comes back as is.

    Args:
        local: this rank's slice (a parameter or its gradient).
        shard: where the slice sits, or None for a replicated tensor.
        group: the tensor group.
        name: the collective's name.
    """
    if shard is None or not _communicates(group):
        return local.detach().clone()
    full_shape = list(local.shape)
    full_shape[shard.dim] *= shard.parts
    full = shard.place(local.new_zeros(full_shape), local.detach())
    return _allreduce_sum(full, group, name)
