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
# While a split step runs on a Hugging Face model: the whole rows' position ids when they pack several
# documents (transformers builds the block-causal mask from them), (None,) when they do not; unset
# outside a split step. Read by hf.py's mask builders, which see only this rank's part of them.
_WHOLE_POSITIONS: contextvars.ContextVar[Optional[Tuple[Optional[torch.Tensor]]]] = contextvars.ContextVar(
    "hvdtrain_sequence_whole_positions", default=None)


def whole_positions() -> Optional[Tuple[Optional[torch.Tensor]]]:
    """Inside a split step: (the whole rows' packed position ids, or None for unpacked rows); None outside."""
    return _WHOLE_POSITIONS.get()


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
        # Set by hf.install: the model builds its attention mask through transformers' mask functions,
        # which hvdtrain gives the whole rows' positions, so packed rows keep their documents apart.
        self.packs_documents = False
        self.packed_positions: Optional[torch.Tensor] = None  # the current batch's, when packed

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
        self.packed_positions = None
        if positions is not None and not torch.equal(positions.expand(batch_size, length), whole):
            if not self.packs_documents:
                raise LayoutError("train.sequence_parallel takes position_ids other than 0..T-1 (packed rows) for a "
                                  "Hugging Face model only, whose attention mask hvdtrain builds from the whole rows' "
                                  "positions; a model of your own builds its mask from its part of them: train its "
                                  "packed rows without sequence parallelism")
            # As transformers does: with an attention_mask given, positions do not separate documents.
            if batch.get("attention_mask") is None:
                self.packed_positions = positions.expand(batch_size, length)
            whole = positions.expand(batch_size, length)
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
        """``token_offset()`` is this rank's first position while the step runs; ``whole_positions()``
        the whole rows' packed positions (a Hugging Face model's)."""
        ids = batch["input_ids"] if isinstance(batch, Mapping) else batch[0]
        token = _OFFSET.set(self.index * (ids.shape[1] // self.size))
        whole = _WHOLE_POSITIONS.set((self.packed_positions,)) if self.packs_documents else None
        try:
            yield
        finally:
            if whole is not None:
                _WHOLE_POSITIONS.reset(whole)
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
    # What the whole batch's loss scores, counted on the whole batch before the split (token_mean).
    step.count_items = getattr(step_fn, "count_items", None)
    step.splits_sequences = True
    return step
