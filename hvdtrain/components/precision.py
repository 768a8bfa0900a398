"""Mixed precision: the forward under autocast (bf16, fp16), and for fp16 a dynamic loss scale.

fp16 follows Horovod's order: synchronize the scaled gradients, unscale, check for inf/nan, step.
The check is one all-reduced flag, not torch's per-process GradScaler: under a sharded strategy each
rank holds only a slice of the gradients, and every rank must skip the same steps. The scale goes
into checkpoints. bf16 has fp32's exponent range and needs no scale.
"""
from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Dict, Sequence

import torch

import horovod.torch as hvd

AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    """Autocast for the forward and, under fp16, the loss scale (torch GradScaler's defaults).

    Args:
        name: fp32, bf16 or fp16.
        device: where the forward runs (autocast's device type).
        init_scale: fp16: the loss scale at the start.
        growth_factor: fp16: the scale's multiplier after ``growth_interval`` finite steps.
        backoff_factor: fp16: the scale's multiplier after a step with inf/nan.
        growth_interval: fp16: finite steps in a row before the scale grows.
    """

    def __init__(self, name: str, device: torch.device, init_scale: float = 2.0 ** 16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5, growth_interval: int = 2000) -> None:
        if name not in AUTOCAST_DTYPES:
            raise ValueError(f"unknown precision {name!r}: choose one of {', '.join(AUTOCAST_DTYPES)}")
        self.name, self.device = name, device
        self.scaled = name == "fp16"
        self.scale = init_scale if self.scaled else 1.0
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.good_steps = 0  # steps without inf/nan since the scale last changed
        self.skipped_steps = 0

    def autocast(self) -> ContextManager[Any]:
        dtype = AUTOCAST_DTYPES[self.name]
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.scaled else loss

    def unscale_and_check(self, gradients: Sequence[torch.Tensor], sharded: bool, name: str) -> bool:
        """After synchronize: divide the gradients by the scale; True when the step may be taken.

        ``gradients`` are this rank's averaged gradients (its slices when ``sharded``). With inf or
        nan anywhere, on any rank, every rank returns False and the scale backs off; after
        ``growth_interval`` good steps in a row it grows. A collective under sharded strategies."""
        if not self.scaled:
            return True
        found = torch.zeros((), dtype=torch.float32, device=gradients[0].device if gradients else self.device)
        for gradient in gradients:
            found = torch.maximum(found, (~torch.isfinite(gradient)).any().float())
        if sharded:
            found = hvd.allreduce(found, op=hvd.Max, name=name)
        finite = not bool(found)
        if finite:
            inverse = 1.0 / self.scale
            for gradient in gradients:
                gradient.mul_(inverse)
        self._update(finite)
        return finite

    def _update(self, finite: bool) -> None:
        if not finite:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped_steps += 1
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> Dict[str, Any]:
        return {"name": self.name, "scale": self.scale, "good_steps": self.good_steps,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """A checkpoint's scale continues only under the same precision (fp32 and bf16 keep none)."""
        if state.get("name") == self.name and self.scaled:
            self.scale, self.good_steps = state["scale"], state["good_steps"]
            self.skipped_steps = state["skipped_steps"]
