"""A model's blocks: its repeated layers, the unit of fsdp's gathering and of activation checkpointing.

The blocks are the members of the model's containers (nn.ModuleList, nn.Sequential), found by
descending through its children and through nested containers; the model's own members when it is
a container itself. A transformer's blocks are its layers (GPT-2's ``transformer.h``, Llama's
``model.layers``); embeddings, norms and heads outside containers are not blocks.
"""
from __future__ import annotations

from typing import Iterator, List, Tuple

from torch import nn

CONTAINERS = (nn.ModuleList, nn.Sequential)


def model_blocks(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """(path, module) of every block, in registration order (a module shared twice: once)."""
    found, seen = [], set()
    for path, block in _blocks(model, ""):
        if id(block) not in seen:
            seen.add(id(block))
            found.append((path, block))
    return found


def _blocks(module: nn.Module, prefix: str) -> Iterator[Tuple[str, nn.Module]]:
    for name, child in module.named_children():
        if isinstance(module, CONTAINERS) and not isinstance(child, CONTAINERS):
            yield prefix + name, child
        else:
            yield from _blocks(child, f"{prefix}{name}.")
