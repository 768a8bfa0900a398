"""A batch cut into this rank's part of every sequence, and the loss's share of the whole.

Every rank of a sequence group reads the same batch (the data is sharded over the groups, not the
ranks) and keeps tokens index·T/S .. (index+1)·T/S - 1 of every sequence. The loss must be one
process's: the mean over every target token of the group's batch, and the gradients averaged over
the world (N = D x S ranks) must be the D groups' mean. So each rank's loss is scaled to
S x (its targets' loss sum) / (the group's target count): the S ranks' mean is the group's mean.

- A Hugging Face batch (a dict with ``input_ids``): the labels are shifted over the whole sequence
  first (the target of a part's last token is the next part's first) and given as ``shift_labels``
  with the whole batch's count as ``num_items_in_batch`` (transformers' loss then sums this rank's
  targets and divides by the group's count); ``position_ids`` are the whole sequence's; the padding
  mask stays whole for the mask builder (hf.py) and is not given to the model.
- A tuple ``(inputs, targets)`` whose tensors are (B, T) (already shifted, as the example's
  windows): both cut; the step's mean loss over this rank's targets is scaled by S x its count /
  the group's count (1 when every target counts); positions for the model from ``token_offset()``.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Mapping
from typing import Any, Callable, Iterator, Optional, Tuple

import torch
import torch.nn.functional as F

from hvdtrain.common.errors import LayoutError
from hvdtrain.data.packing import IGNORE_INDEX

_OFFSET: contextvars.ContextVar[int] = contextvars.ContextVar("hvdtrain_sequence_offset", default=0)


def token_offset() -> int:
    """The position of this rank's first token in the whole sequence (0 outside sequence parallelism):
    a model with its own position embeddings adds it (hvdtrain.examples.textlm)."""
    return _OFFSET.get()


class BatchSplitter:
    """Cuts each batch for this rank of a sequence group (``size``, ``index``); remembers the whole
    sequence's length and padding mask while the step runs, for the attention mask.

    Args:
        group: the sequence group (``size``, ``index``).
    """

    def __init__(self, group: Any) -> None:
        self.size, self.index = group.size, group.index
        self.length: Optional[int] = None
        self.padding_mask: Optional[torch.Tensor] = None
        # True while a split step runs. A model's forward outside one (an evaluation of your own on
        # whole sequences) attends as one process does; the model's own pre-forward hook reads it once
        # per forward, so a backward's recomputation (activation checkpointing) keeps its forward's choice.
        self.active = False

    def _part(self, tensor: torch.Tensor) -> torch.Tensor:
        width = tensor.shape[1] // self.size
        return tensor[:, self.index * width:(self.index + 1) * width]

    def _check_length(self, length: int, what: str) -> None:
        if length % self.size:
            raise LayoutError(f"train.sequence_parallel={self.size} cuts every sequence into {self.size} equal "
                              f"parts, and this batch's {what} has {length} tokens: pad or cut sequences to a "
                              f"multiple of {self.size}")

    def split(self, batch: Any) -> Tuple[Any, Any]:
        """(this rank's part of ``batch``, the factor its mean loss is scaled by: a number, or a tensor
        on the batch's device, so that no step waits for the device to count targets)."""
        if isinstance(batch, Mapping) and "input_ids" in batch:
            return self._split_tokenized(batch)
        if isinstance(batch, (tuple, list)) and len(batch) == 2 and all(
                isinstance(t, torch.Tensor) and t.dim() >= 2 for t in batch) and batch[0].shape[:2] == batch[1].shape[:2]:
            return self._split_pair(batch)
        raise LayoutError("train.sequence_parallel cuts batches of token sequences: a dict with input_ids (a "
                          "tokenized dataset's, labels optional) or a pair (inputs, targets) of (batch, length) "
                          f"tensors; got {type(batch).__name__}")

    def _split_tokenized(self, batch: Mapping) -> Tuple[dict, float]:
        ids = batch["input_ids"]
        batch_size, length = ids.shape[:2]
        self._check_length(length, "input_ids")
        whole = torch.arange(length, device=ids.device).expand(batch_size, length)
        positions = batch.get("position_ids")
        if positions is not None and not torch.equal(positions, whole):
            raise LayoutError("train.sequence_parallel does not take position_ids other than 0..T-1 (packed "
                              "sequences) yet: the attention mask of a packed row is built from its positions, "
                              "which one rank holds in part; train packed rows without sequence parallelism")
        local = {}
        for key, value in batch.items():
            if key in ("attention_mask", "position_ids", "labels"):
                continue
            splits = isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == (batch_size, length)
            local[key] = self._part(value) if splits else value
        local["position_ids"] = self._part(whole)
        mask = batch.get("attention_mask")
        self.length = length
        self.padding_mask = None if mask is None or bool(mask.all()) else mask
        labels = batch.get("labels")
        if labels is None:
            return local, 1.0
        shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        local["labels"] = local["shift_labels"] = self._part(shifted).contiguous()
        local["num_items_in_batch"] = (shifted != IGNORE_INDEX).sum().clamp_min(1)
        return local, float(self.size)

    def _split_pair(self, batch: Any) -> Tuple[tuple, Any]:
        inputs, targets = batch
        self._check_length(inputs.shape[1], "inputs")
        self.length, self.padding_mask = inputs.shape[1], None
        local_targets = self._part(targets)
        if targets.is_floating_point():
            return (self._part(inputs), local_targets), 1.0
        counted = (targets != IGNORE_INDEX).sum().clamp_min(1)
        mine = (local_targets != IGNORE_INDEX).sum()
        return (self._part(inputs), local_targets), self.size * mine / counted

    @contextlib.contextmanager
    def positioned(self, batch: Any) -> Iterator[None]:
        """``token_offset()`` is this rank's first position while the step runs."""
        ids = batch["input_ids"] if isinstance(batch, Mapping) else batch[0]
        token = _OFFSET.set(self.index * (ids.shape[1] // self.size))
        try:
            yield
        finally:
            _OFFSET.reset(token)


def split_step(step_fn: Callable[[torch.nn.Module, Any], Tuple[torch.Tensor, dict]],
               splitter: BatchSplitter) -> Callable[[torch.nn.Module, Any], Tuple[torch.Tensor, dict]]:
    """``step_fn`` on this rank's part of every batch, its loss scaled to its share of the group's."""
    def step(model: torch.nn.Module, batch: Any) -> Tuple[torch.Tensor, dict]:
        local, scale = splitter.split(batch)
        splitter.active = True
        try:
            with splitter.positioned(batch):
                loss, metrics = step_fn(model, local)
        finally:
            splitter.active = False
        return (loss if isinstance(scale, float) and scale == 1.0 else loss * scale), metrics

    step.supervised_loss_fn = getattr(step_fn, "supervised_loss_fn", None)
    step.splits_sequences = True
    return step
