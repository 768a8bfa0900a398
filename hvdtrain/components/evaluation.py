"""Evaluation: the step's loss and metrics over the whole validation set, every rank's shard."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Dict, Optional

import torch

from hvdtrain.distributed import collectives
from hvdtrain.components.metrics import RunningMeans
from hvdtrain.components.steps import StepFn, batch_size, to_device


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader, step: StepFn, device: torch.device,
             autocast: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
             after_batch: Callable[[], None] = lambda: None, lockstep: bool = False,
             counts_samples: bool = True, items: Optional[Callable[[Any], int]] = None) -> Dict[str, float]:
    """The step's loss and metrics over the whole validation set, as ``val_<name>`` (every rank's
    shard, weighted by samples, the loss by ``items`` when given: a token mean; a collective), and
    ``val_samples``.

    Args:
        model: the model, put in eval mode for the pass.
        loader: this rank's validation shard.
        step: ``step(model, batch) -> (loss, metrics)``.
        device: where batches go.
        autocast: the forward's precision context.
        after_batch: called after each batch (the stall watchdog's beat).
        lockstep: the model's forward is itself a collective (fsdp), so every rank runs as many forwards as the rank
            with the most batches; a rank with fewer repeats its last batch and does not count it (validation shards are
            not padded: each sample counts once).
        counts_samples: False on the ranks of a model replica that do not report for it (they hold the same loss as the
            one that does).
        items: the items a batch's loss averages over (token_mean: its scored tokens), counted before it
            goes to the device; None: the loss is weighed by samples.
    """
    model.eval()
    means = RunningMeans(device)
    extra = 0
    if lockstep:
        try:
            own_batches = len(loader)
        except TypeError:  # a stream without len(): this rank's batches, read first to count them
            loader = list(loader)
            own_batches = len(loader)
        counts = collectives.allgather_object(own_batches, name="val.batches")  # every rank decides alike
        if min(counts) == 0:
            raise ValueError(f"validation batches per rank {counts}: with a sharded model every rank "
                             f"needs at least one; use fewer workers or a larger validation set")
        extra = max(counts) - own_batches
    batch = None
    for batch in loader:
        scored = None if items is None or not counts_samples else items(batch)
        batch = to_device(batch, device)
        with autocast():
            loss, metrics = step(model, batch)
        means.add(loss, metrics, batch_size(batch) if counts_samples else 0, loss_weight=scored)
        after_batch()
    for _ in range(extra):  # lockstep: the last batch again, not counted
        with autocast():
            step(model, batch)
    totals = means.reduce("val.metrics", agree_on_names=True)
    if totals.count == 0:
        raise ValueError("the validation set is empty on every rank")
    return {**{f"val_{name}": value for name, value in totals.means().items()}, "val_samples": totals.count}
