"""Hugging Face models under sequence parallelism, through transformers' own interfaces (no model code).

transformers looks up every layer's attention by ``config._attn_implementation`` in its
AttentionInterface, and the mask's builder by the same name in its AttentionMaskInterface. hvdtrain
registers one name of each: the attention exchanges heads for the sequence (attention.py) around the
implementation the model had (SDPA, or the family's own eager function, found in the attention
module's own modeling file so that its softcap or sinks come with it); the mask is built by that
implementation's mask builder for the whole sequence (length T, not this rank's T/S; the batch's
padding mask from batches.py), so causal, sliding-window and chunked masks index the whole
sequence; packed rows (documents told apart by their position ids) are found in the whole rows'
positions too (``_whole_rows_packing``). Position ids (rotary embeddings) come with the batch (batches.py). What a family computes
across the sequence outside attention (a convolution, a token shift) is not head-local: set-up's
probe (probe.py) finds it, and the layout is refused.

The state is kept by the config's identity (transformers' configs are not hashable). It splits only
the forwards of the Trainer's split step (batches.split_step): the model's pre-forward hook switches
it on there and off for any other forward (the probe's whole-model run, an evaluation of your own).
"""
from __future__ import annotations

import copy
import functools
import sys
from typing import Any, Dict, Optional

import torch
from torch import nn

from hvdtrain.common.errors import LayoutError
from hvdtrain.parallel.sequence.attention import head_split, split_attention
from hvdtrain.parallel.sequence.batches import token_offset, whole_positions

NAME = "hvdtrain_sequence"
_STATES: Dict[int, "SplitAttention"] = {}


class SplitAttention:
    """One model's sequence-parallel attention: its group, the implementation it wraps, and the batch
    it is computing (for the whole sequence's mask). The heads' split is taken from each layer's
    tensors as it runs (a config may not say: multi-query GPT-BigCode).

    Args:
        group: the sequence group (``size``, ``index``, ``process_set``).
        inner: the attention implementation the model had (``sdpa``, ``eager``, ...).
        batches: the batch splitter (its ``length`` and ``padding_mask``).
    """

    def __init__(self, group: Any, inner: str, batches: Any) -> None:
        self.group, self.inner, self.batches = group, inner, batches
        self.enabled = False  # set by the model's pre-forward hook: on inside a split step only

    def attention_function(self, module: nn.Module):
        if self.inner == "eager":  # the family's own eager function, as the model would pick it
            own = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
            if own is not None:
                return own
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        return ALL_ATTENTION_FUNCTIONS[self.inner]


# Per-head parameters an attention implementation reads besides q, k and v (attention sinks: GPT-OSS,
# Granite-SWA), as a module attribute and as the keyword transformers passes them by.
PER_HEAD = {"sinks": "s_aux"}


class _Heads:
    """The attention module as the wrapped implementation sees it with 1/S of the heads: key/value
    heads replicated onto the ranks change how many query heads read each (``num_key_value_groups``),
    and a per-head parameter (attention sinks) is this rank's heads' slice (its gradient reaches the
    whole parameter through the slice; the strategy sums the ranks' parts)."""

    def __init__(self, module: nn.Module, groups: int, own_heads: slice) -> None:
        self._module, self.num_key_value_groups = module, groups
        for name in PER_HEAD:
            value = getattr(module, name, None)
            if isinstance(value, torch.Tensor):
                setattr(self, name, value[own_heads])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _state(config: Any) -> SplitAttention:
    state = _STATES.get(id(config))
    if state is None:
        raise RuntimeError(f"{NAME} attention runs only on a model prepared by hvdtrain's sequence parallelism")
    return state


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Optional[torch.Tensor], **kwargs: Any):
    state = _state(module.config)
    inner = state.attention_function(module)
    if not state.enabled:
        return inner(module, query, key, value, attention_mask, **kwargs)
    size, index = state.group.size, state.group.index
    # The heads this layer computes (a family's config may not say: multi-query GPT-BigCode).
    split = head_split(query.shape[1], key.shape[1], size, type(module).__name__)
    width = query.shape[1] // size
    heads = _Heads(module, split.groups, slice(index * width, (index + 1) * width))
    for name, keyword in PER_HEAD.items():
        if kwargs.get(keyword) is not None and kwargs[keyword] is getattr(module, name, None):
            kwargs[keyword] = getattr(heads, name)

    def attend(q, k, v):
        output, weights = inner(heads, q, k, v, attention_mask, **kwargs)
        return output.transpose(1, 2), weights  # transformers returns (B, T, H, d)

    name = f"sequence.layer{getattr(module, 'layer_idx', '')}"
    output, weights = split_attention(attend, query, key, value, state.group, split, name)
    return output.transpose(1, 2).contiguous(), weights  # as transformers' own: callers .view() it


def _mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
          attention_mask: Optional[torch.Tensor] = None, config: Any = None, **kwargs: Any):
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    state = _state(config)
    inner = ALL_MASK_ATTENTION_FUNCTIONS[state.inner]
    if not state.enabled:
        return inner(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, attention_mask=attention_mask, config=config, **kwargs)
    length, padding = state.batches.length, state.batches.padding_mask
    if padding is not None:
        padding = padding.bool()
    return inner(batch_size=batch_size, q_length=length, kv_length=length, q_offset=0, kv_offset=0,
                 attention_mask=padding, config=config, **kwargs)


def _whole_rows_packing() -> None:
    """transformers finds packed documents from the position ids the model was given
    (``find_packed_sequence_indices``) and indexes them with the mask's query and key indices
    (``remap_positions_for_packed_sequence``); inside a split step a rank holds its part of them while
    the mask spans the whole rows (``_mask``). Both read the whole rows' positions there instead
    (batches.whole_positions: None for rows that pack nothing, whatever this rank's part looks like);
    outside a split step they are transformers' own. Installed once, idempotent."""
    from transformers import masking_utils

    if getattr(masking_utils.find_packed_sequence_indices, "hvdtrain_whole_rows", False):
        return
    find, remap = masking_utils.find_packed_sequence_indices, masking_utils.remap_positions_for_packed_sequence

    def find_packed(position_ids: torch.Tensor) -> Optional[torch.Tensor]:
        whole = whole_positions()
        if whole is None:
            return find(position_ids)
        return None if whole[0] is None else find(whole[0])

    def remap_packed(mask_function: Any, position_ids: torch.Tensor) -> Any:
        whole = whole_positions()
        return remap(mask_function, position_ids if whole is None or whole[0] is None else whole[0])

    find_packed.hvdtrain_whole_rows = True
    masking_utils.find_packed_sequence_indices = find_packed
    masking_utils.remap_positions_for_packed_sequence = remap_packed


def _positions(state: SplitAttention, module: nn.Module, args: tuple, kwargs: dict):
    """A forward given this rank's part of the sequences without position ids (a step of your own
    calling ``model(input_ids=...)``) gets the whole sequence's: rotary embeddings need them. Outside a
    split step (a forward of your own on whole sequences) the model attends as one process does."""
    state.enabled = state.batches.active
    if not state.enabled or kwargs.get("position_ids") is not None:
        return None
    tokens = kwargs.get("input_ids", args[0] if args else None)
    if tokens is None:
        tokens = kwargs.get("inputs_embeds")
    if not isinstance(tokens, torch.Tensor) or tokens.dim() < 2:
        return None
    first, length = token_offset(), tokens.shape[1]
    kwargs["position_ids"] = torch.arange(first, first + length, device=tokens.device).expand(tokens.shape[0], length)
    return args, kwargs


def _own_config(model: nn.Module) -> Any:
    """A copy of the model's config for it and its modules alone: models built from one config object
    share it (a reference model beside the trained one), and the attention is chosen by the config."""
    shared = model.config
    own = copy.deepcopy(shared)
    for module in model.modules():
        if getattr(module, "config", None) is shared:
            module.config = own
    return own


def is_hf_model(model: nn.Module) -> bool:
    return hasattr(model, "config") and hasattr(model, "set_attn_implementation")


def install(model: nn.Module, group: Any, batches: Any) -> SplitAttention:
    """Route ``model``'s attention through the sequence group; refused by name when its heads do not split.

    Args:
        model: a transformers PreTrainedModel (a decoder language model).
        group: the sequence group (``size``, ``process_set``).
        batches: the batch splitter, whose ``length`` and ``padding_mask`` the mask reads.
    """
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    config = _own_config(model)
    family = type(model).__name__
    inner = config._attn_implementation or "eager"
    if inner == NAME:
        raise LayoutError(f"{family} is already sequence-parallel (its attention is {NAME})")
    if inner not in ALL_MASK_ATTENTION_FUNCTIONS or (inner != "eager" and inner not in ALL_ATTENTION_FUNCTIONS):
        raise LayoutError(f"train.sequence_parallel cannot wrap {family}'s attention implementation {inner!r}: "
                          f"load the model with attn_implementation='sdpa' or 'eager'")
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int):
        raise LayoutError(f"train.sequence_parallel needs {family}'s config.num_attention_heads to split its heads")
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    # Refused by name before any forward when they cannot split; under tensor parallelism this rank
    # holds 1/T of them (the tensor plan refused heads that do not divide by T).
    tensor = getattr(group, "tensor", 1)
    head_split(heads // tensor, kv_heads // tensor, group.size,
               family if tensor == 1 else f"{family}'s share of a tensor group of {tensor} ranks")
    AttentionInterface.register(NAME, _attention)
    AttentionMaskInterface.register(NAME, _mask)
    _whole_rows_packing()
    batches.packs_documents = True
    state = SplitAttention(group, inner, batches)
    _STATES[id(config)] = state
    model.set_attn_implementation(NAME)
    model.register_forward_pre_hook(functools.partial(_positions, state), with_kwargs=True)
    if config._attn_implementation != NAME:
        del _STATES[id(config)]
        raise LayoutError(f"train.sequence_parallel: {family} does not take its attention from transformers' "
                          f"AttentionInterface, so its attention cannot be split by heads")
    return state


def uninstall(model: nn.Module) -> None:
    """The model's own attention back (an export writes the implementation it was loaded with)."""
    state = _STATES.pop(id(model.config), None)
    if state is not None:
        model.set_attn_implementation(state.inner)
