"""An out-of-memory error that says what happened and what would fit.

A rank that cannot allocate raises torch's error (``torch.OutOfMemoryError`` on a GPU, a
RuntimeError "can't allocate memory" on the CPU), which names a byte count and nothing else. The
Trainer turns it into ``OutOfMemory``: which rank on which host, in which phase, under which
strategy, what it held (counted from the tensors' storages), the memory limit it ran into, and
what each strategy needs per rank for this model at this worker count (the ZeRO arithmetic), so
the user knows which setting would fit. The rank then exits, and the launcher ends the job.
"""
from __future__ import annotations

import os
import re
import resource
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Dict, Iterator, Optional, Tuple

import torch

from hvdtrain.common.capabilities import STRATEGY_NAMES

# hsdp's share depends on its shard groups' size, which an out-of-memory report does not know: left out.
STRATEGIES = tuple(name for name in STRATEGY_NAMES if name != "hsdp")
from hvdtrain.planner.memory import sharded_state_bytes
from hvdtrain.common.units import format_bytes, parse_bytes
from hvdtrain.distributed.devices import device_peaks

# Optimizer state, in parameter-sized tensors, of the usual optimizers (exp_avg and exp_avg_sq...).
STATE_TENSORS_PER_PARAMETER = {
    "Adam": 2, "AdamW": 2, "NAdam": 2, "RAdam": 2, "Adamax": 2, "Adadelta": 2,
    "Adagrad": 1, "Rprop": 2, "ASGD": 2,
}
_TRIED = re.compile(r"tried to allocate (\d+) bytes|Tried to allocate ([0-9.]+ (?:B|KiB|MiB|GiB))", re.I)


class OutOfMemory(RuntimeError):
    """A rank ran out of memory; the message says where, what it held and what would fit."""


def is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, getattr(torch, "OutOfMemoryError", ())) or isinstance(error, MemoryError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text)


@contextmanager
def explained(describe: Callable[[BaseException], str]) -> Iterator[None]:
    """Inside the block, torch's allocation failure becomes OutOfMemory(describe(error))."""
    try:
        yield
    except Exception as error:
        if is_out_of_memory(error):
            raise OutOfMemory(describe(error)) from error
        raise


def tried_bytes(message: str) -> Optional[int]:
    """The allocation that failed, as torch's message gives it."""
    match = _TRIED.search(message)
    if not match:
        return None
    if match.group(1):
        return int(match.group(1))
    return int(parse_bytes(match.group(2)))


def state_tensors_per_parameter(optimizer: torch.optim.Optimizer) -> int:
    name = type(optimizer).__name__
    if name in STATE_TENSORS_PER_PARAMETER:
        return STATE_TENSORS_PER_PARAMETER[name]
    defaults = optimizer.defaults
    if name == "SGD":
        return 1 if defaults.get("momentum", 0) else 0
    if name == "RMSprop":
        return 1 + bool(defaults.get("momentum", 0)) + bool(defaults.get("centered", False))
    return 2  # unknown: assume Adam's two moments


def bytes_per_rank(strategy: str, parameters: int, element_size: int, state_tensors: int, workers: int) -> int:
    """The ZeRO arithmetic (hvdtrain.planner.memory's): what a rank holds in parameters, gradients and optimizer state.

    Args:
        strategy: ddp, zero1, zero2, fsdp or ps.
        parameters: the model's parameter count.
        element_size: bytes per parameter.
        state_tensors: optimizer state tensors per parameter (Adam: 2).
        workers: data-parallel ranks sharing the shards.
    """
    held = sharded_state_bytes(strategy, parameters, element_size, element_size, state_tensors * element_size, workers)
    return int(sum(held.values()))


def memory_limit(device: torch.device) -> Optional[Tuple[int, str]]:
    """The smallest limit this process runs under, and where it comes from."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, f"{device} memory"
    found = []
    for name in ("RLIMIT_DATA", "RLIMIT_AS"):
        soft, _ = resource.getrlimit(getattr(resource, name))
        if soft != resource.RLIM_INFINITY:
            found.append((soft, name))
    for path in (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes")):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:
            found.append((int(text), f"cgroup {path}"))
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    found.append((pages, "the machine's memory"))
    return min(found)


def explain(error: BaseException, *, rank: int, host: str, phase: str, strategy: str, workers: int,
            model: torch.nn.Module, optimizer: torch.optim.Optimizer, held: Dict[str, int],
            device: torch.device) -> str:
    """The OutOfMemory message for ``error`` (a local computation: no collective).

    Args:
        error: the out-of-memory error.
        rank: this rank.
        host: its host.
        phase: what was running (set-up, a step, evaluation).
        strategy: the strategy's name.
        workers: data-parallel ranks.
        model: the model, for its parameter count and dtype.
        optimizer: its optimizer, for its state per parameter.
        held: bytes this rank holds, by what.
        device: the device that ran out, for its peaks.
    """
    parameters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    element = next((p.element_size() for p in model.parameters()), 4)
    states = state_tensors_per_parameter(optimizer)
    needs = {name: bytes_per_rank(name, parameters, element, states, workers) for name in STRATEGIES}
    tried = tried_bytes(str(error))
    limit, source = memory_limit(device)
    holding = ", ".join(f"{key} {format_bytes(value)}" for key, value in {**held, **device_peaks(device)}.items())
    options = "; ".join(f"{name} {format_bytes(value)}" for name, value in needs.items())
    current = needs[strategy] if strategy in needs else sum(held.values())  # hsdp: what it counted
    smaller = [name for name in STRATEGIES if needs[name] < current]
    hint = (f"try --train.strategy={smaller[-1]} (it holds the least), or more workers"
            if smaller else "use more workers or a device with more memory")
    return (f"rank {rank} on {host} ran out of memory during {phase} under strategy {strategy}"
            + (f": it tried to allocate {format_bytes(tried)}" if tried is not None else "")
            + (f" while holding {holding} (counted from tensor storages)" if holding else "")
            + ". Its limit is "
              f"{format_bytes(limit)} ({source}). The model has {parameters / 1e6:.1f}M parameters and "
              f"{type(optimizer).__name__} keeps {states} state tensor(s) per parameter: per rank at "
              f"{workers} workers, {options} (parameters + gradients + optimizer state, before "
              f"activations and communication buffers). {hint}. ({type(error).__name__}: "
              f"{str(error).splitlines()[0][:200]})")
