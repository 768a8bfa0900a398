"""Which slice of a whole tensor a tensor-parallel rank holds, and the arithmetic of taking it from
the whole and putting it back. Torch only (no Horovod): checkpoints written under a mesh record
each slice as ``TensorShard.spec()`` and are read back in one process (export, consolidation).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import torch


@dataclass(frozen=True)
class TensorShard:
    """A local parameter is slice ``index`` of ``parts`` of the full one along ``dim``. With
    ``groups`` > 1 the full dim is viewed as (groups, -1) and every group is cut alike: qkv's rows
    [q; k; v] give (q_i; k_i; v_i), the heads of rank i in each of the three."""

    dim: int
    parts: int
    index: int
    groups: int = 1

    def __post_init__(self) -> None:
        if self.parts < 1 or self.groups < 1 or not 0 <= self.index < self.parts:
            raise ValueError(f"{self}: needs parts >= 1, groups >= 1 and 0 <= index < parts")

    def _grouped(self, shape: torch.Size) -> Tuple[int, ...]:
        size = shape[self.dim]
        if size % (self.groups * self.parts):
            raise ValueError(f"{self}: dim {self.dim} of shape {tuple(shape)} does not split into "
                             f"{self.groups} groups x {self.parts} parts")
        return tuple(shape[:self.dim]) + (self.groups, size // self.groups) + tuple(shape[self.dim + 1:])

    def _slice(self, full: torch.Tensor) -> torch.Tensor:
        """This shard's elements of ``full``: a view (groups, chunk) along dim."""
        grouped = full.view(self._grouped(full.shape))
        return grouped.chunk(self.parts, dim=self.dim + 1)[self.index]

    def local_shape(self, full_shape: torch.Size) -> torch.Size:
        shape = list(full_shape)
        shape[self.dim] //= self.parts
        return torch.Size(shape)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of ``full`` (a contiguous copy)."""
        return self._slice(full).reshape(self.local_shape(full.shape)).clone()

    def place(self, full_out: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """Write ``local`` into its slice of the (contiguous) full-size ``full_out``; returns it."""
        if local.shape != self.local_shape(full_out.shape):
            raise ValueError(f"{self}: a local shape {tuple(local.shape)} is not a slice of {tuple(full_out.shape)}")
        target = self._slice(full_out)
        target.copy_(local.reshape(target.shape))
        return full_out

    def spec(self) -> List[int]:
        """What a checkpoint records of it (JSON- and torch.load-safe)."""
        return [self.dim, self.parts, self.index, self.groups]

    @classmethod
    def from_spec(cls, spec) -> "TensorShard":
        dim, parts, index, groups = spec
        return cls(dim=int(dim), parts=int(parts), index=int(index), groups=int(groups))
