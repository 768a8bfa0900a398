"""A Hugging Face dict batch (``input_ids``, ``labels``, ``attention_mask``) on a pipeline's last
stage: the model's own loss, and a ``step_fn`` written for the whole model.

The loss is the model's ``loss_function`` (transformers' shift, ``ignore_index`` -100) with
``num_items_in_batch``, the count of label tokens in the rank's whole batch: each micro-batch's loss
is its share of the batch's token mean, and their sum is what ``model(**batch).loss`` gives for the
whole batch in one process. (Across data-parallel replicas and accumulated batches the loop weighs
each batch's loss by its label tokens' share of the global batch's: hvdtrain.components.token_mean.)

A ``step_fn(model, batch)`` cannot have the whole model on a stage. The one shape that runs is the
one every layout runs: call ``model(**batch)`` once and return its ``.loss`` (with metrics computed
from the output and the batch, if any). On the last stage it is called for each micro-batch with a
stand-in model whose call gives the output the stage computed (``logits``; ``loss`` from the
model's loss_function when labels are passed). Anything else (reading the model's parameters or
attributes, calling it twice or with other inputs, returning another loss) is refused with what it
did. It is decided on every rank before any exchange: every rank first runs the step_fn against
a stand-in that gives zeros (the ranks of a pipeline read the same batch, so all decide alike), and
that run also names the metrics, which then travel from the last stage with the loss.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from hvdtrain.common.errors import HvdtrainError
from hvdtrain.common.labels import causal_targets
from hvdtrain.parallel.pipeline.schedule import Measure

# What the stages give the model: the first stage's ids, every stage's mask, the last stage's labels.
READ_KEYS = ("input_ids", "attention_mask", "labels")


def dict_micro_batches(batch: Mapping, count: int) -> List[Tuple[torch.Tensor, Dict[str, Any], Optional[Dict]]]:
    """(input_ids, the micro-batch as a dict, {"attention_mask": ...} or None) for each of ``count``
    equal micro-batches of a dict batch; TypeError naming what such a batch lacks or holds beyond
    what the stages pass to the model."""
    from hvdtrain.parallel.pipeline.schedule import split_micro_batches

    missing = [key for key in ("input_ids", "labels") if key not in batch]
    if missing:
        raise TypeError(f"a pipeline's dict batch needs input_ids (for the first stage) and labels (for the "
                        f"last stage's loss); this one has no {', '.join(missing)} (it has {', '.join(batch)})")
    other = [key for key in batch if key not in READ_KEYS]
    if other:
        raise TypeError(f"a pipeline gives the model input_ids, attention_mask and labels of a dict batch; this one "
                        f"also holds {', '.join(other)}, which no stage would pass to the model: leave it out of "
                        f"the batch (or train without a pipeline)")
    keys = [key for key in READ_KEYS if batch.get(key) is not None]
    pieces = split_micro_batches([batch[key] for key in keys], count)
    micro = []
    for piece in pieces:
        named = dict(zip(keys, piece))
        mask = named.get("attention_mask")
        micro.append((named["input_ids"], named, None if mask is None else {"attention_mask": mask}))
    return micro


class ModelLoss:
    """The model's own loss of a micro-batch's logits, as its share of the whole batch's token mean."""

    def __init__(self, model: nn.Module, batch_labels: torch.Tensor) -> None:
        loss_function = getattr(model, "loss_function", None)
        if loss_function is None:
            raise TypeError(f"a dict batch's loss under a pipeline is the model's own loss_function (a Hugging Face "
                            f"model's); {type(model).__name__} has none: pass loss_fn(outputs, labels)")
        self.loss_function = loss_function
        self.vocab_size = model.config.get_text_config().vocab_size
        self.items = causal_targets(batch_labels)

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss_function(logits, labels, vocab_size=self.vocab_size, num_items_in_batch=self.items)


class StepFnRefused(HvdtrainError, ValueError):
    """A step_fn that does with the model more than a pipeline stage can answer."""


class _StageModel:
    """What a step_fn sees of the model on a pipeline stage: one call with the micro-batch's
    tensors, answered by ``answer(kwargs)``; anything else is refused by name."""

    def __init__(self, micro: Dict[str, Any], answer: Callable[[Dict[str, Any]], Any]) -> None:
        self.__dict__.update(_micro=micro, _answer=answer, _calls=0, output=None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.__dict__["_calls"] += 1
        if self._calls > 1:
            raise StepFnRefused(f"a step_fn under a pipeline calls the model once; this one called it {self._calls} "
                                f"times")
        if args:
            raise StepFnRefused(f"a step_fn under a pipeline calls model(**batch); this one passed {len(args)} "
                                f"positional argument(s)")
        other = sorted(key for key, value in kwargs.items() if self._micro.get(key) is not value)
        if other:
            raise StepFnRefused(f"a step_fn under a pipeline calls model(**batch) with the batch's own tensors; this "
                                f"one passed other inputs as {', '.join(other)}")
        self.__dict__["output"] = self._answer(kwargs)
        return self.output

    def __getattr__(self, name: str) -> Any:
        raise StepFnRefused(f"a step_fn under a pipeline can only call model(**batch) (a stage holds a part of the "
                            f"model); this one read model.{name}")

    def __setattr__(self, name: str, value: Any) -> None:
        raise StepFnRefused(f"a step_fn under a pipeline can only call model(**batch); this one set model.{name}")


def _output(logits: torch.Tensor, loss: Optional[torch.Tensor]) -> Any:
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return CausalLMOutputWithPast(loss=loss, logits=logits)


def _scalar(name: str, value: Any) -> torch.Tensor:
    value = torch.as_tensor(value.detach() if isinstance(value, torch.Tensor) else value)
    if value.numel() != 1:
        raise StepFnRefused(f"a step_fn's metric {name!r} has {value.numel()} values: a pipeline reports one "
                            f"number per metric (the batch's mean)")
    return value.reshape(()).double()


class StageStep:
    """A user's step_fn over one batch's micro-batches on the last stage: its loss (the output's
    ``.loss``) and its metrics (a Measure, named by a dry run every rank makes)."""

    def __init__(self, step_fn: Callable, loss: ModelLoss, micro_batches: List[Dict[str, Any]], vocab_size: int,
                 dtype: torch.dtype) -> None:
        """The dry run, on every rank before any exchange: the step_fn on each micro-batch against a
        model answering zeros (no memory: an expanded scalar), so that a misuse is refused alike
        everywhere and the metrics' names are known to every stage.

        Args:
            step_fn: the user's step function.
            loss: the model's own loss, as a micro-batch's share of the batch's token mean.
            micro_batches: the batch's micro-batches.
            vocab_size: the logits' last dimension, for the dry run's zeros.
            dtype: the logits' dtype, for the dry run's zeros.
        """
        self.step_fn, self.loss = step_fn, loss
        self.values: Optional[torch.Tensor] = None
        seen = set()
        for micro in micro_batches:
            ids = micro["input_ids"]
            zero = torch.zeros((), dtype=dtype, device=ids.device)
            logits = zero.expand(*ids.shape, vocab_size)
            seen.add(tuple(self._run(micro, lambda kwargs: _output(logits, zero if "labels" in kwargs else None))[1]))
        if len(seen) > 1:
            raise StepFnRefused(f"the step_fn's metrics differ between micro-batches ({sorted(seen)}): a pipeline "
                                f"reports the same names for every one")
        self.measure = Measure(seen.pop(), self._measured)

    def _run(self, micro: Dict[str, Any], answer: Callable[[Dict[str, Any]], Any]
             ) -> Tuple[torch.Tensor, List[str]]:
        model = _StageModel(micro, answer)
        result = self.step_fn(model, micro)
        loss, metrics = result
        output = model.__dict__["output"]
        if output is None:
            raise StepFnRefused("a step_fn under a pipeline returns model(**batch).loss; this one never called the model")
        if loss is None or loss is not output.loss:
            raise StepFnRefused("a step_fn under a pipeline returns the .loss of model(**batch) (the last stage computes "
                                "it, each micro-batch's share of the batch's); this one returned another value"
                                + ("" if "labels" in micro else " (the batch has no labels)"))
        names = sorted(metrics)
        self.values = torch.stack([_scalar(name, metrics[name]) for name in names]) if names else \
            torch.zeros(0, dtype=torch.float64)
        return loss, names

    def __call__(self, logits: torch.Tensor, micro: Dict[str, Any]) -> torch.Tensor:
        """The micro-batch's loss as the step_fn returns it, the stage's logits its model's output."""
        def answer(kwargs: Dict[str, Any]) -> Any:
            labels = kwargs.get("labels")
            return _output(logits, None if labels is None else self.loss(logits, labels))
        loss, names = self._run(micro, answer)
        # The dry run gave every stage these names from the same micro-batches; a step_fn whose
        # names depend on the values computed is the one case found here, on the last stage alone.
        if tuple(names) != self.measure.names:
            raise StepFnRefused(f"the step_fn's metrics were {', '.join(self.measure.names) or 'none'} in the dry run "
                                f"and {', '.join(names) or 'none'} on the stage's output: a pipeline reports the "
                                f"names every stage knows before the step")
        return loss

    def _measured(self, logits: torch.Tensor, micro: Dict[str, Any]) -> torch.Tensor:
        """The metrics of the step_fn call that just gave this micro-batch's loss."""
        return self.values.to(logits.device)
