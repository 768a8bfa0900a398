"""A short all-reduce probe, run in every rank by ``hvdtrain doctor`` under mpirun.

Rank 0 prints one JSON line: the median time of an in-place all-reduce of SIZE_MB and its bus
bandwidth (nccl-tests' busbw = size/time x 2(n-1)/n), plus the hosts the ranks ran on.
"""
import json
import socket
import statistics
import sys
import time

import torch

import horovod.torch as hvd

SIZE_MB = 16
REPEATS = 7


def main() -> int:
    hvd.init()
    tensor = torch.ones(SIZE_MB * 2**20 // 4)
    hosts = hvd.allgather_object(socket.gethostname(), name="probe.hosts")
    hvd.allreduce_(tensor, op=hvd.Sum, name="probe.warmup")
    times = []
    for _ in range(REPEATS):
        hvd.barrier()
        start = time.perf_counter()
        hvd.allreduce_(tensor, op=hvd.Sum, name="probe.allreduce")
        times.append(time.perf_counter() - start)
    # The slowest rank bounds the collective.
    slowest = hvd.allreduce(torch.tensor(times, dtype=torch.float64), op=hvd.Max, name="probe.times")
    seconds = statistics.median(slowest.tolist())
    size = hvd.size()
    if hvd.rank() == 0:
        busbw = SIZE_MB * 2**20 / seconds * (2 * (size - 1) / size) if size > 1 else float("nan")
        print(json.dumps({"ranks": size, "hosts": sorted(set(hosts)), "size_mb": SIZE_MB,
                          "seconds": seconds, "busbw_gbps": busbw / 1e9}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
