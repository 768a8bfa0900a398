"""Set-up's proof that a split model computes what the whole one did, on one probe input.

The first-step audit (tensor_audit) proves every contribution is counted once; it cannot see a
split that computes consistently the wrong thing on every rank (a layer whose forward did more than
its split runs, an attention that views its split width as all its heads). While every rank still
holds the whole model (set-up, before it is split), a Hugging Face causal LM is run once on a few
token ids, in eval mode, and run again once split: the logits must be the whole model's up to the
rounding of a different order of additions. It costs two forwards of a few tokens, once; a model
built on the meta device has no values to run before it is split, and is not probed (``hvdtrain
check-layout`` checks its family).
"""
from __future__ import annotations

from typing import Any, Optional

import horovod.torch as hvd
import torch
from torch import nn

PROBE_TOKENS = 8
# Relative distance of the logits (norm of the difference over the norm) a right split stays within,
# by the model's dtype: a different order of additions, and transformers' float32 steps inside even a
# float64 model (its norms, its softmax), move logits by ~1e-7; bf16 by ~1e-2. A dropped scale or a
# cut head moves them by their own size.
WITHIN = {torch.float64: 1e-5, torch.float32: 1e-3}
WITHIN_LOW_PRECISION = 1e-1


def probe_ids(model: nn.Module, device: torch.device) -> Optional[torch.Tensor]:
    """A few token ids, the same on every rank, for a Hugging Face causal LM; None for another model."""
    config = getattr(model, "config", None)
    vocabulary = getattr(config, "vocab_size", None)
    if not isinstance(vocabulary, int) or vocabulary < 2 or not hasattr(model, "get_input_embeddings"):
        return None
    length = min(PROBE_TOKENS, getattr(config, "max_position_embeddings", PROBE_TOKENS) or PROBE_TOKENS)
    generator = torch.Generator().manual_seed(0)  # the same ids on every rank
    return torch.randint(0, vocabulary, (1, length), generator=generator).to(device)


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return model(input_ids=ids, use_cache=False).logits.detach()
    finally:
        model.train(training)


class ForwardProbe:
    """``before_split(model)`` on the whole model, ``after_split(model)`` once it is split (every
    rank of the world calls both: the verdict is agreed)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.ids: Optional[torch.Tensor] = None
        self.whole: Optional[torch.Tensor] = None

    def before_split(self, model: nn.Module) -> None:
        ids = probe_ids(model, self.device)
        if ids is None:
            return
        try:
            self.whole = _logits(model, ids)
            self.ids = ids
        except Exception:  # noqa: BLE001  (a model that takes no input_ids alone: nothing to probe with)
            self.ids = self.whole = None

    def after_split(self, model: nn.Module, every_rank: Any = None) -> None:
        probed = torch.tensor([0.0 if self.ids is None else 1.0], dtype=torch.float64, device=self.device)
        kwargs = {} if every_rank is None else {"process_set": every_rank}
        # Every rank probes, or none does: the split forward is a collective of the tensor group.
        if hvd.allreduce(probed, op=hvd.Min, name="tp.probe.probed", **kwargs).item() == 0:
            return
        problem = ""
        try:
            split = _logits(model, self.ids)
            scale = self.whole.double().norm().clamp_min(1e-300)
            distance = ((split.double() - self.whole.double()).norm() / scale).item()
            within = WITHIN.get(self.whole.dtype, WITHIN_LOW_PRECISION)
            if not distance <= within:
                problem = (f"on a probe of {self.ids.shape[1]} tokens its logits are {distance:.3g} away from the "
                           f"whole model's (relative; a right split stays within {within:g}): a layer computes "
                           f"otherwise once split. Find it with hvdtrain check-layout, or leave it out of the plan")
        except Exception as error:  # noqa: BLE001  (agreed below: no rank left in a collective alone)
            problem = f"the split model's forward failed on a probe: {type(error).__name__}: {error}"
        self.ids = self.whole = None
        failed = torch.tensor([1.0 if problem else 0.0], dtype=torch.float64, device=self.device)
        if hvd.allreduce(failed, op=hvd.Max, name="tp.probe.verdict", **kwargs).item() == 0:
            return
        raise ValueError("tensor parallelism would train another model than one process (found at set-up): "
                         + (problem or "another rank's split model differs from the whole one (its ranks say how)"))
