"""A model's attention made sequence-parallel: a Hugging Face model through transformers' interfaces
(hf.py), or a model of your own through its attention modules' ``attend``.

A module of your own takes part by computing attention in one method, ``attend(q, k, v)`` on
(batch, heads, length, dim) tensors returning the same shape (a ``mask`` argument, packed rows', is
refused), with its head count in ``heads``
(and ``kv_heads`` when fewer key/value heads), and by adding ``token_offset()`` to its positions
(hvdtrain.examples.textlm does both). Each such module's ``attend`` is wrapped to run on whole
sequences of 1/S of the heads inside the Trainer's split step, and as it was in any other forward.
"""
from __future__ import annotations

import functools
from typing import Any, Dict, List

from torch import nn

from hvdtrain.common.errors import LayoutError
from hvdtrain.parallel.sequence import hf
from hvdtrain.parallel.sequence.attention import head_split, split_attention
from hvdtrain.parallel.sequence.batches import BatchSplitter


def _own_attention(model: nn.Module) -> List[nn.Module]:
    return [m for m in model.modules() if callable(getattr(m, "attend", None)) and isinstance(getattr(m, "heads", None), int)]


def _split_attend(attend, module_name: str, group: Any, split: Any, switch: Dict[str, bool]):
    @functools.wraps(attend)
    def attend_whole_sequences(q, k, v, mask=None):
        if not switch["on"]:  # a forward outside the Trainer's split step: whole sequences, as one process
            return attend(q, k, v) if mask is None else attend(q, k, v, mask)
        if mask is not None:  # a packed row's document mask: this rank holds part of its positions
            raise LayoutError(f"train.sequence_parallel does not take packed rows (an attention mask) yet in "
                              f"{module_name!r}: train them without sequence parallelism")
        output, _ = split_attention(lambda q, k, v: (attend(q, k, v), None), q, k, v, group, split,
                                    f"sequence.{module_name}")
        return output
    return attend_whole_sequences


def prepare(model: nn.Module, group: Any) -> BatchSplitter:
    """Route ``model``'s attention through ``group`` (before the strategy wraps it); the splitter its
    batches go through. Refused by name (LayoutError) when the model's attention cannot be found or split.

    Args:
        model: a transformers model, or one whose attention modules have ``attend`` and ``heads``.
        group: the sequence group (``size``, ``index``, ``process_set``).
    """
    splitter = BatchSplitter(group)
    if hf.is_hf_model(model):
        hf.install(model, group, splitter)
        return splitter
    modules = _own_attention(model)
    if not modules:
        raise LayoutError(f"train.sequence_parallel={group.size} needs to find {type(model).__name__}'s attention: "
                          f"a Hugging Face model's, or modules of your own with an attend(q, k, v) method and a "
                          f"heads attribute (see docs/concepts/sequence-parallelism.md)")
    names = {id(m): name for name, m in model.named_modules()}
    # Read once per forward, at the model's entry: a backward's recomputation keeps its forward's choice.
    switch = {"on": False}
    model.register_forward_pre_hook(lambda *_: switch.update(on=splitter.active))
    for module in modules:
        split = head_split(module.heads, getattr(module, "kv_heads", module.heads), group.size,
                           f"{type(module).__name__} {names[id(module)]!r}")
        module.attend = _split_attend(module.attend, names[id(module)] or "attention", group, split, switch)
    return splitter
