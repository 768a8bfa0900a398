"""train.cpu_allocator: a CPU rank's malloc keeps what a step freed, unless told or tuned otherwise."""
import json
import subprocess
import sys

import pytest

from hvdtrain.config.train import CPU_ALLOCATOR_MODES, TrainConfig
from hvdtrain.distributed import cpu_allocator

# In a process of its own (mallopt is process-wide): steps that each make a 64 MiB and a 16 MiB
# tensor (a gradient bucket, a gathered unit), fill them and free them, as training does. Measured
# in the last step, once malloc has settled (a cached heap takes a step or two to hold the blocks
# at their alignment): the minor page faults of the fills, and the resident memory the free gave back.
CYCLE = """
import ctypes, json, resource, sys, threading
import torch
from hvdtrain.distributed import cpu_allocator

def resident():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()

outcome = cpu_allocator.keep_freed_memory(sys.argv[1], {})
for step in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    large = torch.empty(16 * 2**20).fill_(1.0)  # 64 MiB: above glibc's largest dynamic mmap threshold
    medium = torch.empty(4 * 2**20).fill_(1.0)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    held = resident()
    del large, medium
    returned = held - resident()


def heaps():
    # glibc's malloc_info: one <heap nr=...> element per arena.
    libc = ctypes.CDLL(None)
    libc.open_memstream.restype = ctypes.c_void_p
    libc.malloc_info.argtypes, libc.fclose.argtypes = [ctypes.c_int, ctypes.c_void_p], [ctypes.c_void_p]
    text, size = ctypes.c_char_p(), ctypes.c_size_t()
    stream = libc.open_memstream(ctypes.byref(text), ctypes.byref(size))
    libc.malloc_info(0, stream)
    libc.fclose(stream)
    return text.value.decode().count("<heap nr=")

counted = []

def thread_that_allocates():  # as Horovod's background thread allocates the collectives' outputs
    block = torch.empty(2**18).fill_(1.0)
    counted.append(heaps())

before = heaps()  # torch's own threads may have made some already
worker = threading.Thread(target=thread_that_allocates)
worker.start()
worker.join()
print(json.dumps({"outcome": outcome, "returned": returned, "faults": faults, "new_arenas": counted[0] - before}))
"""
MIB = 2**20


def cycle(mode):
    done = subprocess.run([sys.executable, "-c", CYCLE, mode], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_cached_the_freed_blocks_stay_mapped_and_a_settled_step_faults_no_page_in():
    """glibc's default munmaps the 64 MiB block at every free (it goes back at once) and every step
    faults its pages in again: at least one fault per 2 MiB even where transparent huge pages map
    it whole. The cache keeps the blocks in malloc's free lists: nothing goes back, and a settled
    step faults at most a few pages (the interpreter's own small allocations)."""
    system, cached = cycle("system"), cycle("cache")
    assert system["returned"] >= 60 * MIB and system["faults"] >= 64 * MIB // (2 * MIB)
    assert cached["outcome"].startswith("malloc keeps freed memory")
    assert cached["returned"] < 1 * MIB and cached["faults"] < 64


def test_cached_another_thread_allocates_from_the_main_heap():
    """A thread's own arena hands an emptied heap back to the system whatever the trim threshold:
    cached, a thread started afterwards (Horovod's is) gets no arena of its own."""
    assert cycle("system")["new_arenas"] >= 1 and cycle("cache")["new_arenas"] == 0


@pytest.mark.parametrize("environ, said", [
    ({"MALLOC_MMAP_THRESHOLD_": "131072"}, "malloc left alone: MALLOC_MMAP_THRESHOLD_ is set"),
    ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, "malloc left alone: GLIBC_TUNABLES is set"),
    ({"MALLOC_ARENA_MAX": "4"}, "malloc left alone: MALLOC_ARENA_MAX is set"),
    ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, "malloc left alone: jemalloc is preloaded"),
])
def test_a_tuning_of_the_users_own_is_left_alone(environ, said):
    assert cpu_allocator.keep_freed_memory("cache", environ) == said


def test_the_setting_takes_cache_or_system_and_names_them_otherwise():
    assert TrainConfig().cpu_allocator == "cache"
    assert CPU_ALLOCATOR_MODES == cpu_allocator.MODES  # the settings' layer keeps its own copy
    with pytest.raises(ValueError, match="cpu_allocator.*cache.*system"):
        TrainConfig(cpu_allocator="jemalloc")


def test_system_after_an_init_that_cached_says_malloc_still_caches_and_how_to_avoid_it():
    """hvdtrain.init() without a config caches; the Trainer's config saying system comes too late
    (glibc cannot be given its default back): the start line says so rather than "glibc's default"."""
    script = ("import sys; from hvdtrain.distributed import cpu_allocator as c; "
              "print(c.keep_freed_memory(sys.argv[1], {})); print(c.keep_freed_memory('system', {}))")
    first, then = subprocess.run([sys.executable, "-c", script, "cache"], capture_output=True, text=True,
                                 timeout=120, check=True).stdout.splitlines()
    assert first.startswith("malloc keeps freed memory (")
    assert then.startswith("malloc keeps freed memory: an earlier hvdtrain.init() without the run's config set it")
    assert then.endswith("call hvdtrain.init(config)")
    alone = subprocess.run([sys.executable, "-c", script, "system"], capture_output=True, text=True,
                           timeout=120, check=True).stdout.splitlines()
    assert alone == ["glibc's default malloc (train.cpu_allocator=system)"] * 2
