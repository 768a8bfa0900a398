"""A checkpoint's state copied to host memory, so that training can change the live tensors while a
background thread writes the copy.

The copy is the only part of an asynchronous save the step waits for. Its buffers are kept and
reused by the next save of the same shapes (no allocation, no page faults after the first), pinned
when the state is on a GPU so that the device-to-host copies run asynchronously and are waited
for once.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch


class HostSnapshot:
    """Copies nested dicts, lists and tuples of tensors and plain values into host buffers of its own."""

    def __init__(self) -> None:
        self._buffers: List[torch.Tensor] = []
        self._used = 0
        self._device_copies = False

    @property
    def bytes(self) -> int:
        """Host memory the buffers take (one more copy of what each save writes)."""
        return sum(buffer.numel() * buffer.element_size() for buffer in self._buffers)

    def copy(self, state: Any) -> Any:
        """``state`` with every tensor replaced by a host copy (a tensor that appears twice, as tied
        weights do, is copied once and appears twice). The previous copy's buffers are reused: the
        caller no longer needs it (its write has finished)."""
        self._used, self._device_copies = 0, False
        copied = self._copy(state, {})
        if self._device_copies:
            torch.cuda.synchronize()  # the non-blocking device-to-host copies, all done
        del self._buffers[self._used:]  # the state shrank: what it no longer needs goes
        return copied

    def _copy(self, value: Any, seen: Dict[int, torch.Tensor]) -> Any:
        if isinstance(value, torch.Tensor):
            if id(value) not in seen:
                seen[id(value)] = self._tensor(value.detach())
            return seen[id(value)]
        if isinstance(value, dict):
            return {key: self._copy(item, seen) for key, item in value.items()}
        if isinstance(value, list):
            return [self._copy(item, seen) for item in value]
        if isinstance(value, tuple):
            return tuple(self._copy(item, seen) for item in value)
        return value  # numbers, strings, None: immutable

    def _tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        buffer = self._reusable(tensor)
        if buffer is None:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.device.type == "cuda")
            if self._used < len(self._buffers):
                self._buffers[self._used] = buffer
            else:
                self._buffers.append(buffer)
        self._used += 1
        from_gpu = tensor.device.type == "cuda"  # into pinned memory: asynchronous, waited for in copy()
        buffer.copy_(tensor, non_blocking=from_gpu)
        self._device_copies |= from_gpu
        return buffer

    def _reusable(self, tensor: torch.Tensor) -> Optional[torch.Tensor]:
        if self._used >= len(self._buffers):
            return None
        buffer = self._buffers[self._used]
        return buffer if buffer.shape == tensor.shape and buffer.dtype == tensor.dtype else None
