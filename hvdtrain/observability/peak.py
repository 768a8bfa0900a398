"""What one rank's device can compute at most, the denominator of MFU, and where that figure came from.

A GPU's is its vendor's dense tensor-core figure for the training dtype (no 2:4 sparsity), from a
small table by the device's name. A CPU's has no such table (cores, vector units and clocks vary):
it is measured once at set-up, ten products of ``torch.matmul`` in the training dtype on the rank's
own threads (about a tenth of a second), timed in CPU time (the cores' rate, however many other
processes share them). A GPU
missing from the table, or a dtype missing from its row, is measured the same way. No collective:
every rank measures its own (set-up under Horovod elastic runs none), and rank 0 reports. A process
measures once per device, dtype and thread count: a second Trainer (a sweep, a test suite) reuses it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch

# Dense TFLOP/s by device name, from the vendors' data sheets. fp32 is plain fp32 (torch's default
# for matmul); tf32 when torch.backends.cuda.matmul.allow_tf32 is set. Rows are matched in order:
# a more specific name first.
DEVICE_PEAK_TFLOPS: Tuple[Tuple[Tuple[str, ...], Dict[str, float]], ...] = (
    (("H100", "PCIE"), {"bfloat16": 756.0, "float16": 756.0, "tf32": 378.0, "float32": 51.0}),
    (("H100", "NVL"), {"bfloat16": 835.0, "float16": 835.0, "tf32": 418.0, "float32": 60.0}),
    (("H100",), {"bfloat16": 989.0, "float16": 989.0, "tf32": 494.0, "float32": 67.0}),  # SXM
    (("H200",), {"bfloat16": 989.0, "float16": 989.0, "tf32": 494.0, "float32": 67.0}),
    (("B200",), {"bfloat16": 2250.0, "float16": 2250.0}),
    (("A100",), {"bfloat16": 312.0, "float16": 312.0, "tf32": 156.0, "float32": 19.5}),
    (("L40S",), {"bfloat16": 362.0, "float16": 362.0, "tf32": 183.0, "float32": 91.6}),
    (("L4",), {"bfloat16": 121.0, "float16": 121.0, "tf32": 60.0, "float32": 30.3}),
    (("V100",), {"float16": 125.0, "float32": 15.7}),  # no bfloat16 tensor cores
)

MEASURE_REPEATS = 10  # the CPU (or unlisted GPU) measurement, once per rank at set-up: about 0.1 s
_MEASURED: Dict[Tuple[str, torch.dtype, int], float] = {}  # this process's measurements


@dataclass(frozen=True)
class Peak:
    """A rank's peak FLOP/s and where it came from ("A100 table, bfloat16")."""

    flops_per_sec: float
    source: str

    def describe(self) -> str:
        return f"peak {self.flops_per_sec / 1e12:.3g} TFLOPs/s per rank, {self.source}"


def table_peak(device_name: str, dtype: str) -> Optional[float]:
    """The table's dense TFLOP/s for ``device_name`` (torch.cuda.get_device_name) in ``dtype``, or None."""
    name = device_name.upper()
    for keys, row in DEVICE_PEAK_TFLOPS:
        if all(key in name for key in keys):
            return row.get(dtype)
    return None


def cpu_seconds() -> float:
    """This process's CPU time over its intra-op threads: the wall time its products would take with
    those threads to themselves."""
    return time.process_time() / torch.get_num_threads()


def measure_matmul(device: torch.device, dtype: torch.dtype, repeats: int = MEASURE_REPEATS,
                   size: Optional[int] = None, clock: Optional[Callable[[], float]] = None) -> float:
    """FLOP/s of square ``torch.matmul`` in ``dtype`` on ``device``: the fastest of ``repeats``
    (after one warm-up product). A CPU's products are timed in this process's CPU time: on cores
    shared with other processes (other ranks, other jobs) wall time would measure its share of
    them, not their rate; the contention then shows in the MFU, as it should.

    Args:
        device: where to multiply.
        dtype: the training dtype.
        repeats: products timed.
        size: the matrices' side (default 512 on a CPU, 4096 on a GPU).
        clock: the timer (default: cpu_seconds on a CPU, wall time on a GPU).
    """
    gpu = device.type == "cuda"
    size = size or (4096 if gpu else 512)
    clock = clock or (time.perf_counter if gpu else cpu_seconds)
    # A generator of its own: the training's random streams (dropout, data order, checkpoints' RNG
    # state) must not depend on whether this process measured its peak already.
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, generator=generator).to(dtype)
    b = torch.randn(size, size, device=device, generator=generator).to(dtype)
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    torch.matmul(a, b)
    sync()
    best = float("inf")
    for _ in range(repeats):
        before = clock()
        torch.matmul(a, b)
        sync()
        best = min(best, clock() - before)
    return 2.0 * size ** 3 / max(best, 1e-12)


def training_dtype(precision: str, device: torch.device) -> Tuple[torch.dtype, str]:
    """The dtype matrix products run in under train.precision, and its name in the table (tf32 when
    a GPU's fp32 products are allowed to use it)."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    if dtype is torch.float32 and device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return dtype, "tf32"
    return dtype, str(dtype).replace("torch.", "")


def measured_once(device: torch.device, dtype: torch.dtype) -> float:
    """measure_matmul's FLOP/s, measured once per device, dtype and thread count in this process."""
    key = (str(device), dtype, torch.get_num_threads())
    if key not in _MEASURED:
        _MEASURED[key] = measure_matmul(device, dtype)
    return _MEASURED[key]


def device_peak(device: torch.device, precision: str) -> Peak:
    """This rank's peak for train.precision: the table's for a listed GPU, else a measured matmul."""
    dtype, name = training_dtype(precision, device)
    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
        listed = table_peak(device_name, name)
        if listed is not None:
            return Peak(listed * 1e12, f"{device_name} dense {name} (data sheet)")
        return Peak(measured_once(device, dtype), f"measured {name} matmul on {device_name} (not in the table)")
    return Peak(measured_once(device, dtype), f"measured {name} matmul")
