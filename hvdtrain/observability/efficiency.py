"""Tokens/s, TFLOPs/s per rank and MFU, beside samples/s in every log line, epoch record and sink.

Two figures are fixed once per start, off the hot path: the model FLOPs of a training step per
sample (hvdtrain.observability.flops: the whole model, counted on the meta device at the first
batch, the first moment a batch's shape is known) and the rank's peak (hvdtrain.observability.peak,
at set-up, named in the start line). Each report then multiplies the global samples/s it measures:

    tokens/s          samples/s x tokens per sample                    (token models only)
    TFLOPs/s per rank samples/s x model FLOPs per sample / world size  (every rank of every group:
                      a tensor or pipeline split shares one replica's FLOPs out among its ranks)
    MFU               TFLOPs/s per rank / the rank's peak

Recorded as ``tokens_per_sec``, ``tflops_per_rank`` and ``mfu`` (a fraction; the line shows %).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Optional

import torch

from hvdtrain.observability.flops import ModelFlops, count_model_flops, meta_copy
from hvdtrain.observability.peak import Peak, device_peak


def describe(figures: Mapping[str, float]) -> str:
    """"81920 tokens/s, 0.052 TFLOPs/s per rank, MFU 21.3%" (what ``figures`` holds of them)."""
    parts = []
    if "tokens_per_sec" in figures:
        parts.append(f"{figures['tokens_per_sec']:.0f} tokens/s")
    if "tflops_per_rank" in figures:
        parts.append(f"{figures['tflops_per_rank']:.3g} TFLOPs/s per rank")
    if "mfu" in figures:
        parts.append(f"MFU {figures['mfu']:.1%}")
    return ", ".join(parts)


class Efficiency:
    """The model FLOPs (counted once, at the first batch) and the peak, and the figures of a rate.

    Args:
        model: the whole model as the user built it, before hvdtrain changes it (copied to meta).
        step_fn: the run's step, ``step_fn(model, batch) -> (loss, metrics)``, on whole sequences.
        peak: this rank's peak FLOP/s.
    """

    def __init__(self, model: torch.nn.Module, step_fn: Callable[[torch.nn.Module, Any], Any], peak: Peak) -> None:
        self.step_fn, self.peak = step_fn, peak
        self.flops: Optional[ModelFlops] = None
        self.missing: Optional[str] = None  # why there is no count
        self.shadow: Optional[torch.nn.Module] = None
        try:
            self.shadow = meta_copy(model)
        except Exception as error:  # a model deepcopy cannot copy: no count, and the line says why
            self.missing = f"the model could not be copied to the meta device ({type(error).__name__}: {error})"

    @classmethod
    def at_setup(cls, model: torch.nn.Module, step_fn: Callable[[torch.nn.Module, Any], Any], precision: str,
                 device: torch.device) -> "Efficiency":
        """Every rank at set-up: the model's meta copy and this rank's peak (measured on a CPU).

        Args:
            model: the whole model as the user built it.
            step_fn: the run's step, on whole sequences.
            precision: train.precision (the peak's dtype).
            device: this rank's device.
        """
        return cls(model, step_fn, device_peak(device, precision))

    @property
    def counted(self) -> bool:
        return self.flops is not None or self.missing is not None

    def count(self, batch: Any, samples: int) -> str:
        """Once, at the first batch: the model FLOPs per sample; returns the line that says them."""
        if self.shadow is not None and not self.counted:
            try:
                self.flops = count_model_flops(self.shadow, self.step_fn, batch, samples)
            except ValueError as error:
                self.missing = str(error)
            self.shadow = None  # the copy's Python objects are not needed again
        if self.flops is None:
            return f"no model FLOPs, so no TFLOPs/s or MFU: {self.missing}"
        flops = self.flops
        per_token = f", {flops.per_token / 1e6:.4g} MFLOPs per token" if flops.per_token else ""
        return (f"model FLOPs of a training step: {flops.per_sample / 1e9:.4g} GFLOPs per sample{per_token} "
                f"({flops.method}); {self.peak.describe()}")

    def figures(self, samples_per_sec: float, world_size: int) -> Dict[str, float]:
        """tokens_per_sec (token models), tflops_per_rank and mfu at ``samples_per_sec`` (global) over
        ``world_size`` ranks; empty before the count, or without one."""
        if self.flops is None:
            return {}
        figures: Dict[str, float] = {}
        if self.flops.tokens_per_sample:
            figures["tokens_per_sec"] = samples_per_sec * self.flops.tokens_per_sample
        per_rank = samples_per_sec * self.flops.per_sample / world_size
        figures["tflops_per_rank"] = per_rank / 1e12
        figures["mfu"] = per_rank / self.peak.flops_per_sec
        return figures
