"""Which slice of a whole tensor a tensor-parallel rank holds (TensorShard), or which range of its
elements a rank of a flat sharded strategy holds (FlatRange), and the arithmetic of taking it from
the whole and putting it back. Torch only (no Horovod): checkpoints written under a mesh record
each piece as its ``spec()`` and are read back in one process (export, consolidation).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple, Union

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


@dataclass(frozen=True)
class FlatRange:
    """A local tensor is elements [start, stop) of the whole one (of ``shape``) flattened: what an fsdp
    rank's slice of a flat bucket holds of a parameter, which the slice's bounds may cut anywhere."""

    start: int
    stop: int
    shape: Tuple[int, ...]

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.stop <= math.prod(self.shape):
            raise ValueError(f"{self}: needs 0 <= start < stop <= {math.prod(self.shape)} elements")

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This range of ``full`` (a contiguous copy)."""
        return full.reshape(-1)[self.start:self.stop].clone()

    def place(self, full_out: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """Write ``local`` into its range of the (contiguous) full-size ``full_out``; returns it."""
        if tuple(full_out.shape) != self.shape or local.numel() != self.stop - self.start:
            raise ValueError(f"{self}: {local.numel()} elements are not this range of shape {tuple(full_out.shape)}")
        full_out.view(-1)[self.start:self.stop].copy_(local.reshape(-1))
        return full_out

    def spec(self) -> Dict[str, Any]:
        """What a checkpoint records of it (a dict: a TensorShard's spec is a list)."""
        return {"start": self.start, "stop": self.stop, "shape": list(self.shape)}

    @classmethod
    def from_spec(cls, spec: Dict[str, Any]) -> "FlatRange":
        return cls(start=int(spec["start"]), stop=int(spec["stop"]), shape=tuple(int(n) for n in spec["shape"]))


def piece_from_spec(spec: Any) -> Union[TensorShard, FlatRange]:
    """The piece a checkpoint's spec describes: a FlatRange's is a dict, a TensorShard's a list."""
    return FlatRange.from_spec(spec) if isinstance(spec, dict) else TensorShard.from_spec(spec)
