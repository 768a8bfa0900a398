"""Starting Horovod for a job: the settings hvdtrain gives Horovod and MPI before hvd.init(), the
launcher's check of the world Horovod formed, and each rank's device, threads and seeds.
"""
from __future__ import annotations

import logging
import os
import re
import socket
import time
from dataclasses import replace
from typing import Any, Dict, Mapping, MutableMapping, Optional

import torch

import horovod.torch as hvd

from hvdtrain.common.errors import install_refusal_hook
from hvdtrain.common.startup_clock import CLOCK as STARTUP_CLOCK
from hvdtrain.distributed import cpu_allocator, devices
from hvdtrain.distributed import environments as launcher_env
from hvdtrain.distributed import rng
from hvdtrain.distributed.world import World

# Settings hvdtrain gives the job unless the user set them: each is read from the environment
# when hvd.init() starts Horovod and MPI, so they are set in this process just before it.
ENV_DEFAULTS = {
    # Horovod's default is to warn about a stalled collective after 60 s and never give up,
    # which turns a rank that stopped calling collectives into a silent hang (MPI controller only).
    "HOROVOD_STALL_CHECK_TIME_SECONDS": "60",
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "300",
    # Open MPI busy-polls while it waits for a peer, and Horovod's background thread waits inside
    # MPI every cycle: with as many ranks as cores, that polling takes CPU time from the ranks'
    # compute. Open MPI yields when idle by default only on hosts it knows are oversubscribed,
    # and it cannot count Horovod's thread (`hvdtrain bench throughput` measures the difference).
    # Open MPI reads OMPI_MCA_* at MPI_Init, which hvd.init() calls: setting it here takes
    # effect, unless something (mpi4py, say) initialised MPI first.
    "OMPI_MCA_mpi_yield_when_idle": "1",
}
# Lets train.timeline_steps start and stop the timeline mid-run (Horovod refuses otherwise). Only
# when asked: armed, it costs every step even while recording nothing (`hvdtrain bench throughput`).
TIMELINE_ARMED = ("HOROVOD_TIMELINE", "DYNAMIC")
# Hierarchical all-reduce (train.hierarchical_allreduce): Horovod reads it once, when hvd.init()
# starts its background thread, as an integer (> 0: on); it takes effect only with NCCL, on GPU
# tensors, across more than one host (horovod/common/operations.cc).
HIERARCHICAL_ALLREDUCE = "HOROVOD_HIERARCHICAL_ALLREDUCE"
# Process sets made after start (hvdtrain.parallel.topology's: the mesh's, sequence, expert and hsdp
# groups, which depend on the world size and the layout) need this when hvd.init() runs; Horovod reads it once.
DYNAMIC_PROCESS_SETS = "HOROVOD_DYNAMIC_PROCESS_SETS"


def apply_env_defaults(environ: MutableMapping[str, str] = os.environ) -> Dict[str, str]:
    """Set each of ENV_DEFAULTS that ``environ`` lacks; a value the user set always wins.

    Returns what this call set (the job runs with it because of hvdtrain, not its user).
    """
    applied = {key: value for key, value in ENV_DEFAULTS.items() if key not in environ}
    environ.update(applied)
    return applied


def hierarchical_requested(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Whether ``environ`` asks Horovod for hierarchical all-reduce, read as Horovod reads it
    (strtol: a leading integer, > 0 is on)."""
    match = re.match(r"\s*([+-]?\d+)", environ.get(HIERARCHICAL_ALLREDUCE, ""))
    return bool(match) and int(match.group(1)) > 0


def hierarchical_conflict() -> str:
    """What to do when hierarchical all-reduce is asked for after Horovod started without it."""
    return (f"train.hierarchical_allreduce=true, but Horovod was started without {HIERARCHICAL_ALLREDUCE}=1: "
            f"it reads the setting once, in hvd.init(), which already ran (hvdtrain.init() or hvd.init() "
            f"before the Trainer). Set it before hvd.init(): hvdtrain.init(config) with the run's TrainConfig, "
            f"or in the launch (horovodrun --hierarchical-allreduce, mpirun -x {HIERARCHICAL_ALLREDUCE}=1)")


def hierarchical_effect(requested: bool, nccl_built: bool, device_type: str, cross_size: int) -> str:
    """Whether Horovod applies a hierarchical all-reduce in this job, and if not, why (for the start line).

    Args:
        requested: train.hierarchical_allreduce, or the launch's HOROVOD_HIERARCHICAL_ALLREDUCE.
        nccl_built: Horovod was built with NCCL.
        device_type: the ranks' device type (cuda, cpu).
        cross_size: hosts in the job.
    """
    if not requested:
        return "hierarchical all-reduce off"
    missing = [why for why, absent in (("Horovod built without NCCL", not nccl_built),
                                       ("CPU tensors", device_type != "cuda"),
                                       ("one host", cross_size < 2)) if absent]
    if missing:
        return (f"hierarchical all-reduce requested ({HIERARCHICAL_ALLREDUCE}=1) but not applied by Horovod "
                f"here ({', '.join(missing)}): it needs NCCL, GPU tensors and several hosts")
    return f"hierarchical all-reduce on ({HIERARCHICAL_ALLREDUCE}=1: NCCL within each host, then across hosts)"


def threads_set_by_user(environ: Mapping[str, str] = os.environ) -> Optional[int]:
    """OMP_NUM_THREADS, when the user (or the site's scheduler) set it: a value the user set wins
    over hvdtrain's own division of the host. ValueError when it is not a whole number >= 1."""
    value = environ.get("OMP_NUM_THREADS", "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"OMP_NUM_THREADS={value!r} is not a whole number >= 1: set it to the threads each rank "
                         f"may use, or unset it to let hvdtrain divide the host's cores among its ranks")
    return int(value)


def threads_per_rank(local_size: int, cpus_visible: int, cpus_on_host: int) -> int:
    """Intra-op threads for one rank, so the ranks on a host do not oversubscribe its cores.

    A launcher that binds ranks (Open MPI binds to a core for np <= 2) already gives each
    rank its own CPU set: use all of it. Unbound, the ranks share the host: split it.
    """
    if cpus_visible < cpus_on_host:
        return max(1, cpus_visible)
    return max(1, cpus_on_host // max(1, local_size))


def dynamic_process_sets_conflict() -> str:
    """What to do when process sets are needed after Horovod started without dynamic process sets."""
    return (f"tensor, pipeline or sequence parallelism makes Horovod process sets after start, which needs "
            f"{DYNAMIC_PROCESS_SETS}=1 when hvd.init() runs, and hvd.init() already ran without it "
            f"(hvdtrain.init() or hvd.init() before the Trainer). Start with hvdtrain.init(config), the run's "
            f"TrainConfig (it starts the world those settings need), or set {DYNAMIC_PROCESS_SETS}=1 in the launch")


def dynamic_process_sets_enabled() -> bool:
    return os.environ.get(DYNAMIC_PROCESS_SETS, "0").strip() not in ("", "0")


def init(config: Any = None, *, seed: Optional[int] = None, threads: Optional[int] = None,
         timeline: Optional[bool] = None, hierarchical_allreduce: Optional[bool] = None,
         dynamic_process_sets: Optional[bool] = None) -> World:
    """Start Horovod, pin this rank to its device and threads, and seed it.

    ``hvdtrain.init(config)`` with the run's TrainConfig starts the world those settings need: its
    seed, a timeline armed for train.timeline_steps, train.hierarchical_allreduce, and the dynamic
    process sets of tensor, pipeline, sequence or expert parallelism and hsdp (Horovod reads these
    once, at its start). A keyword given beside it wins over the setting.

    Safe to call more than once: Horovod's init is idempotent. Fails, naming both values and
    the likely fix, when the launcher's variables disagree with the world Horovod formed. The
    ranks agree on their devices (hvdtrain.distributed.devices.take_device, a collective): every
    rank starts, or every rank raises the same error naming the ranks and hosts at fault.

    Args:
        config: the run's TrainConfig (or the seed, a whole number, as before); None: the defaults below.
        seed: the job's seed (default: the config's, else 0); each rank seeds torch, Python and numpy with its
            own seed derived from it.
        threads: torch's intra-op threads (None: the user's setting, else the host's cores over its ranks).
        timeline: arm Horovod's timeline so that the Trainer can record a few steps of it (train.timeline_steps); it
            slows every step, so it is off unless asked for.
        hierarchical_allreduce: set HOROVOD_HIERARCHICAL_ALLREDUCE=1 before hvd.init() (train.hierarchical_allreduce);
            False leaves the launch's setting. Refused when Horovod already started without it: it reads the setting
            only once.
        dynamic_process_sets: set HOROVOD_DYNAMIC_PROCESS_SETS=1 before hvd.init(), so that process sets can be added
            later (hvdtrain.parallel.mesh); refused when Horovod already started without it.
    """
    STARTUP_CLOCK.mark("imports")
    if isinstance(config, int) and not isinstance(config, bool):  # init(5): the seed, as the first argument was
        config, seed = None, config if seed is None else seed
    if config is not None and not hasattr(config, "needs_process_sets"):
        raise TypeError(f"hvdtrain.init(config): give the run's TrainConfig (job.train), got {type(config).__name__}")
    if seed is None:
        seed = config.seed if config is not None else 0
    if timeline is None:
        timeline = config is not None and config.timeline_steps > 0
    if hierarchical_allreduce is None:
        hierarchical_allreduce = config is not None and config.hierarchical_allreduce
    if dynamic_process_sets is None:
        dynamic_process_sets = config is not None and config.needs_process_sets
    if hierarchical_allreduce and not hierarchical_requested():
        if hvd.is_initialized():
            raise ValueError(hierarchical_conflict())
        os.environ[HIERARCHICAL_ALLREDUCE] = "1"
        logging.getLogger(__name__).info("%s=1 set before hvd.init() (train.hierarchical_allreduce)",
                                          HIERARCHICAL_ALLREDUCE)
    if dynamic_process_sets and not dynamic_process_sets_enabled():
        if hvd.is_initialized():
            raise ValueError(dynamic_process_sets_conflict())
        os.environ[DYNAMIC_PROCESS_SETS] = "1"
    applied = apply_env_defaults()
    if timeline:
        os.environ.setdefault(*TIMELINE_ARMED)
    if applied:
        logging.getLogger(__name__).info("hvdtrain defaults (set them yourself to override): %s",
                                          " ".join(f"{k}={v}" for k, v in applied.items()))
    launcher = launcher_env.detect()
    # Before hvd.init(), whose background thread allocates the collectives' outputs. A rank without
    # a GPU computes on the CPU (devices.choose_device); a GPU's tensors live in CUDA's caching
    # allocator already.
    allocator = "" if torch.cuda.is_available() else cpu_allocator.keep_freed_memory(
        config.cpu_allocator if config is not None else "cache")
    hvd.init()
    # A refusal from here on (every rank raises it alike): one line on rank 0, exit 2 on every rank.
    install_refusal_hook(is_root=hvd.rank() == 0, meet=meet_after_a_refusal)
    launcher_env.check_world(launcher, hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size())

    hostname = socket.gethostname()
    # Distributed: every rank's device (or why it has none) to every rank, so that all start or all
    # refuse. Not under elastic: a worker joining later would wait here for ranks that never come.
    gather = None if launcher_env.is_elastic_launch() else (
        lambda record: hvd.allgather_object(record, name="hvdtrain.devices"))
    device = devices.take_device(hvd.rank(), hvd.local_rank(), hvd.local_size(), hostname, gather)
    if threads is None:
        threads = threads_set_by_user() or threads_per_rank(
            hvd.local_size(), len(os.sched_getaffinity(0)), os.cpu_count() or 1
        )
    torch.set_num_threads(threads)
    rng.seed_everything(rng.rank_seed(seed, hvd.rank()))
    STARTUP_CLOCK.mark("horovod init")

    return World(
        **_horovod_ranks(),
        hostname=hostname,
        controller="gloo" if hvd.gloo_enabled() else "mpi",
        launcher=launcher.name,
        threads=threads,
        device=device,
        hierarchical_allreduce=hierarchical_requested(),
        cpu_allocator=allocator if device.type == "cpu" else "",
    )


def meet_after_a_refusal(grace_seconds: float) -> bool:
    """Every rank, in the refusal hook before it exits (rank 0 once its line is out): one Horovod
    all-reduce, polled so that a rank that never comes (it did not refuse) costs ``grace_seconds``,
    not a hang. True once every rank joined."""
    if not hvd.is_initialized():
        return False
    try:
        handle = hvd.allreduce_async(torch.zeros(1), name="hvdtrain.refusal", op=hvd.Sum)
        deadline = time.monotonic() + grace_seconds
        while not hvd.poll(handle):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        hvd.synchronize(handle)
    except Exception:  # Horovod shut down or failed: nobody to meet
        return False
    return True


def reformed(world: World) -> World:
    """The world after an elastic reset: Horovod re-initialised with other ranks (the device,
    threads and launcher stay; the launcher's variables no longer describe the world)."""
    return replace(world, **_horovod_ranks())


def _horovod_ranks() -> Dict[str, int]:
    """This process's place in the world Horovod formed, as World's fields."""
    return {
        "rank": hvd.rank(), "size": hvd.size(),
        "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
        "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(),
    }


def timeline_armed() -> bool:
    return bool(os.environ.get(TIMELINE_ARMED[0]))
