"""Attention around the exchange: each rank attends whole sequences with 1/S of the heads.

Queries (B, H, T/S, d) go to (B, H/S, T, d); keys and values likewise when their K heads divide
over S. With fewer key/value heads than ranks (grouped-query attention, K < S, S a multiple of K)
each key/value head is replicated S/K times first, so that rank i receives the one head its query
heads i·H/S .. (i+1)·H/S - 1 read (query head h reads key/value head h // (H/K), which is i // (S/K)
for all of them); the replicas' gradients sum back through the replication. The attention itself
(whatever computes it: SDPA, eager, a mask) runs unchanged, then its output returns to the tokens'
ranks. Anything else is refused by name before the first step.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Tuple

import torch

from hvdtrain.common.errors import LayoutError
from hvdtrain.parallel.sequence.exchange import to_own_tokens, to_whole_sequence


class HeadSplit(NamedTuple):
    """How H query and K key/value heads go over S ranks: key/value heads replicated ``repeat`` times
    first (1: none), leaving ``groups`` query heads per key/value head on each rank."""

    repeat: int
    groups: int


def head_split(heads: int, kv_heads: int, size: int, what: str = "the model") -> HeadSplit:
    """The split of ``heads`` query and ``kv_heads`` key/value heads over ``size`` ranks, or LayoutError naming why not.

    Args:
        heads: H, query heads.
        kv_heads: K, key/value heads (H for multi-head attention).
        size: S, ranks of the sequence group.
        what: names the model or module in a refusal.
    """
    if heads % size:
        raise LayoutError(f"train.sequence_parallel={size} splits attention by heads, and {what} has {heads} "
                          f"query heads, not a multiple of {size}: choose a sequence_parallel dividing {heads}")
    if kv_heads <= 0 or heads % kv_heads:
        raise LayoutError(f"{what} has {kv_heads} key/value heads for {heads} query heads: sequence parallelism "
                          f"needs grouped-query attention with the query heads a multiple of the key/value heads")
    if kv_heads % size == 0:
        return HeadSplit(1, heads // kv_heads)
    if size % kv_heads == 0:
        return HeadSplit(size // kv_heads, heads // size)
    raise LayoutError(f"train.sequence_parallel={size} cannot split {what}'s {kv_heads} key/value heads: they "
                      f"must divide over the ranks or be replicated evenly onto them (one a multiple of the "
                      f"other); choose a sequence_parallel that divides {kv_heads} or is a multiple of it")


def split_attention(attend: Callable[..., Tuple[torch.Tensor, Any]], query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, group: Any, split: HeadSplit, name: str) -> Tuple[torch.Tensor, Any]:
    """``attend(query, key, value)`` on whole sequences of this rank's heads; its output back to this
    rank's tokens. ``attend`` returns (B, H/S, T, d) and anything else alongside (passed through).

    Args:
        attend: the attention of whole sequences, ``attend(q, k, v) -> (output, extra)``.
        query: (B, H, T/S, d), this rank's tokens.
        key: (B, K, T/S, d).
        value: (B, K, T/S, d).
        group: the sequence group (``size``, ``process_set``).
        split: how the heads go over the group (head_split).
        name: names the collectives (one per layer).
    """
    if split.repeat > 1:
        key = key.repeat_interleave(split.repeat, dim=1)
        value = value.repeat_interleave(split.repeat, dim=1)
    size, process_set = group.size, group.process_set
    query = to_whole_sequence(query, size, process_set, f"{name}.q")
    key = to_whole_sequence(key, size, process_set, f"{name}.k")
    value = to_whole_sequence(value, size, process_set, f"{name}.v")
    output, extra = attend(query, key, value)
    return to_own_tokens(output, size, process_set, f"{name}.out"), extra
