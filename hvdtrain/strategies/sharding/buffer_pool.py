"""Flat buffers kept for reuse: zero2's full-size gradient buckets and their fp16 wire copies.

A fresh 16-25 MiB buffer every micro-batch is first-touched page by page (a minor page fault per
4 KiB) and returned to the system when freed, so every step pays for it again; a buffer taken back
from the pool is only zeroed. Within a step every buffer given back is reused; between steps the
pool keeps at most ``keep`` of them (``trim``), so that what it holds is bounded by the bucket size,
not the model's: zero2's point is holding 1/N of the gradients between steps. The strategy reports
what is kept (``held``) apart from those gradients.
"""
from __future__ import annotations

from collections import defaultdict
from typing import DefaultDict, List, Tuple

import torch

Key = Tuple[int, torch.dtype, torch.device]


class BufferPool:
    """Free flat buffers by (elements, dtype, device). ``take`` hands out one (zeroed), ``give_back``
    returns it once nothing reads it any more (its collective has finished)."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._free: DefaultDict[Key, List[torch.Tensor]] = defaultdict(list)

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        free = self._free[(numel, dtype, torch.device(device))]
        if free:
            return free.pop().zero_()
        return torch.zeros(numel, dtype=dtype, device=device)

    def give_back(self, buffer: torch.Tensor) -> None:
        self._free[(buffer.numel(), buffer.dtype, buffer.device)].append(buffer)

    def trim(self) -> None:
        """Keep the ``keep`` largest free buffers, free the others (at the end of a step)."""
        kept = sorted(self.held(), key=lambda b: b.numel() * b.element_size(), reverse=True)[:self.keep]
        self._free.clear()
        for buffer in kept:
            self.give_back(buffer)

    def held(self) -> List[torch.Tensor]:
        """The buffers kept now (between steps: all of them)."""
        return [buffer for free in self._free.values() for buffer in free]
