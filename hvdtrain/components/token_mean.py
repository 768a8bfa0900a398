"""The step's loss as one process computes it: the mean over every item the loss scores in the whole
global batch (every micro-batch of the step, every data-parallel replica, every sequence part and
pipeline stage), not a mean of each replica's own mean.

With padding, prompts masked out or packed rows (labels -100), replicas hold different numbers of
scored tokens; averaging their means weighs a token on a rank with few of them more than one on a
rank with many, and N workers end somewhere other than one process on the same batch, silently.
So, before a step's first backward, every rank counts the items each of its micro-batches scores
(on the host, from the labels: no device waits), one all-reduce sums the counts over the world, and
each micro-batch's mean loss is weighted by ``its items x D / the global batch's items`` (D, the
replicas whose gradients the strategy averages): the average over D replicas of the summed weighted
gradients is then the gradient of the global batch's token mean. torchtitan and the Hugging Face
Trainer (``average_tokens_across_devices``) changed to it for the same reason.

What a loss scores, by the step: a Hugging Face model's own loss, by its ``loss_function``
(causal LMs score each position's next label, ``labels[..., 1:]``; masked LMs and token
classification every label), -100 never; a ``loss_fn`` of cross-entropy's kind with an ignore index
(``F.cross_entropy``, ``nn.CrossEntropyLoss``/``NLLLoss`` without class weights, a ``partial`` of
them) its integer targets other than the ignore index; ``packed_lm_step`` its rows' next labels.
Anything else (a regression, a step_fn of your own) is a mean over samples, weighed by each
micro-batch's sample count. A step_fn of your own says what its loss averages over by carrying
``count_items(model) -> (batch -> int)``.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Callable, List, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from hvdtrain.common.labels import IGNORE_INDEX, causal_items, label_items

ItemCounter = Callable[[Any], int]

# train.loss_mean's values.
TOKENS, REPLICA, AUTO = "tokens", "replica", "auto"


def hf_counter(model: nn.Module) -> Optional[ItemCounter]:
    """What a Hugging Face model's own loss averages over, for a dict batch with labels: its tokens
    for a causal or masked LM and token classification (the batch's ``shift_labels`` when it has
    them), None (a mean over samples) for any other loss."""
    loss_function = getattr(model, "loss_function", None)
    if loss_function is None:
        return None
    from transformers.loss.loss_utils import ForCausalLMLoss, ForMaskedLMLoss, ForTokenClassification

    if loss_function is ForCausalLMLoss:
        def causal(batch: Mapping) -> int:
            shifted = batch.get("shift_labels")
            return label_items(shifted) if shifted is not None else causal_items(batch["labels"])
        return causal
    if loss_function in (ForMaskedLMLoss, ForTokenClassification):
        return lambda batch: label_items(batch["labels"])
    return None


def ignore_index_of(loss_fn: Any) -> Optional[int]:
    """The ignore index of a cross-entropy-like mean loss (its mean is over the targets it does not
    ignore), or None when ``loss_fn`` is not one: another reduction, class weights (a weighted mean),
    label smoothing is fine (still one term per target)."""
    if loss_fn in (F.cross_entropy, F.nll_loss):
        return IGNORE_INDEX
    if isinstance(loss_fn, (nn.CrossEntropyLoss, nn.NLLLoss)):
        if loss_fn.reduction != "mean" or loss_fn.weight is not None:
            return None
        return loss_fn.ignore_index
    if isinstance(loss_fn, functools.partial) and loss_fn.func in (F.cross_entropy, F.nll_loss) and not loss_fn.args:
        keywords = loss_fn.keywords
        if keywords.get("reduction", "mean") != "mean" or keywords.get("weight") is not None:
            return None
        return keywords.get("ignore_index", IGNORE_INDEX)
    return None


def targets_counter(loss_fn: Any) -> Optional[Callable[[torch.Tensor], int]]:
    """Items of ``loss_fn(outputs, targets)``: its integer targets other than its ignore index
    (None: not a cross-entropy-like mean, so a mean over samples)."""
    ignore = ignore_index_of(loss_fn)
    if ignore is None:
        return None
    return lambda targets: label_items(targets, ignore) if not targets.is_floating_point() else targets.shape[0]


class GlobalItems:
    """The global batch's scored items, summed over the world by an all-reduce started when the step's
    micro-batches are read and waited for at the step's first backward, after its first forward:
    the exchange runs behind the forward instead of before it.

    Args:
        pending: gives the world's sum of the counts (waiting for the all-reduce the first time).
        replication: ranks holding each replica's batch: the world's sum counts every batch that many times.
    """

    def __init__(self, pending: Callable[[], torch.Tensor], replication: int) -> None:
        self._pending, self._replication = pending, replication
        self._total: Optional[int] = None

    @property
    def total(self) -> int:
        if self._total is None:
            self._total = int(self._pending()[0]) // self._replication
        return self._total


class LossWeight:
    """One micro-batch's loss weight, ``its items x D / the global batch's items``, known once the
    step's all-reduce is (``float(weight)``: the strategy reads it after the forward). A global batch
    that scores nothing weighs 0: no gradient, as a token mean over no token has none."""

    def __init__(self, items: int, data_width: int, total: GlobalItems) -> None:
        self.items, self.data_width, self._total = items, data_width, total

    def __float__(self) -> float:
        total = self._total.total
        return self.items * self.data_width / total if total else 0.0

    def __repr__(self) -> str:
        return f"LossWeight({self.items} x {self.data_width} / the global batch's items)"


Weight = Union[float, LossWeight]


class StepItems:
    """Per micro-batch, the items the step's loss averages over; once per step, the global batch's
    count (a collective) and each micro-batch's loss weight.

    Args:
        counter: items of one micro-batch (None: a mean over samples, counted by ``samples``).
        samples: the samples of a batch.
        mode: tokens (the global batch's token mean) or replica (each replica's mean, averaged).
        allreduce_sum_async: ``allreduce_sum_async(tensor, name)`` over the world, returning what gives
            the sum (hvdtrain.distributed.collectives').
    """

    def __init__(self, counter: Optional[ItemCounter], samples: Callable[[Any], int], mode: str,
                 allreduce_sum_async: Callable[..., Callable[[], torch.Tensor]]) -> None:
        self.counter, self.samples, self.mode, self._allreduce_sum_async = counter, samples, mode, allreduce_sum_async

    @property
    def counts_tokens(self) -> bool:
        """Whether the loss is weighted by counted items (else by samples: every replica's batch holds
        the same number of them, and each micro-batch weighs 1 / accumulation)."""
        return self.mode == TOKENS and self.counter is not None

    def items(self, batch: Any) -> int:
        """What this micro-batch's loss averages over (its samples for a mean over samples)."""
        return self.counter(batch) if self.counts_tokens else self.samples(batch)

    def weights(self, counts: List[int], accumulation: int, data_width: int, replication: int) -> List[Weight]:
        """Each micro-batch's loss weight for the step: ``1 / accumulation`` without token counting;
        else a LossWeight, ``count x D / the global batch's count``, whose all-reduce (a collective
        over the world, one per step) starts here.

        Args:
            counts: this rank's micro-batches' items, in the step's order.
            accumulation: micro-batches per step (train.accumulation).
            data_width: D, the replicas whose gradients the strategy averages.
            replication: ranks holding each replica's batch (tensor, pipeline and sequence groups):
                the world's sum counts every batch that many times.
        """
        if not self.counts_tokens:
            return [1.0 / accumulation if accumulation > 1 else 1.0] * len(counts)
        mine = torch.tensor([sum(counts)], dtype=torch.int64)
        total = GlobalItems(self._allreduce_sum_async(mine, name="train.scored_tokens"), replication)
        return [LossWeight(count, data_width, total) for count in counts]


def resolve_counter(step_fn: Any, model: nn.Module) -> Optional[ItemCounter]:
    """The step's item counter, resolved once: ``step_fn.count_items(model)`` where the step declares
    one (every step hvdtrain ships does), else None (a mean over samples)."""
    declare = getattr(step_fn, "count_items", None)
    return declare(model) if declare is not None else None
