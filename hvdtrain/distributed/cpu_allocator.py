"""On a CPU rank, glibc's malloc made to keep the memory a step frees for the next step.

Out of the box, glibc serves every block above its mmap threshold (128 KiB, growing up to 32 MiB)
with a fresh mmap and gives it back with munmap on free. A training step allocates and frees the
same large tensors every time (activations, gradient buckets, a sharded strategy's gathered units
and reduce-scatter buffers), so every step first-touches them again, page by page, in the kernel:
`hvdtrain bench strategies` counted 64,000 (ddp) to 109,000 (fsdp) minor page faults per step and
rank on its 25M-parameter model, and 140-290 ms of system CPU per step.

``keep_freed_memory`` turns that off: no block is mmapped (M_MMAP_MAX 0), the heap's free top is
never trimmed (M_TRIM_THRESHOLD -1), and every thread allocates from the one main heap (M_ARENA_MAX
1), so a freed block goes back to malloc's free lists and the next step's allocation of that size
takes it, already mapped. The last matters for the collectives' outputs, which Horovod's background
thread allocates: a thread's own arena gives an emptied heap of its own back to the system whatever
the trim threshold, and the bench still counted 17,000-21,000 faults per step under zero and fsdp
without it, against 550-1,600 with it. This is what CUDA's caching allocator does on a GPU.

The cost: the process's resident memory stays at the most a step ever held (plus what fragmentation
adds), instead of falling back between steps; ``train.cpu_allocator=system`` keeps glibc's default.
A tuning the user gave (MALLOC_* or GLIBC_TUNABLES, a preloaded jemalloc, tcmalloc or mimalloc) is
left alone, as is any C library but glibc.
"""
from __future__ import annotations

import ctypes
import os
from typing import Mapping, Optional

MODES = ("cache", "system")
# glibc's mallopt parameter numbers (malloc.h).
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
NEVER_TRIM = -1  # mallopt(3): "Setting M_TRIM_THRESHOLD to -1 disables trimming completely"
USER_TUNING = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_MAX_", "MALLOC_TOP_PAD_",
               "MALLOC_ARENA_MAX", "GLIBC_TUNABLES")
OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")
# Whether this process's malloc was set to keep freed memory: mallopt cannot give glibc back its
# default (the mmap threshold that adapts stays fixed once set), so a later "system" must say so.
_kept = False


def keep_freed_memory(mode: str = "cache", environ: Mapping[str, str] = os.environ) -> str:
    """Apply ``mode`` ("cache" or "system") to this process's malloc; returns what was done, in words
    for the start line (or why nothing was). Call it before starting threads that allocate
    (hvd.init() starts Horovod's): a thread that already has an arena of its own keeps it."""
    global _kept
    if mode not in MODES:
        raise ValueError(f"train.cpu_allocator={mode!r}: choose one of {', '.join(MODES)}")
    if mode == "system":
        if _kept:  # hvdtrain.init() without the run's config, then a Trainer whose config says system
            return ("malloc keeps freed memory: an earlier hvdtrain.init() without the run's config set it, and "
                    "glibc cannot undo it; for train.cpu_allocator=system, call hvdtrain.init(config)")
        return "glibc's default malloc (train.cpu_allocator=system)"
    reason = _left_alone(environ)
    if reason:
        return reason
    libc = _glibc()
    if libc is None:
        return "malloc left alone: the C library is not glibc"
    if not all(libc.mallopt(parameter, value) for parameter, value in
               ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, NEVER_TRIM), (M_ARENA_MAX, 1))):
        return "malloc left alone: glibc's mallopt refused the setting"
    _kept = True
    return "malloc keeps freed memory (train.cpu_allocator=system returns it)"


def _left_alone(environ: Mapping[str, str]) -> Optional[str]:
    given = [name for name in USER_TUNING if environ.get(name)]
    if given:
        return f"malloc left alone: {given[0]} is set"
    preloaded = environ.get("LD_PRELOAD", "")
    other = next((name for name in OTHER_ALLOCATORS if name in preloaded), None)
    return f"malloc left alone: {other} is preloaded" if other else None


def _glibc() -> Optional[ctypes.CDLL]:
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # absent from musl and other C libraries
        libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc
