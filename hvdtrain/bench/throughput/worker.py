"""One measured training run of one variant: ``python -m hvdtrain.bench.throughput.worker``.

Variants (the same model, data, batch per rank and one thread per rank in each):
  single       one process, no distribution at all (run it with launcher "none")
  independent  N processes under mpirun that never communicate: the ceiling for N workers
  trainer      hvdtrain's Trainer (hvdtrain.distributed.startup.init, then Trainer.fit), with ``--strategy``
               ddp, zero1, zero2 or fsdp and ``--optimizer`` sgd (momentum) or adam
  horovod      the plain loop of Horovod's examples/pytorch/pytorch_mnist.py
  ddp          PyTorch DistributedDataParallel over gloo, rendezvous picked by rank 0
  dataparallel one process, ``torch.nn.DataParallel`` over ``--devices`` N GPUs (launcher "none"):
               a batch of ``--batch`` x N (the global batch of N workers) scattered from GPU 0 to
               device_ids 0..N-1 and gathered back on GPU 0 every step; a baseline, not a strategy

Timing: ``--warmup`` optimizer steps first (first-touch allocations, Horovod's response cache,
DDP's bucket rebuild), then ``--steps`` steps on the clock in ``--segments`` parts, each started
after a barrier and lasting as long as its slowest rank. Every step ends with the averaged
gradients applied, so the clock stops on finished work. samples/s is over all the timed steps;
the best segment's rate is also kept (on a shared machine, the one least disturbed by others).
For the Trainer, fit() runs once to the warm-up step count (set-up, broadcast, first
iterations: not timed), then once per segment, timed, each time to a higher max_steps.

Also reported: the time each rank spends in the optimizer's synchronize() (the all-reduce wait
that backward did not hide: the exposed communication; for the Trainer, its strategy's
synchronize(), also zero1/zero2's reduce-scatter wait), the CPU time of the training thread and
of every other thread of the process over the timed steps (Horovod's background thread, gloo's
threads: what communication costs in CPU on cores that also compute), and each rank's peak RSS.
The Trainer also reports the time in its strategy's step() and, within it, in the optimizer's
update (the rest of step() is zero1/zero2's all-gather of the parameters), and what each rank
held after the first step (``memory_per_rank``: the Trainer's counted bytes and peak RSS), and
the process's minor page faults and system CPU over the timed steps (fresh buffers first-touched).
Under fsdp, whose parameters are gathered unit by unit inside forward and backward, also the time
spent waiting for those gathers (``gather_per_rank_s``), the units (``fsdp_units``: path and full
bytes), and the most bytes a rank held at any moment of a step (``step_peak_per_rank``: counted
from the storages each time a unit has been gathered and before each reduce-scatter starts), since
between steps, when the Trainer counts, an fsdp rank holds its shards only.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import functools
import os
import resource
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
from torch.utils.data import DataLoader, DistributedSampler

from hvdtrain.bench.common import jobs, workloads
from hvdtrain.distributed.cpu_allocator import MODES as CPU_ALLOCATOR_MODES  # ctypes only: --help stays light
from hvdtrain.config.train import FSDP_OVERLAPS

VARIANTS = ("single", "independent", "trainer", "horovod", "ddp", "dataparallel")
LR = 0.01  # one worker's rate; every distributed variant scales it by the world size, as Horovod's examples do
MOMENTUM = 0.9
ADAM_LR = 1e-3  # the trainer variant with --optimizer adam (one worker's rate, scaled as above)
OPTIMIZERS = ("sgd", "adam")
STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")  # hvdtrain.config.train.STRATEGIES (not imported: keep --help light)
# Environment variables that change how Horovod or Open MPI move gradients: recorded with each result.
RECORDED_ENV = ("HOROVOD_FUSION_THRESHOLD", "HOROVOD_CYCLE_TIME", "HOROVOD_CPU_OPERATIONS",
                "HOROVOD_TIMELINE", "OMPI_MCA_mpi_yield_when_idle", "OMP_NUM_THREADS")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="where rank 0 writes the JSON result")
    parser.add_argument("--variant", choices=VARIANTS, required=True)
    parser.add_argument("--model", choices=sorted(workloads.WORKLOADS), required=True)
    parser.add_argument("--batch", type=int, default=64, help="samples per rank per micro-batch")
    parser.add_argument("--steps", type=int, default=30, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=5, help="optimizer steps before the clock starts")
    parser.add_argument("--segments", type=int, default=1, help="timed parts, each after a barrier")
    parser.add_argument("--accumulation", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--fp16", action="store_true", help="fp16 gradient compression (trainer, horovod)")
    parser.add_argument("--samples", type=int, default=4096, help="size of the synthetic training set")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set-env", action="append", default=[], metavar="NAME=VALUE",
                        help="set before anything starts (Horovod and Open MPI read them at init); "
                             "set here rather than by the launcher, so they reach every host")
    parser.add_argument("--hvdtrain-defaults", action="store_true",
                        help="horovod variant: apply hvdtrain's environment defaults first, as startup.init does")
    parser.add_argument("--strategy", choices=STRATEGIES, default="ddp", help="trainer variant: train.strategy")
    parser.add_argument("--cpu-allocator", choices=CPU_ALLOCATOR_MODES, default="cache",
                        help="trainer variant: train.cpu_allocator (default: cache)")
    parser.add_argument("--fsdp-overlap", choices=FSDP_OVERLAPS, default="auto",
                        help="trainer variant, strategy fsdp: train.fsdp_overlap (default: auto)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd",
                        help=f"trainer variant: SGD with momentum {MOMENTUM} (lr {LR}) or Adam (lr {ADAM_LR})")
    parser.add_argument("--devices", type=int,
                        help="dataparallel variant: GPUs (device_ids 0..N-1), each taking --batch samples of a step")
    args = parser.parse_args(argv)
    for item in args.set_env:
        if "=" not in item:
            parser.error(f"--set-env takes NAME=VALUE, got {item!r}")
    if args.hvdtrain_defaults and args.variant != "horovod":
        parser.error("--hvdtrain-defaults is for --variant horovod (the trainer applies them itself)")
    if min(args.batch, args.steps, args.warmup, args.accumulation, args.samples, args.segments) < 1:
        parser.error("--batch, --steps, --warmup, --accumulation, --samples and --segments must be >= 1")
    if args.segments > args.steps:
        parser.error(f"--segments {args.segments} is more than the {args.steps} timed steps")
    if (args.devices is None) != (args.variant != "dataparallel"):
        parser.error("--devices is for --variant dataparallel, and that variant needs it")
    if args.devices is not None and args.devices < 2:
        parser.error(f"--devices {args.devices}: DataParallel needs 2 or more GPUs")
    if args.variant in ("single", "independent", "ddp", "dataparallel") and args.fp16:
        parser.error(f"--fp16 is a Horovod compression: not for --variant {args.variant}")
    if args.variant != "trainer" and (args.strategy != "ddp" or args.optimizer != "sgd"):
        parser.error("--strategy and --optimizer are for --variant trainer")
    return args


# ---- what every variant shares ------------------------------------------------------------

def batches(loader: DataLoader) -> Iterator:
    """Micro-batches forever, a new shuffle each epoch (as a multi-epoch run sees them)."""
    epoch = 0
    while True:
        if isinstance(loader.sampler, DistributedSampler):
            loader.sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def local_step(model, optimizer, micro_batches: Iterator, accumulation: int, loss_fn: Callable) -> None:
    """One optimizer step of plain PyTorch: zero_grad, forward/backward per micro-batch, step.

    Args:
        model: the model.
        optimizer: its optimizer.
        micro_batches: (inputs, labels) pairs, ``accumulation`` of them.
        accumulation: micro-batches per step; each loss is divided by it.
        loss_fn: the workload's loss of (outputs, labels).
    """
    optimizer.zero_grad()
    for _ in range(accumulation):
        inputs, targets = next(micro_batches)
        loss = loss_fn(model(inputs), targets)
        (loss / accumulation if accumulation > 1 else loss).backward()
    optimizer.step()


class SyncTimer:
    """Wraps a Horovod DistributedOptimizer's synchronize() to add up the time spent in it.

    step() calls self.synchronize() (or the loop does, before step(), as the Trainer does): the
    wrapper sees every wait without changing the loop. ``method`` times another method instead
    (a strategy's synchronize or step, an optimizer's step).
    """

    def __init__(self, optimizer, method: str = "synchronize") -> None:
        self.seconds = 0.0
        original = getattr(optimizer, method)

        @functools.wraps(original)  # keeps the marks of other wrappers (the LR scheduler's on step)
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started

        setattr(optimizer, method, timed)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def mpi_yield_when_idle() -> Optional[bool]:
    """The value Open MPI actually runs with in this process (None: Open MPI not loaded)."""
    try:
        lib = ctypes.CDLL("libopen-pal.so.40", mode=os.RTLD_NOLOAD)
        return bool(ctypes.c_bool.in_dll(lib, "opal_progress_yield_when_idle").value)
    except (OSError, ValueError):
        return None


def thread_cpu_seconds() -> Dict[int, float]:
    """CPU time (user + system) of each thread of this process, by thread id (Linux; else empty)."""
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    times = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return times
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        times[int(tid)] = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return times


@dataclasses.dataclass
class Measured:
    """One rank's view of its timed steps: seconds per segment, in synchronize(), and CPU seconds
    of the training thread and of all other threads together."""

    segments: List[float]
    sync: float = float("nan")
    cpu_main: float = float("nan")
    cpu_other: float = float("nan")


def segment_steps(steps: int, segments: int) -> List[int]:
    """``steps`` split into ``segments`` parts differing by at most one step."""
    return [steps // segments + (1 if k < steps % segments else 0) for k in range(segments)]


def result(args, size: int, per_rank: List[Dict[str, Any]], model, extra: Dict[str, Any]) -> Dict[str, Any]:
    """Rank 0's JSON: each segment lasts as long as its slowest rank.

    Args:
        args: the worker's options.
        size: ranks in the job.
        per_rank: every rank's timings (segments, waits for gradients, CPU).
        model: the model, for its parameter and tensor counts.
        extra: fields added as is.
    """
    slowest = [max(rank["segments"][k] for rank in per_rank) for k in range(args.segments)]
    elapsed = sum(slowest)
    per_step_samples = args.accumulation * args.batch * size
    samples = args.steps * per_step_samples
    params, tensors = workloads.parameter_count(model)
    syncs = [rank["sync"] for rank in per_rank]
    segment_rates = [n * per_step_samples / t for n, t in zip(segment_steps(args.steps, args.segments), slowest)]
    return {
        "variant": args.variant, "model": args.model, "world_size": size,
        "batch": args.batch, "steps": args.steps, "warmup": args.warmup, "segments": args.segments,
        "accumulation": args.accumulation, "fp16": args.fp16,
        "parameters": params, "parameter_tensors": tensors,
        "samples": samples, "elapsed_s": elapsed, "samples_per_sec": samples / elapsed,
        "segment_samples_per_sec": segment_rates, "best_segment_samples_per_sec": max(segment_rates),
        "elapsed_per_rank_s": [sum(rank["segments"]) for rank in per_rank],
        "sync_per_rank_s": syncs,
        # Exposed communication: share of the timed steps each rank spent waiting for gradients.
        "comm_share": (sum(s / sum(r["segments"]) for s, r in zip(syncs, per_rank)) / len(per_rank)
                       if all(s == s for s in syncs) else None),
        # Cores' worth of CPU per rank over the timed steps: the training thread, the other threads.
        "cpu_main_cores": sum(r["cpu_main"] / sum(r["segments"]) for r in per_rank) / len(per_rank),
        "cpu_other_cores": sum(r["cpu_other"] / sum(r["segments"]) for r in per_rank) / len(per_rank),
        "peak_rss_mb_per_rank": [rank["rss_mb"] for rank in per_rank],
        "env": {name: os.environ.get(name) for name in RECORDED_ENV},
        "mpi_yield_when_idle": mpi_yield_when_idle(),
        "torch_threads": torch.get_num_threads(),
        **extra,
    }


def rank_record(measured: Measured) -> Dict[str, Any]:
    return {"segments": measured.segments, "sync": measured.sync, "rss_mb": peak_rss_mb(),
            "cpu_main": measured.cpu_main, "cpu_other": measured.cpu_other}


def timed(barrier: Callable[[], None], run_steps: Callable[[int], None], args,
          sync: Optional["SyncTimer"] = None, others: tuple = ()) -> Measured:
    """Warm up, then time the steps in segments, the ranks lined up before each
    (``sync`` and the ``others`` timers count from the first timed step).

    Args:
        barrier: lines the ranks up.
        run_steps: runs that many steps.
        args: the worker's options (warm-up, steps, segments).
        sync: the timer of the waits for gradients, or None.
        others: more timers started with the first timed step.
    """
    run_steps(args.warmup)
    for timer in (sync, *others):
        if timer is not None:
            timer.seconds = 0.0
    segments = []
    cpu_before = thread_cpu_seconds()
    for steps in segment_steps(args.steps, args.segments):
        barrier()
        started = time.perf_counter()
        run_steps(steps)
        segments.append(time.perf_counter() - started)
    cpu_after = thread_cpu_seconds()
    used = {tid: seconds - cpu_before.get(tid, 0.0) for tid, seconds in cpu_after.items()}
    main = threading.main_thread().native_id
    return Measured(segments, sync.seconds if sync is not None else float("nan"),
                    cpu_main=used.get(main, float("nan")),
                    cpu_other=sum(seconds for tid, seconds in used.items() if tid != main))


# ---- the variants -------------------------------------------------------------------------

def run_single(args) -> None:
    model = workloads.build_model(args.model, args.seed)
    loss_fn = workloads.get(args.model).loss
    dataset = workloads.synthetic_dataset(args.model, args.samples, args.seed)
    loader = DataLoader(dataset, batch_size=args.batch, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(args.seed))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    micro = batches(loader)

    def steps(n: int) -> None:
        for _ in range(n):
            local_step(model, optimizer, micro, args.accumulation, loss_fn)

    measured = timed(lambda: None, steps, args)
    jobs.write_result(args.out, result(args, 1, [rank_record(measured)], model, {}))


def run_independent(args) -> None:
    """N copies of the one-process run: each its own model and data order, no gradient exchange.
    MPI (mpi4py) only lines them up before the clock and collects the times after it."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    model = workloads.build_model(args.model, args.seed)
    loss_fn = workloads.get(args.model).loss
    dataset = workloads.synthetic_dataset(args.model, args.samples, args.seed)
    loader = DataLoader(dataset, batch_size=args.batch, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(args.seed + comm.rank))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    micro = batches(loader)

    def steps(n: int) -> None:
        for _ in range(n):
            local_step(model, optimizer, micro, args.accumulation, loss_fn)

    measured = timed(comm.Barrier, steps, args)
    per_rank = comm.gather(rank_record(measured), root=0)
    if comm.rank == 0:
        jobs.write_result(args.out, result(args, comm.size, per_rank, model, {}))


def run_horovod(args) -> None:
    """The steps of Horovod's examples/pytorch/pytorch_mnist.py, in its order."""
    import horovod.torch as hvd

    if args.hvdtrain_defaults:
        from hvdtrain.distributed.startup import apply_env_defaults

        apply_env_defaults()
    # Initialize Horovod; one thread per rank
    hvd.init()
    torch.set_num_threads(1)
    model = workloads.build_model(args.model, args.seed)
    loss_fn = workloads.get(args.model).loss
    dataset = workloads.synthetic_dataset(args.model, args.samples, args.seed)
    # Partition the dataset among workers
    sampler = DistributedSampler(dataset, num_replicas=hvd.size(), rank=hvd.rank(), seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler, drop_last=True)
    # Scale the learning rate by the number of workers
    optimizer = torch.optim.SGD(model.parameters(), lr=LR * hvd.size(), momentum=MOMENTUM)
    # Broadcast parameters and optimizer state from rank 0
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    # Wrap the optimizer: gradients are averaged by all-reduce as backward produces them
    compression = hvd.Compression.fp16 if args.fp16 else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression, op=hvd.Average,
                                         backward_passes_per_step=args.accumulation)
    sync = SyncTimer(optimizer)
    micro = batches(loader)

    def steps(n: int) -> None:
        for _ in range(n):
            local_step(model, optimizer, micro, args.accumulation, loss_fn)  # zero_grad, forward, backward, step

    measured = timed(hvd.barrier, steps, args, sync)
    per_rank = hvd.allgather_object(rank_record(measured), name="bench.result")
    if hvd.rank() == 0:
        jobs.write_result(args.out, result(args, hvd.size(), per_rank, model,
                                           {"controller": "gloo" if hvd.gloo_enabled() else "mpi"}))


def run_trainer(args) -> None:
    from hvdtrain.distributed import collectives
    from hvdtrain.distributed import startup
    from hvdtrain.config.train import TrainConfig
    from hvdtrain.trainer import Trainer

    # No progress lines in the timed steps (a user's choice, not a cost of the Trainer); the
    # other per-step work (stall watchdog beat, preemption vote, LR schedule) stays on.
    config = TrainConfig(epochs=10**6, batch_size=args.batch, lr=LR, max_steps=args.warmup,
                         log_every=10**9, accumulation=args.accumulation, fp16_allreduce=args.fp16,
                         seed=args.seed, strategy=args.strategy, cpu_allocator=args.cpu_allocator,
                         fsdp_overlap=args.fsdp_overlap if args.strategy == "fsdp" else "auto")
    world = startup.init(config, threads=1)
    model = workloads.build_model(args.model, args.seed)
    dataset = workloads.synthetic_dataset(args.model, args.samples, args.seed)
    if args.optimizer == "adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=ADAM_LR)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    trainer = Trainer(model, optimizer, dataset, config=config, loss_fn=workloads.get(args.model).loss, world=world)
    # The strategy's synchronize is the step's exposed gradient wait under every strategy (ddp:
    # Horovod's all-reduce; zero: the reduce-scatter); its step is the update and, for zero, the
    # parameters' all-gather after it.
    sync = SyncTimer(trainer.strategy)
    step_timer = SyncTimer(trainer.strategy, "step")
    update_timer = SyncTimer(trainer.optimizer, "step")
    # fsdp gathers parameters in forward and backward (prefetched): the waits for them, and what a
    # rank holds while a unit is gathered or its full gradients exist.
    gather_timer = SyncTimer(trainer.strategy.comm, "ensure_gathered") if args.strategy == "fsdp" else None
    step_peak = watch_step_peak(trainer.strategy) if args.strategy == "fsdp" else None

    usage = []  # (minor page faults, system CPU seconds) of the process, per call after the first (warm-up)

    def steps(n: int) -> None:
        # n more steps, continuing where the last fit stopped.
        before = resource.getrusage(resource.RUSAGE_SELF)
        trainer.fit(until_step=trainer.global_step + n)
        after = resource.getrusage(resource.RUSAGE_SELF)
        usage.append((after.ru_minflt - before.ru_minflt, after.ru_stime - before.ru_stime))

    # The first fit() runs the warm-up steps after the Trainer's set-up (broadcast, loaders):
    # neither is timed, as for the other variants. Each timed fit() pays fit()'s own start and
    # end again (watchdog thread, loader iterator, the epoch's loss reduction): charged to it.
    measured = timed(collectives.barrier, steps, args, sync, (step_timer, update_timer, gather_timer))
    mine = {**rank_record(measured), "step_s": step_timer.seconds, "update_s": update_timer.seconds,
            "gather_s": gather_timer.seconds if gather_timer else 0.0, "step_peak": step_peak,
            "minor_faults": sum(u[0] for u in usage[1:]), "system_s": sum(u[1] for u in usage[1:])}
    per_rank = collectives.allgather_object(mine, name="bench.result")
    if world.is_root:
        jobs.write_result(args.out, result(args, world.size, per_rank, model, {
            "controller": world.controller, "steps_taken": trainer.global_step,
            "strategy": args.strategy, "optimizer": args.optimizer,
            "memory_per_rank": trainer.parts.reporter.memory.per_rank,
            "step_per_rank_s": [rank["step_s"] for rank in per_rank],  # strategy.step(): update (+ all-gather)
            "update_per_rank_s": [rank["update_s"] for rank in per_rank],  # the optimizer's own step
            "minor_faults_per_rank": [rank["minor_faults"] for rank in per_rank],  # over the timed steps
            "system_cpu_per_rank_s": [rank["system_s"] for rank in per_rank],
            **({"gather_per_rank_s": [rank["gather_s"] for rank in per_rank],  # fsdp: waits for unit gathers
                "step_peak_per_rank": [rank["step_peak"] for rank in per_rank],
                "largest_unit_bytes": trainer.strategy.largest_unit_bytes(), "fsdp_overlap": trainer.strategy.overlap,
                "fsdp_units": [{"path": unit.path or "(root)", "full_bytes": unit.full_bytes}
                               for unit in trainer.strategy.all_units]} if args.strategy == "fsdp" else {}),
        }))


def watch_step_peak(strategy) -> Dict[str, int]:
    """The largest counted bytes of an fsdp rank during its steps, by component at that moment:
    sampled after each unit's gather and before each reduce-scatter (its full gradient still held).
    The dict fills in as the run goes (read it at the end)."""
    peak: Dict[str, int] = {}

    def sample() -> None:
        held = strategy.memory_bytes()
        total = sum(held.values())
        if total > peak.get("total", -1):
            peak.update(held, total=total)

    comm = strategy.comm
    gather, reduce = comm.ensure_gathered, comm.start_reduction

    def ensure_gathered(unit) -> None:
        gather(unit)
        sample()

    def start_reduction(bucket) -> None:
        sample()
        reduce(bucket)

    comm.ensure_gathered, comm.start_reduction = ensure_gathered, start_reduction
    return peak


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def run_ddp(args) -> None:
    """torch DDP over gloo under mpirun: rank and size from MPI, rank 0 picks the rendezvous."""
    import torch.distributed as tdist
    from mpi4py import MPI
    from torch.nn.parallel import DistributedDataParallel

    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    address, port = comm.bcast((socket.gethostname(), free_port()) if rank == 0 else None, root=0)
    tdist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=rank, world_size=size)
    try:
        torch.set_num_threads(1)
        model = workloads.build_model(args.model, args.seed)
        loss_fn = workloads.get(args.model).loss
        dataset = workloads.synthetic_dataset(args.model, args.samples, args.seed)
        sampler = DistributedSampler(dataset, num_replicas=size, rank=rank, seed=args.seed)
        loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler, drop_last=True)
        ddp = DistributedDataParallel(model)  # broadcasts rank 0's parameters
        optimizer = torch.optim.SGD(ddp.parameters(), lr=LR * size, momentum=MOMENTUM)
        micro = batches(loader)

        def step() -> None:
            optimizer.zero_grad()
            for index in range(args.accumulation):
                inputs, targets = next(micro)
                last = index == args.accumulation - 1
                with contextlib.nullcontext() if last else ddp.no_sync():
                    loss = loss_fn(ddp(inputs), targets)
                    (loss / args.accumulation if args.accumulation > 1 else loss).backward()
            optimizer.step()

        def steps(n: int) -> None:
            for _ in range(n):
                step()

        measured = timed(tdist.barrier, steps, args)
        per_rank = comm.gather(rank_record(measured), root=0)
        if rank == 0:
            jobs.write_result(args.out, result(args, size, per_rank, model,
                                               {"bucket_cap_mb": 25, "backend": "gloo"}))
    finally:
        tdist.destroy_process_group()


def dataparallel_layout(batch: int, devices: int) -> Dict[str, Any]:
    """What one DataParallel process runs to stand for ``devices`` workers of ``batch`` samples each:
    the global batch, the GPUs it is scattered over, and the GPU that holds the model and the outputs."""
    device_ids = list(range(devices))
    return {"global_batch": batch * devices, "device_ids": device_ids, "output_device": device_ids[0]}


def run_dataparallel(args) -> None:
    """One process, torch.nn.DataParallel over GPUs 0..N-1, at the global batch of N workers.

    Not exercised by hvdtrain's tests (their machines have no GPU): the bench skips this variant
    on a machine with fewer than 2 GPUs before launching it; tests check the command it is given,
    dataparallel_layout(), and that this function refuses to start without the GPUs.
    """
    layout = dataparallel_layout(args.batch, args.devices)
    available = torch.cuda.device_count()
    if available < args.devices:
        raise SystemExit(f"dataparallel: --devices {args.devices} but this machine has {available} GPUs")
    first = torch.device("cuda", layout["output_device"])
    torch.cuda.set_device(first)
    model = workloads.build_model(args.model, args.seed).to(first)  # DataParallel wants it on device_ids[0]
    loss_fn = workloads.get(args.model).loss
    dataset = workloads.synthetic_dataset(args.model, args.samples, args.seed)
    loader = DataLoader(dataset, batch_size=layout["global_batch"], shuffle=True, drop_last=True,
                        pin_memory=True, generator=torch.Generator().manual_seed(args.seed))
    parallel = torch.nn.DataParallel(model, device_ids=layout["device_ids"],
                                     output_device=layout["output_device"])
    # The global batch of N workers: the learning rate scaled by N, as the distributed variants do
    optimizer = torch.optim.SGD(model.parameters(), lr=LR * args.devices, momentum=MOMENTUM)
    micro = ((inputs.to(first, non_blocking=True), targets.to(first, non_blocking=True))
             for inputs, targets in batches(loader))

    def synchronize() -> None:
        for device in layout["device_ids"]:
            torch.cuda.synchronize(device)

    def steps(n: int) -> None:
        for _ in range(n):
            # each step: scatter the batch from GPU 0, replicate the model, parallel forward,
            # gather the outputs on GPU 0, backward reduces the gradients onto GPU 0's model
            local_step(parallel, optimizer, micro, args.accumulation, loss_fn)
        synchronize()  # the clock stops on finished work, not on queued kernels

    measured = timed(synchronize, steps, args)
    jobs.write_result(args.out, result(args, args.devices, [rank_record(measured)], model, {
        "processes": 1, **layout, "gpus": [torch.cuda.get_device_name(d) for d in layout["device_ids"]]}))


RUNNERS = {"single": run_single, "independent": run_independent, "trainer": run_trainer,
           "horovod": run_horovod, "ddp": run_ddp, "dataparallel": run_dataparallel}


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    for item in args.set_env:
        name, value = item.split("=", 1)
        os.environ[name] = value
    workloads.one_thread_per_rank()
    RUNNERS[args.variant](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
