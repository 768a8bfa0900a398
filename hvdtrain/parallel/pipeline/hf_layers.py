"""A Hugging Face decoder-only causal LM as a pipeline's layers, with no list to write: its token
embedding, each decoder layer, then the final norm with the LM head.

Only the hidden states travel between stages. What else a decoder layer needs (the causal or
sliding-window mask, the rotary position embeddings, the position ids) each stage computes itself,
exactly as the model's own forward does: the base model's forward is run with its decoder layers
stood in for by recorders, which keep the keyword arguments each layer would get. Without a
padding mask those depend on the input's shape alone, and one recording serves every micro-batch
of that shape; a dict batch's attention_mask (every stage reads the same batch) is recorded with
its micro-batch.

Families whose forward does exactly embed -> layers -> norm -> head are accepted (Llama, Qwen2,
Qwen3, Mistral and their kind, listed in SUPPORTED); others (Gemma's scaled embeddings and
soft-capped logits, say) are refused by name: give them ModelPlan(pipeline_layers=...).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
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
        self._mask: Optional[torch.Tensor] = None
        self._calls: Dict[int, Dict[str, Any]] = {}

    def for_layer(self, index: int, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor] = None
                  ) -> Dict[str, Any]:
        key = (tuple(hidden.shape), hidden.dtype, hidden.device)
        # The mask is compared by identity: it is held here, so no other tensor can take its place.
        if key != self._key or attention_mask is not self._mask:
            self._calls = self._record(hidden, attention_mask)
            self._key, self._mask = key, attention_mask
        return self._calls[index]

    def _record(self, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> Dict[int, Dict[str, Any]]:
        calls: Dict[int, Dict[str, Any]] = {}
        base = self.base
        layers, norm = base.layers, base.norm
        base.layers = nn.ModuleList(_Recorder(calls, i) for i in range(len(layers)))
        base.norm = nn.Identity()
        try:
            with torch.no_grad():
                base(inputs_embeds=hidden.detach(), attention_mask=attention_mask, use_cache=False)
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

    takes_extras = True  # the micro-batch's attention_mask, from the pipeline stage

    def __init__(self, layer: nn.Module, index: int, context: DecoderContext) -> None:
        super().__init__()
        self.layer, self.index = layer, index
        self.context = context  # not a module: the base model stays out of this layer's parameters

    def forward(self, hidden: torch.Tensor, extras: Optional[Dict[str, torch.Tensor]] = None) -> torch.Tensor:
        mask = None if extras is None else extras.get("attention_mask")
        out = self.layer(hidden, **self.context.for_layer(self.index, hidden, mask))
        return out[0] if isinstance(out, tuple) else out


class NormAndHead(nn.Module):
    """The last layer: the final norm, then the LM head -> logits (batch, tokens, vocabulary)."""

    def __init__(self, base: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.norm, self.lm_head = base.norm, head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Hugging Face's causal LM loss of a dict batch's labels: each position predicts the next
    label, -100 (padding, prompts) ignored, the mean over the rest (what ``model(**batch).loss`` is)."""
    if logits.dtype in (torch.float16, torch.bfloat16):  # as transformers does: the softmax in float32
        logits = logits.float()
    return F.cross_entropy(logits[..., :-1, :].reshape(-1, logits.shape[-1]), labels[..., 1:].reshape(-1),
                           ignore_index=-100)


def hf_pipeline_layers(model: nn.Module) -> List[nn.Module]:
    """[embedding, decoder layer 0, ..., decoder layer L-1, norm + head] of a Hugging Face causal LM."""
    found = hf_decoder(model)
    if found is None:
        raise TypeError(f"{type(model).__name__} is not a Hugging Face causal LM (a .model with .layers and an .lm_head)")
    base, head = found
    context = DecoderContext(base)
    decoder = [DecoderLayer(layer, i, context) for i, layer in enumerate(base.layers[: base.config.num_hidden_layers])]
    return [TokenEmbedding(base), *decoder, NormAndHead(base, head)]
