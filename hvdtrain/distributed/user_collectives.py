"""Collectives for a loop of your own: your metrics gathered or reduced over every rank, a barrier, and
rank 0 going first. What Accelerate's ``gather``/``reduce``/``wait_for_everyone``/``main_process_first``
and Fabric's ``all_gather``/``all_reduce``/``barrier``/``rank_zero_first`` do, over Horovod (NCCL on
GPUs, MPI or Gloo on CPUs), on the tensors' own device.

Each call is a collective: every rank makes the same calls in the same order (as with any collective);
they are named by their place in that order, so that a rank that made another hvdtrain collective
first cannot pair with the wrong one.
"""
from __future__ import annotations

import contextlib
import itertools
from typing import Any, Callable, Iterator

import torch

import horovod.torch as hvd

REDUCTIONS = {"mean": hvd.Average, "sum": hvd.Sum, "max": hvd.Max, "min": hvd.Min}

_calls = itertools.count()


def _name(kind: str) -> str:
    return f"hvdtrain.user.{kind}.{next(_calls)}"


def _each_tensor(values: Any, apply: Callable[[torch.Tensor], torch.Tensor], what: str) -> Any:
    """``values`` with ``apply`` run on every tensor of a dict, list or tuple (nested), in order."""
    if isinstance(values, torch.Tensor):
        return apply(values)
    if isinstance(values, dict):
        return {key: _each_tensor(value, apply, what) for key, value in values.items()}
    if isinstance(values, (list, tuple)):
        return type(values)(_each_tensor(value, apply, what) for value in values)
    raise TypeError(f"{what} takes tensors (or dicts, lists and tuples of them), got {type(values).__name__}: "
                    f"make it a tensor first, e.g. torch.tensor(value, device=hv.device)")


def gather(values: Any) -> Any:
    """Every rank's tensors concatenated along the first dimension, in rank order, on every rank.

    Ranks may hold different numbers of rows (the last batch of an evaluation). A number (a 0-d tensor)
    becomes one row per rank. Dicts, lists and tuples of tensors are gathered tensor by tensor."""
    def one(tensor: torch.Tensor) -> torch.Tensor:
        rows = tensor.detach().reshape(1) if tensor.dim() == 0 else tensor.detach()
        return hvd.allgather(rows, name=_name("gather"))

    return _each_tensor(values, one, "gather()")


def reduce(values: Any, op: str = "mean") -> Any:
    """Every rank's tensors combined element by element, the same result on every rank: ``mean``
    (default), ``sum``, ``max`` or ``min``. Dicts, lists and tuples of tensors alike."""
    if op not in REDUCTIONS:
        raise ValueError(f"reduce(op={op!r}): choose one of {', '.join(REDUCTIONS)}")

    def one(tensor: torch.Tensor) -> torch.Tensor:
        # Horovod averages integers by floor division: a mean is taken in the tensor's float type.
        source = tensor.detach()
        if op == "mean" and not (source.is_floating_point() or source.is_complex()):
            source = source.double()
        return hvd.allreduce(source, op=REDUCTIONS[op], name=_name(f"reduce.{op}"))

    return _each_tensor(values, one, "reduce()")


def barrier() -> None:
    """Every rank waits here until all have arrived."""
    hvd.barrier()


@contextlib.contextmanager
def main_process_first(is_root: bool) -> Iterator[None]:
    """Rank 0 runs the block first, the other ranks after it has left it (one download or cache
    fill, then every rank reads the result). Every rank enters the block."""
    if not is_root:
        barrier()
    try:
        yield
    finally:
        if is_root:
            barrier()
