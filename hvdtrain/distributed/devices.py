"""Which device a rank computes on, for every way a site hands out GPUs.

- No GPU visible: the CPU.
- As many GPUs visible as ranks on the host, or more (one node, all its GPUs, ``horovodrun`` or
  ``mpirun``): rank by local rank, ``cuda:<local rank>``.
- One GPU visible to each rank (SLURM's ``--gpus-per-task=1``, or a wrapper setting
  ``CUDA_VISIBLE_DEVICES`` to one entry per rank): ``cuda:0``, which is that rank's own GPU.
- Fewer GPUs than ranks, but more than one: refused at start, with the counts and the fix.
Ranks that end up on the same physical GPU (every rank given ``CUDA_VISIBLE_DEVICES=0``) are found
by the GPUs' UUIDs and refused too: NCCL cannot run a communicator with a GPU twice in it. So are
ranks on the CPU beside ranks on GPUs (a host whose torch sees no GPU): Horovod refuses a collective
whose ranks' tensors are on different kinds of device.

The ranks agree on it (``take_device``): each rank's device, or why it has none, goes to every rank
in one gather that every rank enters whatever happened on it, and every rank then starts, or
raises the same error. A rank that raised alone would leave the others waiting in the gather.

Also what a rank's GPU memory peaked at, for the memory report and the out-of-memory message.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch


def choose_device(local_rank: int, local_size: int, visible_gpus: int, host: str) -> str:
    """``cpu``, or ``cuda:<index>`` among the GPUs this process sees; ValueError when the host's
    ranks outnumber its GPUs.

    Args:
        local_rank: this rank's index on its host.
        local_size: ranks on its host.
        visible_gpus: GPUs this process sees (0: cpu).
        host: the host's name, for the message.
    """
    if visible_gpus <= 0:
        return "cpu"
    if visible_gpus == 1:
        return "cuda:0"  # this rank's own GPU; sharing one is caught by the UUID check
    if local_size <= visible_gpus:
        return f"cuda:{local_rank}"
    raise ValueError(
        f"{local_size} ranks on {host} but only {visible_gpus} GPUs visible to each: a rank per GPU is "
        f"needed. Start at most {visible_gpus} ranks on this host (horovodrun -H {host}:{visible_gpus}, "
        f"mpirun --map-by ppr:{visible_gpus}:node, or srun --ntasks-per-node={visible_gpus}), or give each "
        f"rank its own GPU (srun --gpus-per-task=1)")


def shared_gpus(ranks: Sequence[Tuple[int, str, str]]) -> List[str]:
    """From every rank's (rank, host, GPU UUID): a line per GPU that more than one rank uses."""
    users: Dict[Tuple[str, str], List[int]] = defaultdict(list)
    for rank, host, uuid in ranks:
        users[(host, uuid)].append(rank)
    return [f"ranks {', '.join(map(str, sorted(found)))} on {host} use the same GPU ({uuid})"
            for (host, uuid), found in sorted(users.items(), key=lambda item: min(item[1])) if len(found) > 1]


def sharing_refusal(problems: Sequence[str]) -> str:
    return (f"{'; '.join(problems)}. One rank per GPU: give each task its own GPU (srun --gpus-per-task=1, "
            f"or CUDA_VISIBLE_DEVICES set per rank), or start fewer ranks per host")


def ranks_on_hosts(records: Sequence[Mapping[str, Any]]) -> str:
    """"ranks 0, 1 on n1, rank 4 on n2": the ranks of ``records`` grouped by host, in rank order."""
    by_host: Dict[str, List[int]] = defaultdict(list)
    for record in sorted(records, key=lambda r: r["rank"]):
        by_host[record["host"]].append(record["rank"])
    return ", ".join(f"{'ranks' if len(ranks) > 1 else 'rank'} {', '.join(map(str, ranks))} on {host}"
                     for host, ranks in by_host.items())


def device_refusal(records: Sequence[Mapping[str, Any]]) -> Optional[str]:
    """Why the job cannot start on the devices its ranks took, or None. ``records``: every rank's
    {"rank", "host", "device" (None after an error), "uuid" (a GPU's, else None), "error"}, the same
    list on every rank, so every rank reaches the same verdict."""
    failed: Dict[str, List[Mapping[str, Any]]] = defaultdict(list)
    for record in records:
        if record["error"]:
            failed[record["error"]].append(record)
    if failed:
        everyone = f" (all {len(records)} ranks stop with this error)" if len(records) > 1 else ""
        return ("no device for " + "; ".join(f"{ranks_on_hosts(ranks)}: {error}" for error, ranks in failed.items())
                + everyone)
    on_cpu = [r for r in records if r["device"] == "cpu"]
    if on_cpu and len(on_cpu) < len(records):
        on_gpu = [r for r in records if r["device"] != "cpu"]
        return (f"{ranks_on_hosts(on_cpu)} {'sees' if len(on_cpu) == 1 else 'see'} no GPU and would compute on "
                f"the CPU, {ranks_on_hosts(on_gpu)} on GPUs: Horovod refuses a collective whose ranks' tensors are "
                f"on different kinds of device. Give every rank a GPU (a CUDA build of torch, CUDA_VISIBLE_DEVICES; "
                f"hvdtrain doctor --gpu on one of those hosts shows what it sees), or hide the GPUs from every rank "
                f"(CUDA_VISIBLE_DEVICES=) to train on CPUs")
    problems = shared_gpus([(r["rank"], r["host"], r["uuid"]) for r in records if r["uuid"]])
    return sharing_refusal(problems) if problems else None


Gather = Callable[[Dict[str, Any]], Sequence[Mapping[str, Any]]]


def take_device(rank: int, local_rank: int, local_size: int, host: str, gather: Optional[Gather],
                cuda: Any = torch.cuda) -> torch.device:
    """This rank's device (``choose_device``), made CUDA's current one on a GPU, and agreed with every
    rank: every rank raises the same ValueError when ``device_refusal`` finds a problem.

    Args:
        rank: this rank.
        local_rank: its index on its host.
        local_size: ranks on its host.
        host: the host's name, for the messages.
        gather: hands this rank's record to every rank and returns all of them (a collective, entered whatever happened
            here); None (Horovod elastic, whose workers joining later must run no collective at start): this rank's own
            choice alone is checked.
        cuda: torch.cuda, or a stand-in in the tests.
    """
    record: Dict[str, Any] = {"rank": rank, "host": host, "device": None, "uuid": None, "error": None}
    try:
        visible = cuda.device_count() if cuda.is_available() else 0
        device = torch.device(choose_device(local_rank, local_size, visible, host))
        if device.type == "cuda":
            cuda.set_device(device)
            record["uuid"] = str(cuda.get_device_properties(device).uuid)
        record["device"] = str(device)
    except Exception as error:  # any error, CUDA's too: this rank must still enter the gather, then all raise
        record["error"] = f"{type(error).__name__}: {str(error) or 'no message'}"
    refusal = device_refusal(gather(record) if gather is not None else [record])
    if refusal:
        raise ValueError(refusal)
    return torch.device(record["device"])


def device_peaks(device: torch.device, cuda: Any = torch.cuda) -> Dict[str, int]:
    """On a GPU, the peak bytes torch's caching allocator handed out (``cuda_peak_allocated``) and
    held from the driver (``cuda_peak_reserved``, what nvidia-smi shows); nothing on a CPU."""
    if device.type != "cuda":
        return {}
    return {"cuda_peak_allocated": cuda.max_memory_allocated(device),
            "cuda_peak_reserved": cuda.max_memory_reserved(device)}
