"""One job of ``hvdtrain bench collectives``: every back-end's collectives, interleaved, in one process.

Run by ``collectives.py`` through ``jobs.run_job`` as ``python -m hvdtrain.bench.collectives.worker``:

- ``--mode mpi`` under mpirun: raw MPI (mpi4py on numpy), Horovod with MPI operations,
  torch.distributed gloo and a local memory copy;
- ``--mode gloo`` under ``horovodrun --gloo``: Horovod with Gloo operations, torch.distributed
  gloo and the memory copy. Horovod 0.28.1 cannot run Gloo operations under its MPI controller:
  with ``HOROVOD_CPU_OPERATIONS=gloo`` under mpirun the first Gloo collective dereferences the
  process set's Gloo context, which only the Gloo controller creates (segfault in
  ``GlooAlgorithms<float>::Allreduce`` or ``::Broadcast``). A horovodrun --gloo job has no
  MPI world, so no raw MPI there;
- ``--mode mpi_alone`` under mpirun: raw MPI only, in processes without Horovod, whose background
  thread otherwise shares the cores and the MPI library with the raw MPI calls.

What one figure is: after a warm-up and a barrier, each rank times ``iters`` back-to-back calls of
one collective on fp32 buffers; the figure is the slowest rank's mean time per call. Every
back-end is checked for the right answer once per op and size before it is timed.
"""
from __future__ import annotations

import argparse
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from hvdtrain.common.units import MiB

OPS = ("allreduce", "broadcast", "allgather")
BACKENDS = {"mpi": ("mpi", "horovod_mpi", "torch_gloo", "memcpy"),
            "gloo": ("horovod_gloo", "torch_gloo", "memcpy"),
            "mpi_alone": ("mpi_alone",)}
# The calls each back-end makes, stored beside the figures (in place wherever the API allows it).
CALLS = {
    "mpi": {"allreduce": "Allreduce(IN_PLACE, buf, SUM)", "broadcast": "Bcast(buf, root=0)",
            "allgather": "Allgather(send, recv) into a preallocated recv"},
    "horovod": {"allreduce": "synchronize(allreduce_async_(t, op=Sum)) in place",
                "broadcast": "synchronize(broadcast_async_(t, root_rank=0)) in place",
                "allgather": "synchronize(allgather_async(t)): out of place, a new output per call "
                             "(Horovod has no in-place allgather)"},
    "torch_gloo": {"allreduce": "all_reduce(t) in place", "broadcast": "broadcast(t, src=0) in place",
                   "allgather": "all_gather_single (all_gather_into_tensor) into a preallocated recv"},
    "memcpy": "np.copyto(dst, src) of the same bytes on rank 0, preallocated",
}
Call = Callable[[], Optional[np.ndarray]]  # runs one collective, returns its output (None: not checked)


class MpiCoordinator:
    """Barrier, max and broadcast over mpi4py's COMM_WORLD: precise start lines for mpirun jobs."""

    def __init__(self) -> None:
        from mpi4py import MPI

        self.mpi = MPI
        self.comm = MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()

    def barrier(self) -> None:
        self.comm.Barrier()

    def max(self, value: float) -> float:
        return self.comm.allreduce(value, op=self.mpi.MAX)

    def bcast(self, obj: Any) -> Any:
        return self.comm.bcast(obj, root=0)


class HorovodCoordinator:
    """The same through Horovod, for horovodrun --gloo jobs, which have no MPI world."""

    def __init__(self, dist: Any, rank: int, size: int) -> None:
        self._dist = dist
        self.rank, self.size = rank, size

    def barrier(self) -> None:
        self._dist.barrier()

    def max(self, value: float) -> float:
        return max(self._dist.allgather_object(value, name="bench.max"))

    def bcast(self, obj: Any) -> Any:
        return self._dist.broadcast_object(obj, root_rank=0, name="bench.bcast")


@dataclass
class Runtime:
    """What the back-ends of one mode need; None where the mode does not use it."""

    coordinator: Any
    mpi: Any = None  # mpi4py's MPI module
    hvd: Any = None  # horovod.torch
    tdist: Any = None  # torch.distributed, initialised on gloo


def start(mode: str) -> Runtime:
    if mode == "mpi_alone":  # no torch, no Horovod: nothing but MPI in these processes
        coordinator = MpiCoordinator()
        return Runtime(coordinator, mpi=coordinator.mpi)
    hvd, coordinator = start_horovod(mode)
    return Runtime(coordinator, mpi=getattr(coordinator, "mpi", None), hvd=hvd,
                   tdist=start_torch_gloo(coordinator))


def start_horovod(mode: str) -> Tuple[Any, Any]:
    """Initialise Horovod for ``mode`` and check it really runs that back-end; returns (hvd, coordinator)."""
    if mode == "mpi":
        # mpi4py first: it initialises MPI with MPI_THREAD_MULTIPLE, which Horovod's background
        # thread needs beside our own MPI calls. Both variables set, not defaulted: the label
        # "Horovod MPI" must be true whatever the caller's shell exported.
        coordinator = MpiCoordinator()
        os.environ["HOROVOD_CONTROLLER"] = "mpi"
        os.environ["HOROVOD_CPU_OPERATIONS"] = "mpi"
    import horovod.torch as hvd

    from hvdtrain.distributed import collectives, startup
    world = startup.init(threads=1)  # one thread per rank: 2 ranks on 2 cores
    wanted = (True, False) if mode == "mpi" else (False, True)
    if (hvd.mpi_enabled(), hvd.gloo_enabled()) != wanted:
        raise SystemExit(f"--mode {mode}: Horovod runs with MPI {'on' if hvd.mpi_enabled() else 'off'} and "
                         f"Gloo {'on' if hvd.gloo_enabled() else 'off'}; launch --mode mpi with mpirun "
                         "and --mode gloo with horovodrun --gloo")
    return hvd, coordinator if mode == "mpi" else HorovodCoordinator(collectives, world.rank, world.size)


def start_torch_gloo(coordinator: Any) -> Any:
    """torch.distributed on gloo, rendezvous at a free port on rank 0 (address and port broadcast)."""
    import datetime

    import torch.distributed as tdist

    address = port = None
    if coordinator.rank == 0:
        address = socket.gethostbyname(socket.gethostname())
        with socket.socket() as probe:  # the OS picks a free port; freed just before torch binds it
            probe.bind(("", 0))
            port = probe.getsockname()[1]
    address, port = coordinator.bcast((address, port))
    tdist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=coordinator.rank,
                             world_size=coordinator.size, timeout=datetime.timedelta(seconds=120))
    return tdist


@dataclass
class Buffers:
    """One size's fp32 buffers, shared by every back-end (numpy and torch views of the same memory)."""

    data: np.ndarray  # allreduce/broadcast buffer, ``size`` bytes
    send: np.ndarray  # allgather input, size/ranks bytes
    recv: np.ndarray  # allgather output, ``size`` bytes
    copy: np.ndarray  # memcpy destination, ``size`` bytes

    @classmethod
    def allocate(cls, size: int, ranks: int) -> "Buffers":
        count = size // 4
        # ones, not empty/zeros: every page is touched now, not inside the first timed call.
        return cls(*(np.ones(n, dtype=np.float32) for n in (count, count // ranks, count, count)))

    def fill_for_check(self, rank: int) -> None:
        self.data.fill(rank + 1)
        self.send.fill(rank + 1)
        self.recv.fill(0)


def mpi_calls(buf: Buffers, rt: Runtime) -> Dict[str, Call]:
    comm, mpi = rt.coordinator.comm, rt.mpi

    def allreduce() -> np.ndarray:
        comm.Allreduce(mpi.IN_PLACE, buf.data, op=mpi.SUM)
        return buf.data

    def broadcast() -> np.ndarray:
        comm.Bcast(buf.data, root=0)
        return buf.data

    def allgather() -> np.ndarray:
        comm.Allgather(buf.send, buf.recv)
        return buf.recv

    return {"allreduce": allreduce, "broadcast": broadcast, "allgather": allgather}


def horovod_calls(buf: Buffers, rt: Runtime) -> Dict[str, Call]:
    hvd, (data, send, _) = rt.hvd, torch_views(buf)
    # One name per op and size: after the first call, Horovod's response cache skips the negotiation.
    name = f"bench.{buf.data.nbytes}"

    def allreduce() -> np.ndarray:
        hvd.synchronize(hvd.allreduce_async_(data, name=f"{name}.allreduce", op=hvd.Sum))
        return buf.data

    def broadcast() -> np.ndarray:
        hvd.synchronize(hvd.broadcast_async_(data, root_rank=0, name=f"{name}.broadcast"))
        return buf.data

    def allgather() -> np.ndarray:
        return hvd.synchronize(hvd.allgather_async(send, name=f"{name}.allgather")).numpy()

    return {"allreduce": allreduce, "broadcast": broadcast, "allgather": allgather}


def torch_gloo_calls(buf: Buffers, rt: Runtime) -> Dict[str, Call]:
    tdist, (data, send, recv) = rt.tdist, torch_views(buf)
    # all_gather_single is all_gather_into_tensor's newer name (the old one warns on torch >= 2.10).
    gather = getattr(tdist, "all_gather_single", None) or tdist.all_gather_into_tensor

    def allreduce() -> np.ndarray:
        tdist.all_reduce(data)
        return buf.data

    def broadcast() -> np.ndarray:
        tdist.broadcast(data, src=0)
        return buf.data

    def allgather() -> np.ndarray:
        gather(recv, send)
        return buf.recv

    return {"allreduce": allreduce, "broadcast": broadcast, "allgather": allgather}


def memcpy_calls(buf: Buffers, rt: Runtime) -> Dict[str, Call]:
    """Copy the op's output bytes on rank 0 (the others wait): the limit for moving them on this host."""
    def copy_from(source: np.ndarray) -> Call:
        if rt.coordinator.rank != 0:
            return lambda: None
        return lambda: np.copyto(buf.copy, source)  # returns None: nothing to check

    return {"allreduce": copy_from(buf.data), "broadcast": copy_from(buf.data),
            "allgather": copy_from(buf.recv)}


CALL_MAKERS = {"mpi": mpi_calls, "mpi_alone": mpi_calls, "horovod_mpi": horovod_calls,
               "horovod_gloo": horovod_calls, "torch_gloo": torch_gloo_calls, "memcpy": memcpy_calls}


def torch_views(buf: Buffers) -> Tuple[Any, Any, Any]:
    """torch tensors sharing the numpy buffers' memory (data, send, recv)."""
    import torch

    return torch.from_numpy(buf.data), torch.from_numpy(buf.send), torch.from_numpy(buf.recv)


def is_correct(op: str, output: Optional[np.ndarray], ranks: int) -> bool:
    """Whether ``output`` is what ``op`` gives after ``Buffers.fill_for_check`` on every rank."""
    if output is None:
        return True
    if op == "allreduce":
        return bool((output == ranks * (ranks + 1) / 2).all())
    if op == "broadcast":
        return bool((output == 1).all())  # rank 0's value
    return bool((output.reshape(ranks, -1) == np.arange(1, ranks + 1, dtype=np.float32)[:, None]).all())


def check(backend: str, op: str, call: Call, buf: Buffers, coordinator: Any) -> None:
    """Fail every rank together (no rank left waiting in a collective) if any rank got a wrong result.

    Args:
        backend: the backend that ran the call, for the message.
        op: the collective's name, for the message.
        call: the collective under test; run once here on check values.
        buf: the size's buffers the call reads and writes.
        coordinator: the ranks' own channel (rank, size, max): it agrees on whether any rank failed.
    """
    buf.fill_for_check(coordinator.rank)
    wrong = coordinator.max(0.0 if is_correct(op, call(), coordinator.size) else 1.0)
    if wrong:
        raise SystemExit(f"{backend} {op} of {buf.data.nbytes} bytes gave a wrong result on some rank")


def iterations(size: int, iters: int, warmup: int) -> Tuple[int, int]:
    """(warm-up, timed) calls: ``iters`` up to 1 MiB, then fewer so each figure moves about as many
    bytes as at 1 MiB (20 x 64 MiB per back-end would take minutes on a small CPU host), never fewer than 3 timed."""
    scale = min(1.0, MiB / size)
    return max(min(warmup, 1), round(warmup * scale)), max(min(iters, 3), round(iters * scale))


def time_per_call(call: Call, warmup: int, iters: int, coordinator: Any) -> float:
    """Seconds per call, slowest rank: every rank starts after the same barrier.

    Args:
        call: the collective to time.
        warmup: untimed calls first.
        iters: timed calls.
        coordinator: the ranks' own channel: the barrier, and the max over ranks.
    """
    for _ in range(warmup):
        call()
    coordinator.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    return coordinator.max((time.perf_counter() - start) / iters)


def sweep(args: argparse.Namespace, rt: Runtime) -> List[Dict[str, Any]]:
    """Every (size, op): check each back-end once, then repeats of A B C D ... interleaved."""
    coordinator, backends, rows = rt.coordinator, BACKENDS[args.mode], []
    for size in args.sizes:
        buf = Buffers.allocate(size, coordinator.size)
        warmup, iters = iterations(size, args.iters, args.warmup)
        calls_by_backend = {backend: CALL_MAKERS[backend](buf, rt) for backend in backends}
        for op in args.ops:
            calls = {backend: calls_by_backend[backend][op] for backend in backends}
            for backend, call in calls.items():
                check(backend, op, call, buf, coordinator)
            buf.data.fill(0)  # in-place sums of zeros stay finite however many calls follow
            for repeat in range(args.repeats):
                for backend in backends:
                    seconds = time_per_call(calls[backend], warmup, iters, coordinator)
                    rows.append({"op": op, "size": size, "backend": backend, "repeat": repeat,
                                 "seconds": seconds, "warmup": warmup, "iters": iters})
    return rows


def horovod_settings(hvd: Any) -> Dict[str, Any]:
    """The knobs that shape Horovod's per-call time, as this job ran them."""
    return {"controller": "gloo" if hvd.gloo_enabled() and not hvd.mpi_enabled() else "mpi",
            "cpu_operations": "gloo" if hvd.gloo_enabled() else "mpi",
            "mpi_enabled": hvd.mpi_enabled(), "gloo_enabled": hvd.gloo_enabled(),
            # Each call waits for the background thread's next cycle: the per-call floor.
            "cycle_time_ms": float(os.environ.get("HOROVOD_CYCLE_TIME", "1")),
            "autotune": os.environ.get("HOROVOD_AUTOTUNE", "0") not in ("", "0")}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="rank 0 writes the result JSON here")
    parser.add_argument("--mode", choices=sorted(BACKENDS), required=True)
    parser.add_argument("--ops", type=lambda s: s.split(","), default=list(OPS))
    parser.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], required=True,
                        help="bytes, comma-separated")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    return parser.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    rt = start(args.mode)
    try:
        rows = sweep(args, rt)
        if rt.coordinator.rank == 0:
            from hvdtrain.bench.common.jobs import write_result

            write_result(args.out, {"mode": args.mode, "ranks": rt.coordinator.size,
                                    "backends": list(BACKENDS[args.mode]),
                                    "horovod": horovod_settings(rt.hvd) if rt.hvd else None, "calls": CALLS,
                                    "measurements": rows})
    finally:
        if rt.tdist is not None:
            rt.tdist.destroy_process_group()


if __name__ == "__main__":
    main()
