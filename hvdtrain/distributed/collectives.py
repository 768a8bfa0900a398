"""Collectives hvdtrain needs beyond Horovod's own: rank 0's state of any structure to every rank
(tensors as tensors, the rest pickled once), small sums and gathers, waiting on handles, the
timeline, and which operations Horovod runs. Every function here is a collective unless it says not:
every rank calls it, in the same order.
"""
from __future__ import annotations

import time
from typing import Any, Callable, List, Tuple

import torch

import horovod.torch as hvd


def _split_tensors(obj: Any, tensors: List[torch.Tensor]) -> Any:
    """Replace every tensor in a nested structure by a placeholder (its index, shape, dtype)."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        # The device type travels too: a receiver allocates on its own device of that type
        # (a GPU state broadcast over NCCL must arrive on each rank's GPU, a CPU one on the CPU).
        return ("__tensor__", len(tensors) - 1, tuple(obj.shape), obj.dtype, obj.device.type)
    if isinstance(obj, dict):
        return {k: _split_tensors(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_split_tensors(v, tensors) for v in obj)
    return obj


def _is_placeholder(obj: Any) -> bool:
    return isinstance(obj, tuple) and len(obj) == 5 and obj[0] == "__tensor__"


def _fill_tensors(obj: Any, tensors: List[torch.Tensor]) -> Any:
    if _is_placeholder(obj):
        return tensors[obj[1]]
    if isinstance(obj, dict):
        return {k: _fill_tensors(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_fill_tensors(v, tensors) for v in obj)
    return obj


def _placeholders(obj: Any) -> List[Tuple[int, Tuple[int, ...], torch.dtype, str]]:
    found: List[Tuple[int, Tuple[int, ...], torch.dtype, str]] = []

    def walk(o: Any) -> None:
        if _is_placeholder(o):
            found.append(o[1:])
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)

    walk(obj)
    return sorted(found, key=lambda p: p[0])


def _local_device(kind: str) -> torch.device:
    """This rank's device of the given type: its own GPU for "cuda" (pinned by init)."""
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


def broadcast_state(state: Any, root_rank: int = 0, name: str = "state") -> Any:
    """Return rank ``root_rank``'s copy of a nested structure of tensors and plain values.

    The structure travels once as a small pickled skeleton; the tensors travel as tensors
    (no pickling), so this scales to optimizer states of large models. Other ranks'
    structures may differ entirely (a fresh optimizer with no state, say): they are replaced.
    """
    tensors: List[torch.Tensor] = []
    skeleton = _split_tensors(state, tensors)
    skeleton = hvd.broadcast_object(skeleton, root_rank=root_rank, name=f"{name}.skeleton")
    if hvd.rank() == root_rank:
        received = [t.detach().contiguous() for t in tensors]
    else:
        received = [torch.empty(shape, dtype=dtype, device=_local_device(kind))
                    for _, shape, dtype, kind in _placeholders(skeleton)]
    handles = [
        hvd.broadcast_async_(t, root_rank=root_rank, name=f"{name}.{i}")
        for i, t in enumerate(received)
    ]
    for handle in handles:
        hvd.synchronize(handle)
    return _fill_tensors(skeleton, received)


def broadcast_model_and_optimizer(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, root_rank: int = 0
) -> None:
    """Make every rank start from rank 0's parameters, buffers and optimizer state."""
    # In place, so the tensors the optimizer holds stay the model's tensors.
    hvd.broadcast_parameters(model.state_dict(), root_rank=root_rank)
    optimizer.load_state_dict(
        broadcast_state(optimizer.state_dict(), root_rank=root_rank, name="optimizer")
    )


def allreduce_sum(values: torch.Tensor, name: str) -> torch.Tensor:
    """Sum a small tensor of statistics over all ranks (one collective, every rank must call it)."""
    return hvd.allreduce(values, op=hvd.Sum, name=name)


def allreduce_sum_async(values: torch.Tensor, name: str) -> Callable[[], torch.Tensor]:
    """Start summing a small tensor over all ranks (every rank must call it); returns what waits for
    and gives the sum, so that the exchange runs behind the caller's next work."""
    handle = hvd.allreduce_async(values, op=hvd.Sum, name=name)
    return lambda: hvd.synchronize(handle)


def allgather_rows(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """Stack one row per rank: rank r's tensor (flattened) becomes row r."""
    return hvd.allgather(tensor.detach().reshape(1, -1), name=name)


def allgather_object(obj: Any, name: str) -> List[Any]:
    """Every rank's ``obj``, in rank order (pickled: for small values, not for tensors)."""
    return hvd.allgather_object(obj, name=name)


def mpi_enabled() -> bool:
    """Whether Horovod runs its MPI operations (its MPI controller, or MPI for CPU collectives)."""
    return bool(hvd.mpi_enabled())


def nccl_built() -> bool:
    return bool(hvd.nccl_built())


def homogeneous() -> bool:
    """Whether every host runs the same number of ranks."""
    from horovod.torch.mpi_ops import is_homogeneous  # not re-exported by horovod.torch

    return bool(is_homogeneous())


def wait(handles: List[Any], interval: float = 1e-4) -> None:
    """Block until the collectives behind Horovod ``handles`` have completed, leaving their results
    for hvd.synchronize to collect (hvd.poll, which does not consume a handle)."""
    for handle in handles:
        while handle is not None and not hvd.poll(handle):
            time.sleep(interval)


def barrier() -> None:
    hvd.barrier()


def broadcast_object(obj: Any, root_rank: int, name: str) -> Any:
    """Rank ``root_rank``'s small picklable ``obj`` on every rank."""
    return hvd.broadcast_object(obj, root_rank=root_rank, name=name)


def start_timeline(path: str) -> None:
    """Record Horovod's timeline (Chrome trace format, written by rank 0) from now on; every rank calls it."""
    hvd.start_timeline(path, mark_cycles=False)


def stop_timeline() -> None:
    hvd.stop_timeline()
