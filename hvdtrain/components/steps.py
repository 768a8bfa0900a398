"""What one step computes: ``step_fn(model, batch) -> (loss, metrics)``, the batch's mean loss and a
dict of per-batch means, over a batch of any structure (tuples, dicts, nesting).

The loop moves the batch to the device, weights every value by the batch's size and sums across
ranks, so a reported metric is the mean over every rank's samples. ``supervised_step(loss_fn)``
serves ``(inputs, targets)`` batches, with accuracy for integer class targets.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from hvdtrain.components import token_mean

Metrics = Dict[str, Any]
StepFn = Callable[[torch.nn.Module, Any], Tuple[torch.Tensor, Metrics]]


def supervised_step(loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> StepFn:
    """The Trainer's step when given no step_fn. ``(inputs, targets)``: ``loss_fn(model(inputs),
    targets)`` and the accuracy. A dict batch with ``labels`` (a tokenized dataset's, as Hugging Face
    scripts batch): the model's own loss, ``model(**batch).loss``, unless ``loss_fn`` is one of
    your own (not the default cross-entropy): then ``loss_fn(model(**inputs), labels)``. A pipeline
    computes the same on its last stage (it reads ``supervised_loss_fn``)."""
    def step(model: torch.nn.Module, batch: Any) -> Tuple[torch.Tensor, Metrics]:
        if isinstance(batch, Mapping) and "labels" in batch:
            if loss_fn is F.cross_entropy:
                return model(**batch).loss, {}
            inputs = {key: value for key, value in batch.items() if key != "labels"}
            return loss_fn(model(**inputs), batch["labels"]), {}
        inputs, targets = batch
        outputs = model(inputs)
        accuracy = class_accuracy(outputs, targets)
        return loss_fn(outputs, targets), {} if accuracy is None else {"accuracy": accuracy}

    step.supervised_loss_fn = loss_fn
    step.count_items = functools.partial(supervised_items, loss_fn)
    return step


def supervised_items(loss_fn: Callable, model: torch.nn.Module) -> Callable[[Any], int]:
    """What supervised_step's loss averages over, batch by batch (hvdtrain.components.token_mean): a
    dict batch's labels as the model's own loss scores them (its label tokens), or as ``loss_fn``
    does; ``(inputs, targets)``: the targets ``loss_fn`` does not ignore. A loss of another kind is
    a mean over samples: its batch's samples."""
    own = token_mean.hf_counter(model) if loss_fn is F.cross_entropy else None
    targets = token_mean.targets_counter(loss_fn)

    def count(batch: Any) -> int:
        if isinstance(batch, Mapping) and "labels" in batch:
            if own is not None:
                return own(batch)
            if loss_fn is not F.cross_entropy and targets is not None:
                return targets(batch["labels"])
            return batch_size(batch)
        if targets is not None and isinstance(batch, (tuple, list)) and len(batch) == 2 \
                and isinstance(batch[1], torch.Tensor):
            return targets(batch[1])
        return batch_size(batch)

    return count


def class_accuracy(outputs: Any, targets: Any) -> Optional[torch.Tensor]:
    """The share of positions whose highest score is the target (float64, detached), when the outputs
    are class scores in the last dimension with one integer label per position: a classifier, or a
    language model's next-token prediction. None otherwise (a regression's targets are floats).
    What supervised_step reports, and a pipeline's last stage for it."""
    scores = getattr(outputs, "logits", outputs)  # a Hugging Face model returns an output object
    if (isinstance(scores, torch.Tensor) and isinstance(targets, torch.Tensor) and not targets.is_floating_point()
            and scores.dim() == targets.dim() + 1):
        return (scores.detach().argmax(dim=-1) == targets).double().mean()
    return None


def to_device(batch: Any, device: torch.device) -> Any:
    """The batch with every tensor in it moved to ``device`` (tuples, lists and dicts kept)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):  # a dict, or a mapping such as transformers' BatchEncoding
        moved = {key: to_device(value, device) for key, value in batch.items()}
        return moved if type(batch) is dict else type(batch)(moved)
    if isinstance(batch, (tuple, list)):
        moved = [to_device(item, device) for item in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    return batch


def batch_size(batch: Any) -> int:
    """The leading dimension of the first tensor in the batch: its number of samples."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (tuple, list)) else ()
    for value in values:
        try:
            return batch_size(value)
        except TypeError:
            continue
    raise TypeError(f"cannot tell the batch size of a {type(batch).__name__}: a batch must hold a tensor "
                    "whose first dimension counts its samples")
