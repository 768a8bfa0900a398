"""A Hugging Face causal LM as a pipeline's layers, with no list to write: everything its forward
does before the first decoder layer, each decoder layer, then everything after the last one.

Where to cut comes from the model itself (hf_plan: transformers' ``base_model_pp_plan``, verified
by probing the forward). The first and the last pipeline layer run the model's own forward, so
that whatever the family does around its layers is exactly what one process computes:

    ModelEntry   the base model's forward on the input ids, stopped at decoder layer 0 (a stand-in
                 raises with the hidden states it received): embedding, scaling, dropout
    DecoderLayer one decoder layer, with the keyword arguments the model's forward gives it
    ModelExit    the causal LM's own forward from ``inputs_embeds`` of zeros, decoder layer 0 stood
                 in for by one that returns the hidden states received from the previous stage, the
                 others by ones that pass them through: final norm, head, logits scaling, soft-capping

Only the hidden states travel between stages. What else a decoder layer needs (the causal or
sliding-window mask, the rotary position embeddings, the position ids) each stage computes itself,
exactly as the model's own forward does: the base model's forward is run with its decoder layers
stood in for by recorders, which keep the keyword arguments each layer would get (per layer:
Gemma2 alternates sliding and full masks). Without a padding mask those depend on the input's
shape alone, and one recording serves every micro-batch of that shape; a dict batch's
attention_mask (every stage reads the same batch) is recorded with its micro-batch.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from hvdtrain.parallel.pipeline.hf_plan import HFPipelinePlan, hf_pipeline_plan, hidden_of, layers_replaced

Extras = Optional[Dict[str, torch.Tensor]]


def _mask_of(extras: Extras) -> Optional[torch.Tensor]:
    return None if extras is None else extras.get("attention_mask")


class _Reached(Exception):
    """Decoder layer 0 was reached: carries the hidden states the model's forward gave it."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__("decoder layer 0 reached")
        self.hidden = hidden


class _StopAtFirst(nn.Module):
    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise _Reached(hidden_of(args, kwargs)[0])


class _Recorder(nn.Module):
    """Stands in for decoder layer ``index`` during a recording: keeps its other arguments; the last
    one ends the forward (nothing after the layers is needed)."""

    def __init__(self, calls: Dict[int, Tuple[Tuple[Any, ...], Dict[str, Any]]], index: int, last: bool) -> None:
        super().__init__()
        self.calls, self.index, self.last = calls, index, last

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        hidden, rest, kwargs = hidden_of(args, kwargs)
        self.calls[self.index] = (rest, kwargs)
        if self.last:
            raise _Reached(hidden)
        return hidden


class _Substitute(nn.Module):
    """Stands in for decoder layer 0 on the last stage: the hidden states the previous stage sent."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = hidden

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.hidden


class _PassThrough(nn.Module):
    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden_of(args, kwargs)[0]


class _HFPart(nn.Module):
    """A pipeline layer that runs part of the model's forward: it holds (as submodules, so as its
    parameters) the modules of the plan's ``paths``, and reaches the model without holding it."""

    takes_extras = True  # the micro-batch's attention_mask, from the pipeline stage

    def __init__(self, model: nn.Module, plan: HFPipelinePlan, paths: Tuple[str, ...]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(model.get_submodule(path) for path in paths)
        self.plan = plan
        self.__dict__["model"] = model  # not a module: the other layers' parameters stay out of this one


class ModelEntry(_HFPart):
    """The first layer: token ids -> the hidden states decoder layer 0 gets, by the model's forward
    (the embedding tied to the head when the model ties them: the pipeline sums the two ends' gradients)."""

    def forward(self, ids: torch.Tensor, extras: Extras = None) -> torch.Tensor:
        model, plan = self.model, self.plan
        base = model.get_submodule(plan.base) if plan.base else model
        count = len(model.get_submodule(plan.layers))
        with layers_replaced(model, plan.layers, [_StopAtFirst() for _ in range(count)]):
            try:
                base(input_ids=ids, attention_mask=_mask_of(extras), use_cache=False)
            except _Reached as reached:
                return reached.hidden
        raise RuntimeError(f"the {plan.family!r} model's forward returned without calling its decoder layer 0")


class ModelExit(_HFPart):
    """The last layer: the last decoder layer's hidden states -> logits (batch, tokens, vocabulary),
    by the causal LM's own forward after its layers."""

    def forward(self, hidden: torch.Tensor, extras: Extras = None) -> torch.Tensor:
        model, plan = self.model, self.plan
        count = len(model.get_submodule(plan.layers))
        stand_ins = [_Substitute(hidden)] + [_PassThrough() for _ in range(count - 1)]
        with layers_replaced(model, plan.layers, stand_ins):
            # The forward starts from inputs_embeds (the probe checked that this path calls no module
            # with parameters before layer 0), whose values layer 0's stand-in discards.
            out = model(inputs_embeds=torch.zeros_like(hidden).detach(), attention_mask=_mask_of(extras),
                        use_cache=False)
        return out.logits


class DecoderContext:
    """The arguments the base model's forward gives each decoder layer, for one input shape."""

    def __init__(self, model: nn.Module, plan: HFPipelinePlan) -> None:
        self.model, self.plan = model, plan
        self._key: Optional[Tuple[Any, ...]] = None
        self._mask: Optional[torch.Tensor] = None
        self._calls: Dict[int, Tuple[Tuple[Any, ...], Dict[str, Any]]] = {}

    def for_layer(self, index: int, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor] = None
                  ) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
        key = (tuple(hidden.shape), hidden.dtype, hidden.device)
        # The mask is compared by identity: it is held here, so no other tensor can take its place.
        if key != self._key or attention_mask is not self._mask:
            self._calls = self._record(hidden, attention_mask)
            self._key, self._mask = key, attention_mask
        return self._calls[index]

    def _record(self, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor]
                ) -> Dict[int, Tuple[Tuple[Any, ...], Dict[str, Any]]]:
        model, plan = self.model, self.plan
        base = model.get_submodule(plan.base) if plan.base else model
        count = len(model.get_submodule(plan.layers))
        calls: Dict[int, Tuple[Tuple[Any, ...], Dict[str, Any]]] = {}
        with layers_replaced(model, plan.layers, [_Recorder(calls, i, i == count - 1) for i in range(count)]):
            try:
                with torch.no_grad():
                    # A copy: some forwards scale inputs_embeds in place (CTRL's *= sqrt(d)), and the
                    # hidden states are the layer's input, not the recording's.
                    base(inputs_embeds=hidden.detach().clone(), attention_mask=attention_mask, use_cache=False)
            except _Reached:
                pass
        return calls


class DecoderLayer(nn.Module):
    """Decoder layer ``index`` with the mask and position embeddings its model would give it."""

    takes_extras = True  # the micro-batch's attention_mask, from the pipeline stage

    def __init__(self, layer: nn.Module, index: int, context: DecoderContext) -> None:
        super().__init__()
        self.layer, self.index = layer, index
        self.context = context  # not a module: the base model stays out of this layer's parameters

    def forward(self, hidden: torch.Tensor, extras: Extras = None) -> torch.Tensor:
        rest, kwargs = self.context.for_layer(self.index, hidden, _mask_of(extras))
        out = self.layer(hidden, *rest, **kwargs)
        return out[0] if isinstance(out, tuple) else out


def hf_pipeline_layers(model: nn.Module, plan: Optional[HFPipelinePlan] = None) -> List[nn.Module]:
    """[entry, decoder layer 0, ..., decoder layer L-1, exit] of a Hugging Face causal LM. ``plan``:
    hf_pipeline_plan(model), probed before the model was split (default: probed now)."""
    plan = plan or hf_pipeline_plan(model)
    context = DecoderContext(model, plan)
    layers = model.get_submodule(plan.layers)
    decoder = [DecoderLayer(layer, i, context) for i, layer in enumerate(layers)]
    return [ModelEntry(model, plan, plan.entry), *decoder, ModelExit(model, plan, plan.exit)]
