"""Activation checkpointing (train.activation_checkpointing): chosen blocks keep only their inputs
for backward and compute their forward again there, one more forward of those blocks for the
activations inside them (torch.utils.checkpoint, non-reentrant: the random streams and autocast of
the first forward are replayed, so dropout masks and results are the same).

The blocks are the model's repeated layers (hvdtrain.components.blocks): ``full`` checkpoints every
one, ``every_k`` every k-th (train.activation_checkpointing_every). ``selective`` checkpoints every
block by operation (torch's selective checkpointing, the policy torchtitan uses): the outputs of the
matrix products and attention, the expensive part of the forward, are kept; everything else (norms,
activation functions, elementwise ops) is computed again in backward. A block's forward is wrapped,
the module stays what it was (its class, hooks, state_dict keys): fsdp's hooks gather a unit before
its first forward, and again for its backward, before the recompute runs.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from hvdtrain.config.train import ACTIVATION_CHECKPOINTING as MODES
from hvdtrain.components.blocks import model_blocks


# The storages kept for backward while saved_activation_bytes counts them (None: not counting).
_counted: Optional[Dict[int, int]] = None


def _kept_operations() -> frozenset:
    """The operations whose outputs ``selective`` keeps: matrix products and attention (those of
    this torch; a name it does not have is left out)."""
    names = ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention")
    aten = torch.ops.aten
    return frozenset(getattr(aten, name).default for name in names if hasattr(aten, name))


KEPT_OPERATIONS = _kept_operations()


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in KEPT_OPERATIONS else CheckpointPolicy.PREFER_RECOMPUTE


class _CountKeptOutputs(TorchDispatchMode):
    """While saved_activation_bytes counts: the outputs selective checkpointing keeps (held by its
    own context, not by autograd's saved tensors)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in KEPT_OPERATIONS and _counted is not None:
            for value in tree_leaves(out):
                if isinstance(value, torch.Tensor):
                    _count(value)
        return out


class RecomputedForward:
    """A block's forward that keeps only its inputs for backward (``selective``: also its matrix
    products' and attention's outputs). An attribute of the module, holding the module's own bound
    forward: deepcopy and pickling carry it along with the module."""

    def __init__(self, forward: Any, selective: bool = False) -> None:
        self.forward, self.selective = forward, selective

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing would be saved
            return self.forward(*args, **kwargs)
        if _counted is not None:  # the recompute holds the inputs, outside autograd's saved tensors
            for value in (*args, *kwargs.values()):
                if isinstance(value, torch.Tensor):
                    _count(value)
        if not self.selective:
            return checkpoint(self.forward, *args, use_reentrant=False, **kwargs)
        forward = self.forward
        if _counted is not None:
            forward = functools.partial(_counting_kept, self.forward)
        return checkpoint(forward, *args, use_reentrant=False,
                          context_fn=functools.partial(create_selective_checkpoint_contexts, _selective_policy),
                          **kwargs)


def _counting_kept(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    with _CountKeptOutputs():
        return forward(*args, **kwargs)


def _count(tensor: torch.Tensor) -> torch.Tensor:
    storage = tensor.untyped_storage()
    _counted[storage.data_ptr()] = storage.nbytes()
    return tensor


def saved_activation_bytes(model: nn.Module, forward: Callable[[], Any]) -> Tuple[Any, int]:
    """``forward()``'s result and the activation bytes it keeps for backward: the distinct storages
    autograd saves and the inputs of checkpointed blocks, but not ``model``'s parameters and buffers
    (layers save their weights too, which training holds anyway)."""
    global _counted
    _counted = {}
    try:
        with torch.autograd.graph.saved_tensors_hooks(_count, lambda tensor: tensor):
            result = forward()
        for tensor in (*model.parameters(), *model.buffers()):
            _counted.pop(tensor.untyped_storage().data_ptr(), None)
        return result, sum(_counted.values())
    finally:
        _counted = None


def chosen_blocks(model: nn.Module, mode: str, every: int) -> List[str]:
    """The paths of the blocks ``mode`` checkpoints: all, or every ``every``-th (the k-th, 2k-th...)."""
    if mode not in MODES:
        raise ValueError(f"activation_checkpointing must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "none":
        return []
    blocks = model_blocks(model)
    if not blocks:
        raise ValueError("train.activation_checkpointing checkpoints the model's blocks, the members of its "
                         "nn.ModuleList / nn.Sequential containers, and this model has none: keep the repeated "
                         "layers in an nn.ModuleList, or set activation_checkpointing=none")
    chosen = blocks if mode in ("full", "selective") else blocks[every - 1::every]
    return [path for path, _ in chosen]


def checkpoint_activations(model: nn.Module, mode: str, every: int = 2) -> List[str]:
    """Wrap the chosen blocks' forwards in place; returns their paths. A block with BatchNorm is
    refused: the recompute would count its batch in the running statistics twice."""
    paths = chosen_blocks(model, mode, every)
    modules = dict(model.named_modules())
    for path in paths:
        block = modules[path]
        norms = [name for name, m in block.named_modules()
                 if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
        if norms:
            raise ValueError(f"train.activation_checkpointing would compute block {path} twice per step, and its "
                             f"BatchNorm ({'.'.join(filter(None, (path, norms[0])))}) would count the batch in its running statistics twice: "
                             f"set activation_checkpointing=none, or use a norm without running statistics")
    config = getattr(model, "config", None)
    if paths and getattr(config, "use_cache", False):
        # A Hugging Face model keeps a key/value cache in its forward when use_cache is on: the
        # recompute would append to it a second time (transformers turns it off for its own
        # gradient checkpointing too); training needs no cache.
        config.use_cache = False
    for path in paths:
        block = modules[path]
        if not isinstance(block.forward, RecomputedForward):  # wrapped once, however often applied
            block.forward = RecomputedForward(block.forward, selective=mode == "selective")
    return paths
