"""A tensor's memory given back and taken again while every view of it stays valid: how fsdp frees a
unit's gathered parameters between uses, and how a model built on the meta device holds no memory
until a strategy gives it its values (its own slice, stage or shard). Internal."""
from __future__ import annotations

import torch


def release_storage(tensor: torch.Tensor) -> None:
    """Give the memory back; every view (the parameters, autograd's saved tensors) keeps the storage."""
    tensor.untyped_storage().resize_(0)


def allocate_storage(tensor: torch.Tensor) -> None:
    tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())


def is_allocated(tensor: torch.Tensor) -> bool:
    return tensor.untyped_storage().nbytes() > 0
