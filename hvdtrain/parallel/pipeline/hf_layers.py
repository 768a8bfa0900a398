"""A Hugging Face decoder-only causal LM as a pipeline's layers, with no list to write: its token
embedding, each decoder layer, then the final norm with the LM head.

Only the hidden states travel between stages. What else a decoder layer needs (the causal or
sliding-window mask, the rotary position embeddings, the position ids) each stage computes itself,
exactly as the model's own forward does: the base model's forward is run once per input shape with
its decoder layers stood in for by recorders, which keep the keyword arguments each layer would
get. Those depend on the shape alone (token windows carry no padding mask), so one recording serves
every micro-batch of that shape.

Families whose forward does exactly embed -> layers -> norm -> head are accepted (Llama, Qwen2,
Qwen3, Mistral and their kind, listed in SUPPORTED); others (Gemma's scaled embeddings and
soft-capped logits, say) are refused by name: give them ModelPlan(pipeline_layers=...).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

# transformers' model_type of the decoder families whose CausalLM forward is lm_head(norm(layers(embed(ids)))).
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")


def hf_decoder(model: nn.Module) -> Optional[Tuple[nn.Module, nn.Module]]:
    """(the base model, the LM head) of a Hugging Face causal LM whose family the pipeline knows,
    None for a model that is not a Hugging Face causal LM; ValueError naming an unknown family."""
    config = getattr(model, "config", None)
    base = getattr(model, "model", None)
    head = getattr(model, "lm_head", None)
    if config is None or base is None or head is None or not hasattr(base, "layers"):
        return None
    if getattr(config, "model_type", None) not in SUPPORTED:
        raise ValueError(f"train.pipeline_parallel cannot cut a {type(model).__name__} by itself: its family "
                         f"({config.model_type!r}) is not one whose forward is embed -> decoder layers -> norm -> head "
                         f"({', '.join(SUPPORTED)}); give ModelPlan(pipeline_layers=fn) with its layers in order")
    return base, head


class _Recorder(nn.Module):
    """Stands in for decoder layer ``index`` during a recording: keeps its keyword arguments."""

    def __init__(self, calls: Dict[int, Dict[str, Any]], index: int) -> None:
        super().__init__()
        self.calls, self.index = calls, index

    def forward(self, hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self.calls[self.index] = kwargs
        return hidden_states


class DecoderContext:
    """The keyword arguments the base model's forward gives each decoder layer, for one input shape."""

    def __init__(self, base: nn.Module) -> None:
        self.base = base
        self._key: Optional[Tuple[Any, ...]] = None
        self._calls: Dict[int, Dict[str, Any]] = {}

    def for_layer(self, index: int, hidden: torch.Tensor) -> Dict[str, Any]:
        key = (tuple(hidden.shape), hidden.dtype, hidden.device)
        if key != self._key:
            self._calls, self._key = self._record(hidden), key
        return self._calls[index]

    def _record(self, hidden: torch.Tensor) -> Dict[int, Dict[str, Any]]:
        calls: Dict[int, Dict[str, Any]] = {}
        base = self.base
        layers, norm = base.layers, base.norm
        base.layers = nn.ModuleList(_Recorder(calls, i) for i in range(len(layers)))
        base.norm = nn.Identity()
        try:
            with torch.no_grad():
                base(inputs_embeds=hidden.detach(), use_cache=False)
        finally:
            base.layers, base.norm = layers, norm
        return calls


class TokenEmbedding(nn.Module):
    """The first layer: token ids -> hidden states, on the model's own embedding (tied to the head
    when the model ties them: the pipeline then sums the two ends' gradients)."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = base.embed_tokens

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)


class DecoderLayer(nn.Module):
    """Decoder layer ``index`` with the mask and position embeddings its model would give it."""

    def __init__(self, layer: nn.Module, index: int, context: DecoderContext) -> None:
        super().__init__()
        self.layer, self.index = layer, index
        self.context = context  # not a module: the base model stays out of this layer's parameters

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.layer(hidden, **self.context.for_layer(self.index, hidden))
        return out[0] if isinstance(out, tuple) else out


class NormAndHead(nn.Module):
    """The last layer: the final norm, then the LM head -> logits (batch, tokens, vocabulary)."""

    def __init__(self, base: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.norm, self.lm_head = base.norm, head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))


def hf_pipeline_layers(model: nn.Module) -> List[nn.Module]:
    """[embedding, decoder layer 0, ..., decoder layer L-1, norm + head] of a Hugging Face causal LM."""
    found = hf_decoder(model)
    if found is None:
        raise TypeError(f"{type(model).__name__} is not a Hugging Face causal LM (a .model with .layers and an .lm_head)")
    base, head = found
    context = DecoderContext(base)
    decoder = [DecoderLayer(layer, i, context) for i, layer in enumerate(base.layers[: base.config.num_hidden_layers])]
    return [TokenEmbedding(base), *decoder, NormAndHead(base, head)]
