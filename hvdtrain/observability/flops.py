"""The model FLOPs of one training step, counted once, from the whole model as the user built it.

Counted by torch's own ``FlopCounterMode`` on a copy of the model on the meta device: the user's
step (forward, loss) and its backward run on tensors that have shapes but no values, so the count
costs no compute and no memory, touches no parameter, gradient or random stream, and runs no
strategy hook or collective. The copy is taken before hvdtrain changes the model (activation
checkpointing, sequence parallelism, tensor and pipeline splits, the strategy's wrappers), so:

- the count is of the whole model, once: a tensor or pipeline split does not count a layer on
  every rank it spans, and each rank's share is the total over the world's ranks;
- recomputed activations are not counted: these are model FLOPs (MFU), not hardware FLOPs;
- frozen parameters take no weight-gradient products in the backward, as in training.

For a transformer, what FlopCounterMode counts is PaLM's model FLOPs per token (Chowdhery et al.
2022, appendix B): 6·N for the parameters' products, forward and backward, plus 12·L·H·S for
attention's two products over a sequence of S tokens (L layers of width H, causal masking not
subtracted), without embedding lookups (no product). A step the meta device cannot run (one that
reads a value, ``.item()``) falls back, for a token model, to 6·N per token over the parameters a
token uses: all but embedding lookups, and of a fused experts module only the top-k of its experts
that the model's config names (attention not counted); other models then go without a count, and the
start line says why. A token model with fused experts always takes that formula: it routes by the
data, so what a meta run counts is whatever its experts' implementation does without values (under
torch 2.7, transformers' Qwen3-MoE ran on the meta device and was counted at 0.68 of the top-k
FLOPs; newer torch cannot run it), not the top-k experts a token visits.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional

import torch
from torch.utils.flop_counter import FlopCounterMode

META = torch.device("meta")


@dataclass(frozen=True)
class ModelFlops:
    """One training step's model FLOPs per sample (and per token, for a token model), and how they
    were counted."""

    per_sample: float
    tokens_per_sample: Optional[int]  # None: not a token model
    method: str

    @property
    def per_token(self) -> Optional[float]:
        return self.per_sample / self.tokens_per_sample if self.tokens_per_sample else None


def meta_copy(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` copied with every parameter and buffer on the meta device (shapes, no values): no
    tensor's data is copied. Tied parameters stay tied."""
    memo: dict = {}
    for parameter in model.parameters():
        memo[id(parameter)] = torch.nn.Parameter(torch.empty_like(parameter, device=META),
                                                 requires_grad=parameter.requires_grad)
    for buffer in model.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device=META)
    return copy.deepcopy(model, memo)


def on_meta(batch: Any) -> Any:
    """The batch with every tensor replaced by an empty one of its shape on the meta device.
    (``empty_like``, not ``.to``: values are never read, and none is copied.)"""
    if isinstance(batch, torch.Tensor):
        return torch.empty_like(batch, device=META)
    if isinstance(batch, Mapping):
        moved = {key: on_meta(value) for key, value in batch.items()}
        return moved if type(batch) is dict else type(batch)(moved)
    if isinstance(batch, (tuple, list)):
        moved = [on_meta(item) for item in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    return batch


def tokens_per_sample(model: torch.nn.Module, batch: Any) -> Optional[int]:
    """The sequence length when ``batch`` is a token model's: ``input_ids`` of a dict batch, or an
    (inputs, targets) batch whose inputs are 2-D integer ids, into a model with an embedding
    (integer features without one are not tokens). None otherwise."""
    if isinstance(batch, Mapping):
        ids = batch.get("input_ids")
    elif isinstance(batch, (tuple, list)) and batch:
        ids = batch[0]
    else:
        return None
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point() or ids.is_complex():
        return None
    if not any(isinstance(module, torch.nn.Embedding) for module in model.modules()):
        return None
    return int(ids.shape[1])


def matmul_parameters(model: torch.nn.Module) -> float:
    """N of the 6·N formula, the parameters one token multiplies by: every parameter once (tied ones
    once), but an embedding table only when another layer multiplies by it too (a tied output layer):
    a lookup is no product; and of a fused experts module, top-k / experts of it (a token visits its
    top-k experts only), when the model's config names top-k."""
    lookups = {id(module.weight) for module in model.modules() if isinstance(module, torch.nn.Embedding)}
    multiplied = {id(parameter) for module in model.modules() if not isinstance(module, torch.nn.Embedding)
                  for parameter in module.parameters(recurse=False)}
    share = routed_shares(model)
    return sum(parameter.numel() * share.get(id(parameter), 1.0) for parameter in model.parameters()
               if id(parameter) not in lookups or id(parameter) in multiplied)


def routed_shares(model: torch.nn.Module) -> Dict[int, float]:
    """id(parameter) -> top-k / experts for every parameter of a fused experts module (what expert
    parallelism splits), when its experts per token are named: by the model's config (Hugging Face),
    else by the experts module or the layer holding it (a model of your own: ``top_k``, as
    hvdtrain.examples.moe's); nothing for experts whose top-k is named nowhere."""
    from hvdtrain.parallel.experts import experts_per_token, fused_experts

    from_config = experts_per_token(getattr(model, "config", None))
    shares = {}
    for path, module in fused_experts(model).items():
        layer = model.get_submodule(path.rpartition(".")[0])
        top_k = from_config or experts_per_token(module) or experts_per_token(layer)
        if top_k is not None:
            shares.update({id(parameter): min(top_k / module.num_experts, 1.0)
                           for parameter in module.parameters(recurse=False)})
    return shares


def count_step(shadow: torch.nn.Module, step_fn: Callable[[torch.nn.Module, Any], Any], batch: Any) -> float:
    """FLOPs of ``step_fn(shadow, batch)`` and the loss's backward, counted by FlopCounterMode on the
    meta device (``shadow`` from meta_copy)."""
    with FlopCounterMode(display=False) as counter:
        loss, _ = step_fn(shadow, on_meta(batch))
        if loss.requires_grad:
            loss.backward()
    return float(counter.get_total_flops())


def first_sentence(text: str, limit: int = 120) -> str:
    """An error's first sentence, short enough for the start line (torch's meta errors run to a
    paragraph of advice)."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    sentence = line.split(". ")[0].rstrip(".")
    return sentence if len(sentence) <= limit else sentence[:limit - 3].rstrip() + "..."


def count_model_flops(shadow: torch.nn.Module, step_fn: Callable[[torch.nn.Module, Any], Any], batch: Any,
                      samples: int) -> ModelFlops:
    """One training step's model FLOPs per sample, from one batch of ``samples``; ValueError (with
    the reason) when they cannot be counted.

    Args:
        shadow: the whole model on the meta device (meta_copy).
        step_fn: the run's step, ``step_fn(model, batch) -> (loss, metrics)``.
        batch: a batch as the loader gives it (any device).
        samples: the samples in it.
    """
    from hvdtrain.parallel.experts import fused_experts

    tokens = tokens_per_sample(shadow, batch)
    if tokens is not None and fused_experts(shadow):
        return ModelFlops(6.0 * matmul_parameters(shadow) * tokens, tokens,
                          "6N per token over the experts a token visits (a mixture of experts routes by the data), "
                          "attention not counted")
    try:
        flops = count_step(shadow, step_fn, batch)
        if flops <= 0:
            raise ValueError("FlopCounterMode counted no matrix product")
        return ModelFlops(flops / samples, tokens, "FlopCounterMode, forward and backward of the whole model")
    except Exception as error:  # any failure of the step on meta tensors: the formula, or no count
        reason = f"{type(error).__name__}: {first_sentence(str(error))}"
        if tokens is None:
            raise ValueError(f"the step could not run on the meta device to count its FLOPs ({reason})") from error
        formula = 6.0 * matmul_parameters(shadow) * tokens
        return ModelFlops(formula, tokens, f"6N per token, attention not counted (the meta count failed: {reason})")
