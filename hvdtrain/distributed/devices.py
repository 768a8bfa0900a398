"""Which device a rank computes on, for every way a site hands out GPUs.

- No GPU visible: the CPU.
- As many GPUs visible as ranks on the host, or more (one node, all its GPUs, ``horovodrun`` or
  ``mpirun``): rank by local rank, ``cuda:<local rank>``.
- One GPU visible to each rank (SLURM's ``--gpus-per-task=1``, or a wrapper setting
  ``CUDA_VISIBLE_DEVICES`` to one entry per rank): ``cuda:0``, which is that rank's own GPU.
- Fewer GPUs than ranks, but more than one: refused at start, with the counts and the fix.
Ranks that end up on the same physical GPU (every rank given ``CUDA_VISIBLE_DEVICES=0``) are found
by the GPUs' UUIDs and refused too: NCCL cannot run a communicator with a GPU twice in it.

Also what a rank's GPU memory peaked at, for the memory report and the out-of-memory message.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Dict, List, Sequence, Tuple

import torch


def choose_device(local_rank: int, local_size: int, visible_gpus: int, host: str) -> str:
    """``cpu``, or ``cuda:<index>`` among the GPUs this process sees; ValueError when the host's
    ranks outnumber its GPUs."""
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


def device_peaks(device: torch.device, cuda: Any = torch.cuda) -> Dict[str, int]:
    """On a GPU, the peak bytes torch's caching allocator handed out (``cuda_peak_allocated``) and
    held from the driver (``cuda_peak_reserved``, what nvidia-smi shows); nothing on a CPU."""
    if device.type != "cuda":
        return {}
    return {"cuda_peak_allocated": cuda.max_memory_allocated(device),
            "cuda_peak_reserved": cuda.max_memory_reserved(device)}
