"""The all-to-alls of sequence parallelism, as autograd functions: each is the other's gradient.

``to_whole_sequence``: (batch, heads, length / S, dim) on each of S ranks, every rank its own part
of the sequence, into (batch, heads / S, length, dim): every rank the whole sequence of its own
heads (rank i heads i·H/S to (i+1)·H/S). ``to_own_tokens`` is the inverse. One Horovod all-to-all
each, on the sequence group's process set; Horovod splits along the first dimension, so the part
for rank j is put first before, and the part from rank j read first after.
"""
from __future__ import annotations

from typing import Any

import horovod.torch as hvd
import torch


def _alltoall(x: torch.Tensor, process_set: Any, name: str) -> torch.Tensor:
    kwargs = {} if process_set is None else {"process_set": process_set}
    return hvd.alltoall(x.contiguous(), name=name, **kwargs)


def _heads_out(x: torch.Tensor, size: int, process_set: Any, name: str) -> torch.Tensor:
    batch, heads, length, dim = x.shape
    parts = x.reshape(batch, size, heads // size, length, dim).transpose(0, 1)  # part j of the heads first
    received = _alltoall(parts, process_set, name)  # (S, batch, heads / S, length / S, dim): sequence part j first
    return received.permute(1, 2, 0, 3, 4).reshape(batch, heads // size, size * length, dim)


def _heads_in(x: torch.Tensor, size: int, process_set: Any, name: str) -> torch.Tensor:
    batch, heads, length, dim = x.shape
    parts = x.reshape(batch, heads, size, length // size, dim).permute(2, 0, 1, 3, 4)  # sequence part j first
    received = _alltoall(parts, process_set, name)  # (S, batch, heads, length / S, dim): heads part j first
    # Laid out (batch, tokens, heads, dim), viewed as (batch, heads, tokens, dim): the caller's turn back
    # into (batch, tokens, width) (transformers', the example's) is then a view, not another copy.
    tokens = received.permute(1, 3, 0, 2, 4).reshape(batch, length // size, size * heads, dim)
    return tokens.transpose(1, 2)


class _Exchange(torch.autograd.Function):
    """One exchange forward, its inverse on the gradient backward (an all-to-all is a permutation)."""

    @staticmethod
    def forward(ctx, x, forward, inverse, size, process_set, name):
        ctx.inverse, ctx.size, ctx.process_set, ctx.name = inverse, size, process_set, name
        return forward(x, size, process_set, name)

    @staticmethod
    def backward(ctx, grad):
        return ctx.inverse(grad, ctx.size, ctx.process_set, ctx.name + ".grad"), None, None, None, None, None


def to_whole_sequence(x: torch.Tensor, size: int, process_set: Any, name: str) -> torch.Tensor:
    """(B, H, T / S, d) of this rank's tokens -> (B, H / S, T, d) of its heads (H divisible by S).

    Args:
        x: the tensor, laid out as said.
        size: S, ranks of the sequence group (1: returned as is).
        process_set: the group's Horovod process set (None: the whole world).
        name: the collective's name (its gradient's adds ``.grad``).
    """
    if size == 1:
        return x
    return _Exchange.apply(x, _heads_out, _heads_in, size, process_set, name)


def to_own_tokens(x: torch.Tensor, size: int, process_set: Any, name: str) -> torch.Tensor:
    """(B, H / S, T, d) of this rank's heads -> (B, H, T / S, d) of its tokens (the inverse).

    Args:
        x: the tensor, laid out as said.
        size: S, ranks of the sequence group (1: returned as is).
        process_set: the group's Horovod process set (None: the whole world).
        name: the collective's name (its gradient's adds ``.grad``).
    """
    if size == 1:
        return x
    return _Exchange.apply(x, _heads_in, _heads_out, size, process_set, name)
