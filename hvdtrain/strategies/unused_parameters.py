"""Parameters that no rank's backward reached this step: stepped as one process steps them (not at all).

One process's torch optimizer skips a parameter whose ``.grad`` is None: no weight decay, no
momentum, its state untouched. Horovod fills zeros for a missing gradient, and the flat buckets of
zero1/zero2/fsdp hold zeros, so without this module such a parameter would decay and drift.

The ranks agree on which parameters were used with one all-reduce (sum) of a per-parameter flag,
every step, on every rank: no rank can know that another missed a gradient without asking, so the
collective always runs (never a hang from ranks deciding differently). Its cost: one tiny int32
all-reduce of P elements (P = the trained parameters), started before the gradients' last waits so
Horovod's cycle usually carries it alongside them. A parameter used by some ranks only keeps its
averaged gradient (the others' contribute zeros), as one process over the global batch has it.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Sequence, Tuple

import torch

import horovod.torch as hvd


class GradientUse:
    """Which of ``params`` received a gradient from this rank's backward since the last reset,
    recorded by post-accumulate-grad hooks (they fire however the gradient's storage is laid out)."""

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        self.params = list(params)
        self._used = bytearray(len(self.params))
        self.skipped_once = bytearray(len(self.params))  # skipped by some earlier step
        self.warned = False
        self._hooks = [param.register_post_accumulate_grad_hook(lambda _, index=index: self._mark(index))
                       for index, param in enumerate(self.params)]

    def _mark(self, index: int) -> None:
        self._used[index] = 1

    def used_here(self) -> List[bool]:
        return [bool(flag) for flag in self._used]

    def reset(self) -> None:
        self._used = bytearray(len(self.params))

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def start_agreement(used_here: Sequence[bool], name: str, device: torch.device, process_set: Any = None) -> Any:
    """Start the all-reduce that tells every rank how many ranks used each parameter (on the gradients'
    device: the same transport as they, NCCL on GPUs).

    Args:
        used_here: per parameter: this rank's backward produced its gradient.
        name: the all-reduce's name.
        device: the gradients' device.
        process_set: the data-parallel group's process set (None: every rank).
    """
    flags = torch.tensor([1 if used else 0 for used in used_here], dtype=torch.int32, device=device)
    if process_set is None:
        return hvd.allreduce_async(flags, op=hvd.Sum, name=name)
    return hvd.allreduce_async(flags, op=hvd.Sum, name=name, process_set=process_set)


def unused_everywhere(handle: Any) -> List[bool]:
    """Per parameter: True when no rank produced its gradient (the same answer on every rank)."""
    return [count == 0 for count in hvd.synchronize(handle).tolist()]


# Flat-bucket strategies step whole slices: an unused parameter's elements and their optimizer
# state are put back after the step, which equals skipping them.

Span = Tuple[Any, int, int]  # (bucket, start, stop) within the bucket's own slice


def own_spans(buckets: Sequence[Any], unused: Sequence[torch.nn.Parameter]) -> List[Span]:
    """Where the unused parameters' elements lie in this rank's slices of ``buckets``."""
    unused_ids = {id(param) for param in unused}
    spans = []
    for bucket in buckets:
        lo, hi = bucket.own_range
        for param, offset in zip(bucket.params, bucket.offsets):
            start, stop = max(lo, offset), min(hi, offset + param.numel())
            if id(param) in unused_ids and start < stop:
                spans.append((bucket, start - lo, stop - lo))
    return spans


@contextmanager
def unstepped(optimizer: torch.optim.Optimizer, spans: Sequence[Span]) -> Iterator[None]:
    """Run an optimizer step that leaves ``spans`` of the shards, and of their per-element state,
    as they were. State the step created (its first) is put back to zeros, torch's initial value for
    Adam's moments and for SGD's momentum of a zero gradient. The shard's scalar state (Adam's step)
    is shared by its whole slice and does advance."""
    saved = [(bucket, start, stop, _values(optimizer, bucket, start, stop)) for bucket, start, stop in spans]
    yield
    with torch.no_grad():
        for bucket, start, stop, (param, state) in saved:
            bucket.shard[start:stop].copy_(param)
            for key, value in optimizer.state.get(bucket.shard, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    before = state.get(key)
                    value[start:stop].copy_(before) if before is not None else value[start:stop].zero_()


def _values(optimizer: torch.optim.Optimizer, bucket: Any, start: int,
            stop: int) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    state = optimizer.state.get(bucket.shard, {})
    elementwise = {key: value[start:stop].clone() for key, value in state.items()
                   if isinstance(value, torch.Tensor) and value.dim() > 0}
    return bucket.shard.detach()[start:stop].clone(), elementwise


def step_skipping(optimizer: torch.optim.Optimizer, buckets: Sequence[Any], use: GradientUse,
                  handle: Any) -> None:
    """The flat-bucket step: ``optimizer.step()``, the parameters no rank used left unstepped.

    Args:
        optimizer: the optimizer over the flat slices.
        buckets: the flat buckets the parameters are views of.
        use: which parameters this rank's backward reached.
        handle: the agreement's all-reduce (start_agreement).
    """
    idle = unused_everywhere(handle)
    _say_when_a_skipped_parameter_trains_again(use, idle)
    unused = [param for param, skip in zip(use.params, idle) if skip]
    use.reset()
    with unstepped(optimizer, own_spans(buckets, unused)):
        optimizer.step()


def _say_when_a_skipped_parameter_trains_again(use: GradientUse, idle: Sequence[bool]) -> None:
    """The one difference from one process left: a flat slice shares one step count (Adam's bias
    correction), so a parameter skipped by earlier steps that trains now is corrected by the
    slice's count, where one process counts its own steps. Said once, never silent."""
    back = [index for index, skip in enumerate(idle) if not skip and use.skipped_once[index]]
    for index, skip in enumerate(idle):
        if skip:
            use.skipped_once[index] = 1
    if back and not use.warned:
        use.warned = True
        logging.getLogger("hvdtrain.strategies").warning(
            "%d parameter(s) that no rank used in an earlier step train again: zero and fsdp step each flat "
            "slice with one step count, so an optimizer that counts steps (Adam's bias correction) now differs "
            "from one process for them; ddp counts each parameter's own steps", len(back))
