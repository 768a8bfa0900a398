"""Set-up's proof that a sequence-parallel Hugging Face model computes the whole model's loss.

What the attention interface cannot see (a layer that mixes tokens outside attention: a
convolution, a token shift; a model whose loss ignores ``shift_labels``; positions it derives
itself) would train another model with no error. So once the strategy holds the model, every rank
runs a probe batch (a few sequences of the same random ids everywhere, in eval mode, no gradient)
whole, with the split switched off, and then split: the sequence group's mean loss must be the
whole model's and each rank's logits the whole model's at its positions, up to a different order
of additions. Every rank's verdict is gathered over the world before anyone raises, and every rank
raises the same error, naming the first rank that differs and its figures (a token mixer outside
attention may move only the ranks after the first: a causal convolution changes nothing on rank 0's
part). Two forwards of a few tokens, once.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional

import horovod.torch as hvd
import torch
from torch import nn

from hvdtrain.common.errors import LayoutError
from hvdtrain.distributed import collectives
from hvdtrain.parallel.sequence import hf
from hvdtrain.parallel.sequence.batches import BatchSplitter, split_step

TOKENS_PER_RANK = 4
# The relative distance a right split stays within, by dtype (as the tensor-parallel probe): float32
# steps inside transformers move float64 logits by ~1e-7; a lost token or head moves them by their size.
WITHIN = {torch.float64: 1e-5, torch.float32: 1e-3}
WITHIN_LOW_PRECISION = 1e-1


def _probe_batch(model: nn.Module, size: int, device: torch.device) -> Optional[dict]:
    vocabulary = getattr(model.config, "vocab_size", None)
    if not isinstance(vocabulary, int) or vocabulary < 2:
        return None
    generator = torch.Generator().manual_seed(0)  # the same ids on every rank
    ids = torch.randint(0, vocabulary, (2, TOKENS_PER_RANK * size), generator=generator).to(device)
    return {"input_ids": ids, "labels": ids.clone(), "use_cache": False}


def _forward(model: nn.Module, batch: dict):
    output = model(**batch)
    return output.loss.detach(), {"logits": output.logits.detach()}


def agreed_problem(problems: List[str]) -> str:
    """One verdict from every rank's (in rank order; '' where the split model is the whole one): the
    first rank that differs, in its own words, and the others that differ too ('' when none does)."""
    failing = [rank for rank, problem in enumerate(problems) if problem]
    if not failing:
        return ""
    first, others = failing[0], failing[1:]
    text = f"rank {first} of {len(problems)}: {problems[first]}"
    if others:
        text += f" (and {'rank' if len(others) == 1 else 'ranks'} {', '.join(map(str, others))} likewise)"
    return text


def prove(model: nn.Module, splitter: BatchSplitter, group: Any, forward_only: Callable[[Any, Any], Any],
          device: torch.device) -> None:
    """Raise LayoutError (on every rank alike) unless the split model's loss and logits are the whole one's.

    Args:
        model: the model as the strategy holds it, its attention prepared by hf.install.
        splitter: the batch splitter of its sequence group.
        group: the sequence group (``size``, ``index``, ``process_set``).
        forward_only: the strategy's ``forward_only(step_fn, batch)`` (a sharded model gathers in it).
        device: this rank's device.
    """
    state = hf._STATES.get(id(getattr(model, "config", None)))
    batch = _probe_batch(model, group.size, device) if state is not None else None
    if batch is None:
        return
    problem = ""
    training = model.training
    model.eval()
    try:
        with torch.no_grad():  # outside a split step the model attends whole (hf.py)
            whole_loss, whole = forward_only(_forward, batch)
            split_loss, split = forward_only(split_step(_forward, splitter), batch)
        kwargs = {} if group.process_set is None else {"process_set": group.process_set}
        mean = hvd.allreduce(split_loss.double().reshape(1), op=hvd.Average, name="sequence.probe.loss", **kwargs)
        width = whole["logits"].shape[1] // group.size
        mine = whole["logits"][:, group.index * width:(group.index + 1) * width].double()
        within = WITHIN.get(whole["logits"].dtype, WITHIN_LOW_PRECISION)
        logits_off = ((split["logits"].double() - mine).norm() / mine.norm().clamp_min(1e-300)).item()
        loss_off = abs(mean.item() - whole_loss.double().item()) / max(abs(whole_loss.double().item()), 1e-300)
        if not (logits_off <= within and loss_off <= within):
            problem = (f"on a probe of {batch['input_ids'].shape[1]} tokens per sequence, split over {group.size} ranks, "
                       f"the logits are {logits_off:.3g} and the loss {loss_off:.3g} away from the whole model's "
                       f"(relative; a right split stays within {within:g}): {type(model).__name__} mixes tokens "
                       f"outside its attention, derives its own positions, or computes its loss otherwise")
    except LayoutError as error:
        problem = str(error)
    except Exception as error:  # noqa: BLE001  (agreed below: no rank left in a collective alone)
        problem = f"its forward failed on a probe when split: {type(error).__name__}: {error}"
    finally:
        model.train(training)
    agreed = agreed_problem(collectives.allgather_object(problem, name="sequence.probe.verdict"))
    if agreed:
        raise LayoutError(f"train.sequence_parallel={group.size} would train another model than one process (found "
                          f"at set-up): {agreed}")
