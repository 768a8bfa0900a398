"""Every Horovod operation of this process into the flight recorder, from one place.

hvdtrain starts collectives from many places (collectives.py, the strategies' gradient
reductions, Horovod's DistributedOptimizer hooks, tensor and pipeline parallelism), and all of
them go through the same few functions of ``horovod.torch.mpi_ops``: one private ``_<op>_async``
per operation that enqueues it and returns a handle, ``barrier``/``join``, and the extension's
``horovod_torch_wait_and_clear``, which every ``synchronize`` waits in. Those are wrapped here
(module globals, looked up at each call: wrapping them catches every caller, the public
functions, hvd.broadcast_object and the optimizer's hooks included). A start costs one entry
(hvdtrain.common.flight.recorder); the end is found by handle. A wait that raises (a rank died,
Horovod shut down: what Horovod elastic recovers from) ends its entry as failed, so the record
never shows it in flight after.

Installed once per process, by the Trainer's set-up on every rank at the same point of the
program (the sequence numbers count from there). Reads Horovod internals: a Horovod without these
names is left alone (the record then holds no collective, and says so).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional

from hvdtrain.common.flight.recorder import RECORDER, FlightRecorder

# mpi_ops function -> (operation, where its tensor(s) and name are among the arguments)
_ASYNC = {
    "_allreduce_async": ("allreduce", 0, 2, 6),  # (tensor, output, name, op, pre, post, process_set)
    "_grouped_allreduce_async": ("grouped_allreduce", 0, 2, 6),
    "_allgather_async": ("allgather", 0, 2, 3),  # (tensor, output, name, process_set)
    "_grouped_allgather_async": ("grouped_allgather", 0, 2, 3),
    "_broadcast_async": ("broadcast", 0, 3, 4),  # (tensor, output, root_rank, name, process_set)
    "_alltoall_async": ("alltoall", 0, 4, 5),  # (tensor, splits, output, received, name, process_set)
    "_reducescatter_async": ("reducescatter", 0, 2, 4),  # (tensor, output, name, op, process_set, ...)
    "_grouped_reducescatter_async": ("grouped_reducescatter", 0, 2, 4),
}
_installed: Dict[str, Any] = {}  # what was wrapped: name -> the original


def installed() -> bool:
    return bool(_installed)


def install(recorder: FlightRecorder = RECORDER) -> List[str]:
    """Wrap Horovod's operations (once per process; again: nothing). Returns the names it could not
    find in this Horovod (then those operations are not recorded)."""
    from horovod.torch import mpi_ops

    if _installed:
        return []
    in_flight = recorder.waiting  # handle -> entry, until synchronize waited for it
    missing = []
    for function, (op, tensors, name, process_set) in _ASYNC.items():
        original = getattr(mpi_ops, function, None)
        if original is None:
            missing.append(function)
            continue
        wrapper = _recording(original, recorder, in_flight, op, tensors, name, process_set)
        _installed[function] = original
        setattr(mpi_ops, function, wrapper)
    wait = getattr(mpi_ops.mpi_lib, "horovod_torch_wait_and_clear", None)
    if wait is None:
        missing.append("mpi_lib.horovod_torch_wait_and_clear")
    else:
        _installed["mpi_lib.horovod_torch_wait_and_clear"] = wait
        setattr(mpi_ops.mpi_lib, "horovod_torch_wait_and_clear", _ending(wait, recorder, in_flight))
    import horovod.torch as hvd

    for function in ("barrier", "join"):  # called by their names in horovod.torch too (hvd.barrier)
        original = _installed[function] = getattr(mpi_ops, function)
        setattr(mpi_ops, function, _blocking(original, recorder, function))
        if getattr(hvd, function, None) is original:
            _installed[f"hvd.{function}"] = original
            setattr(hvd, function, getattr(mpi_ops, function))
    return missing


def uninstall() -> None:
    """Horovod's own functions back (the tests)."""
    import horovod.torch as hvd
    from horovod.torch import mpi_ops

    for function, original in _installed.items():
        where, _, name = function.rpartition(".")
        setattr({"mpi_lib": mpi_ops.mpi_lib, "hvd": hvd, "": mpi_ops}[where], name, original)
    _installed.clear()


def _recording(original: Callable, recorder: FlightRecorder, in_flight: Dict[Any, list], op: str,
               tensors: int, name: int, process_set: int) -> Callable:
    """``original`` (an mpi_ops ``_<op>_async``) that records its operation as it starts.

    Args:
        original: the wrapped function.
        recorder: where the entries go.
        in_flight: handle -> entry, which the wait completes.
        op: the operation's name in the record.
        tensors: the position of its tensor (a grouped operation: its list of tensors).
        name: the position of its name.
        process_set: the position of its process set.
    """
    grouped = op.startswith("grouped_")

    @functools.wraps(original)
    def record(*args: Any) -> Any:
        if not recorder.capacity:
            return original(*args)
        given = args[tensors]
        shape = [t.shape for t in given] if grouped else given.shape
        dtype = given[0].dtype if grouped and given else getattr(given, "dtype", None)
        members = args[process_set] if len(args) > process_set else None
        key = getattr(members, "process_set_id", 0) if members is not None else 0
        if key not in recorder.process_sets:
            recorder.process_sets[key] = members
        entry = recorder.start(op, args[name], shape, dtype, key)
        try:
            handle = original(*args)
        except BaseException as error:  # not enqueued (Horovod shut down): no wait will end it
            recorder.fail(entry, error)
            raise
        in_flight[handle] = entry
        return handle
    return record


def _ending(wait: Callable, recorder: FlightRecorder, in_flight: Dict[Any, list]) -> Callable:
    """The extension's wait, which completes the entry of the handle it waited for, or fails it."""
    def wait_and_clear(handle: Any) -> Any:
        entry = in_flight.pop(handle, None)
        try:
            result = wait(handle)
        except BaseException as error:
            if entry is not None:
                recorder.fail(entry, error)
            raise
        if entry is not None:
            recorder.end(entry)
        return result
    return wait_and_clear


def _blocking(original: Callable, recorder: FlightRecorder, op: str) -> Callable:
    """``barrier`` or ``join``: one entry around the call."""
    @functools.wraps(original)
    def record(*args: Any, **kwargs: Any) -> Any:
        if not recorder.capacity:
            return original(*args, **kwargs)
        members = kwargs.get("process_set", args[0] if args and op == "barrier" else None)
        key = getattr(members, "process_set_id", 0) if members is not None else 0
        entry = recorder.start(op, None, None, None, key)
        try:
            result = original(*args, **kwargs)
        except BaseException as error:
            recorder.fail(entry, error)
            raise
        recorder.end(entry)
        return result
    return record


def describe_process_set(key: Any) -> Optional[List[int]]:
    """The ranks of the process set ``key`` (None: the global one, every rank)."""
    members = RECORDER.process_sets.get(key)
    ranks = getattr(members, "ranks", None)
    return None if key == 0 or ranks is None else [int(r) for r in ranks]
